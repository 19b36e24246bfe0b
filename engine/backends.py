"""Built-in backends, and how a backend spec becomes a callable.

A backend factory runs once inside each batcher process and returns
``fn(batch)`` (or ``fn(batch, lengths)`` for a variable dim). The batch is
valid only during the call: it may be a view of the shared segment.
"""
import importlib
import os
from typing import Callable, Union

from engine import ring


def synthetic(fixed_ms: float = 2.0, per_item_us: float = 100.0, cost_file: str = None):
    """A cost model: busy-waits fixed_ms + n * per_item_us per batch
    (in C, with the GIL released, as a real model's kernels run), then
    returns input * 2 + 1. With cost_file, the cost is re-read from that file
    ("FIXED_MS PER_ITEM_US") whenever it changes: a model that slows down, or
    speeds up, while it serves."""
    cost = [int(float(fixed_ms) * 1e6), int(float(per_item_us) * 1e3)]
    seen = [None]

    def reread() -> None:
        try:
            stamp = os.stat(cost_file).st_mtime_ns
            if stamp != seen[0]:
                with open(cost_file) as f:
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


def identity():
    """Returns the input at once: the null backend, to measure the engine."""

    def run(batch, lengths=None):
        return batch

    return run


def check_spec(spec: Union[str, Callable]) -> None:
    """ValueError unless spec is a "module:factory" string or a callable (nothing imported)."""
    if callable(spec):
        return
    module, sep, attr = str(spec).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"backend must be 'module:factory' or a callable, got {spec!r}")


def resolve(spec: Union[str, Callable]) -> Callable:
    """A "module:factory" string or a zero-argument callable -> the factory."""
    check_spec(spec)
    if callable(spec):
        return spec
    module, _, attr = str(spec).partition(":")
    factory = getattr(importlib.import_module(module), attr)
    if not callable(factory):
        raise ValueError(f"backend {spec!r} is not callable")
    return factory


def onnx(path: str, providers=None, intra_op_threads: int = None):
    """Runs an ONNX model with onnxruntime: one session per batcher process, one
    session.run per batch. With named tensors the batch maps the model's input
    names to arrays and the result maps its output names to arrays; a model
    with one input and one output also serves a single-array engine. lengths
    are not passed on: the model sees padding through its own inputs (an
    attention_mask, say). fn.check_tensors tells the batcher, before it serves,
    whether the engine's tensors fit the model."""
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
    model_inputs, model_outputs = session.get_inputs(), session.get_outputs()
    input_names, output_names = [a.name for a in model_inputs], [a.name for a in model_outputs]

    def run(batch, lengths=None):
        if isinstance(batch, dict):  # its names are the model's (check_tensors, at start)
            return dict(zip(output_names, session.run(None, batch)))
        if len(input_names) != 1 or len(output_names) != 1:
            raise ValueError(f"a single-array batch needs a model with one input and one output; "
                             f"{path} has {len(input_names)} and {len(output_names)}")
        return session.run(None, {input_names[0]: batch})[0]

    def check_tensors(inputs: dict, outputs: dict) -> None:
        problems = []
        for kind, engine_side, model_side in (("input", inputs, model_inputs),
                                              ("output", outputs, model_outputs)):
            model = {a.name: a for a in model_side}
            problems += [f"model {kind} {name!r} is not in the engine's {kind}s"
                         for name in model if name not in engine_side]
            problems += [f"engine {kind} {name!r} is not a model {kind} (model has {sorted(model)})"
                         for name in engine_side if name not in model]
            for name, (dtype, shape) in engine_side.items():
                if name in model:
                    problems += _onnx_mismatches(f"{kind} {name!r}", dtype, tuple(shape), model[name])
        if problems:
            raise ValueError(f"engine tensors do not fit {path}: " + "; ".join(problems))

    run.check_tensors = check_tensors
    return run


# onnxruntime's type strings whose numpy name differs; the rest ('int64', 'bool', ...) match
_ONNX_DTYPES = {"float": "float32", "double": "float64"}


def _onnx_mismatches(what: str, dtype: str, shape: tuple, arg) -> list:
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
