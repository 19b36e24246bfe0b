"""The built-in backends: `engine.backends:synthetic`, `:identity` and `:onnx`.

Each is a factory (engine.spec): it runs once inside each batcher process and
returns ``fn(batch)`` (or ``fn(batch, lengths)`` for a variable dim). The
batch is valid only during the call: it may be a view of the shared segment.
"""
import os
from typing import Any, Optional, Sequence

from engine.shm import ring
from engine.spec import Backend as Backend
from engine.spec import Batch as Batch
from engine.spec import Factory as Factory


def synthetic(fixed_ms: float = 2.0, per_item_us: float = 100.0,
              cost_file: Optional[str] = None) -> Backend:
    """A cost model: busy-waits fixed_ms + n * per_item_us per batch
    (in C, with the GIL released, as a real model's kernels run), then
    returns input * 2 + 1. With cost_file, the cost is re-read from that file
    ("FIXED_MS PER_ITEM_US") whenever it changes: a model that slows down, or
    speeds up, while it serves."""
    cost = [int(float(fixed_ms) * 1e6), int(float(per_item_us) * 1e3)]
    seen: list = [None]

    def reread() -> None:
        try:
            stamp = os.stat(str(cost_file)).st_mtime_ns
            if stamp != seen[0]:
                with open(str(cost_file)) as f:
                    fixed, per_item = f.read().split()[:2]
                cost[:] = int(float(fixed) * 1e6), int(float(per_item) * 1e3)
                seen[0] = stamp
        except (OSError, ValueError):
            pass  # missing or half-written: keep the last cost

    def run(batch, lengths=None):
        if cost_file:
            reread()
        ring.spin_ns(cost[0] + len(batch) * cost[1])
        return batch * 2 + 1

    return run


def identity() -> Backend:
    """Returns the input at once: the null backend, to measure the engine."""

    def run(batch, lengths=None):
        return batch

    return run


def onnx(path: str, providers: Optional[Sequence[str]] = None,
         intra_op_threads: Optional[int] = None,
         outputs: Optional[Sequence[str]] = None) -> Backend:
    """Runs an ONNX model with onnxruntime: one session per batcher process, one
    session.run per batch. With named tensors the batch maps the model's input
    names to arrays and the result maps its output names to arrays; a model
    with one input and one output (after `outputs`) also serves a
    single-array engine. `outputs` names the model outputs to serve (default:
    all), so a model's other outputs are neither computed into the segment nor
    declared. lengths are not passed on: the model sees padding through its
    own inputs (an attention_mask, say). fn.check_tensors tells the batcher,
    before it serves, whether the engine's tensors fit the model."""
    try:
        import onnxruntime
    except ImportError as e:  # an optional dependency: say how to get it
        raise ImportError("the onnx backend needs onnxruntime: pip install 'shmbatch[onnx]'") from e
    options = onnxruntime.SessionOptions()
    if intra_op_threads is not None:
        options.intra_op_num_threads = int(intra_op_threads)
    options.inter_op_num_threads = 1  # one batch at a time: parallelism is inside each op
    session = onnxruntime.InferenceSession(
        str(path), sess_options=options, providers=providers or ["CPUExecutionProvider"])
    model_inputs = session.get_inputs()
    all_outputs = {a.name: a for a in session.get_outputs()}
    if outputs is None:
        model_outputs = list(all_outputs.values())
    else:
        unknown = [name for name in outputs if name not in all_outputs]
        if unknown or not outputs:
            raise ValueError(f"outputs={list(outputs)}: expected some of the model's outputs "
                             f"{list(all_outputs)} of {path}")
        model_outputs = [all_outputs[name] for name in outputs]
    input_names = [a.name for a in model_inputs]
    output_names = [a.name for a in model_outputs]

    def run(batch: Batch, lengths: Any = None) -> Batch:
        if isinstance(batch, dict):  # its names are the model's (check_tensors, at start)
            return dict(zip(output_names, session.run(output_names, batch)))
        if len(input_names) != 1 or len(output_names) != 1:
            raise ValueError(_single_array_problem(path, input_names, output_names))
        return session.run(output_names, {input_names[0]: batch})[0]

    def check_tensors(inputs: dict, outputs: dict) -> None:
        """ValueError naming every way the engine's tensors ({name: (dtype,
        shape)}; the single-array form's one tensor is named '') differ from
        the model's served inputs and outputs."""
        single = list(inputs) == [""] and list(outputs) == [""]
        if single and (len(input_names) != 1 or len(output_names) != 1):
            raise ValueError(f"engine tensors do not fit {path}: "
                             + _single_array_problem(path, input_names, output_names))
        problems = [_not_a_tensor(path, a) for a in model_outputs
                    if not a.type.startswith("tensor(")]
        for kind, engine_side, model_side in (("input", inputs, model_inputs),
                                              ("output", outputs, model_outputs)):
            model = {a.name: a for a in model_side}
            if single:  # the one unnamed tensor is the model's one
                engine_side = {model_side[0].name: engine_side[""]}
            problems += [f"model {kind} {name!r} is not in the engine's {kind}s"
                         for name in model if name not in engine_side]
            problems += [f"engine {kind} {name!r} is not a model {kind} (model has {sorted(model)})"
                         for name in engine_side if name not in model]
            for name, (dtype, shape) in engine_side.items():
                if name in model and model[name].type.startswith("tensor("):
                    problems += _onnx_mismatches(f"{kind} {name!r}", dtype, tuple(shape), model[name])
        if problems:
            raise ValueError(f"engine tensors do not fit {path}: " + "; ".join(problems))

    run.check_tensors = check_tensors  # type: ignore[attr-defined]
    run.session = session  # type: ignore[attr-defined]  # its thread pools, for `status`
    return run


def _single_array_problem(path: Any, input_names: list, output_names: list) -> str:
    return (f"a single-array engine (input_shape, output_shape) serves a model of one input "
            f"and one output; {path} has {len(input_names)} input(s) {input_names} and "
            f"{len(output_names)} output(s) {output_names}: serve one output with "
            f"backend_args outputs=[...], or name the tensors (inputs=, outputs=)")


def _not_a_tensor(path: Any, arg: Any) -> str:
    hint = ""
    if arg.type.startswith("seq(map("):  # skl2onnx's ZipMap: one dict of class -> probability per row
        hint = (": a scikit-learn classifier exported by skl2onnx gives its probabilities as "
                "a ZipMap by default; export it with options={id(model): {'zipmap': False}} "
                "(a tensor of probabilities per row), or leave that output out with "
                "backend_args outputs=[...]")
    return f"model output {arg.name!r} is {arg.type}, not a tensor{hint}"


# onnxruntime's type strings whose numpy name differs; the rest ('int64', 'bool', ...) match
_ONNX_DTYPES = {"float": "float32", "double": "float64"}


def _onnx_mismatches(what: str, dtype: str, shape: tuple, arg: Any) -> list:
    """How the engine's (dtype, shape) of one tensor disagrees with the model's NodeArg."""
    problems = []
    model_dtype = arg.type.removeprefix("tensor(").removesuffix(")")
    model_dtype = _ONNX_DTYPES.get(model_dtype, model_dtype)
    if str(dtype) != model_dtype:
        problems.append(f"{what} dtype is {dtype}, model has {model_dtype}")
    model_shape = tuple(arg.shape[1:])  # the first dim is the batch, fixed or symbolic
    if len(shape) != len(model_shape):
        problems.append(f"{what} has rank {len(shape)} (without the batch), model has "
                        f"{len(model_shape)}: {list(model_shape)}")
        return problems
    for axis, (dim, model_dim) in enumerate(zip(shape, model_shape), start=1):
        if isinstance(model_dim, int) and dim != model_dim:  # symbolic model dims take any size
            got = "variable" if dim is None else dim
            problems.append(f"{what} dim {axis} is {got}, model fixes it to {model_dim}")
    return problems
