"""The engine's settings: the knobs, their validation, and the request spec.

EngineConfig holds the knobs a client needs too. It is validated once, stored
as JSON in the segment's header (immutable once the engine runs), and is how
a client learns the spec of the engine it attaches to: it checks every input
against that spec before anything is enqueued. EngineOptions holds those only
the engine's own process needs (the backend, CPUs and GPUs, timeouts).
"""
import dataclasses
import json
import re
from typing import TYPE_CHECKING, ClassVar, Optional, Tuple

import numpy as np

from engine import knobs, spec, tensors
from engine.errors import InvalidInput
from engine.sampling import MAX_LOGPROBS, MAX_TOKEN_ID, RECORD_BYTES, prompt_specs
from engine.shm import codes
from engine.knobs import knob
from engine.tensors import TensorSpec, describe

NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
MAX_IDLE_SPIN_US = 1_000_000  # a batcher spins a second after a batch at most

@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The knobs a client needs too, validated; stored as JSON in the
    segment's header, immutable once the engine runs."""

    name: str = knob(None, "str", "[A-Za-z0-9_.-]{1,64}; names the shared-memory segment")
    input_shape: Tuple = knob((16,), "shape", "per-request shape; a None dim is variable")
    input_dtype: str = knob("float32", "str", "numpy dtype of the input")
    output_shape: Tuple = knob((16,), "shape", "per-request shape of the answer")
    output_dtype: str = knob("float32", "str", "numpy dtype of the answer")
    max_input_shape: Optional[Tuple] = knob(None, "shape", "the padding bound of a variable dim")
    max_batch_size: int = knob(32, "int", "flush when this many are gathered ...")
    max_delay_ms: float = knob(0.0, "float", "... or when the oldest has waited this long")
    idle_spin_us: Optional[float] = knob(None, "float", "after a batch (or an early wake), a "
                                         "batcher with nothing queued spins this long before it "
                                         "sleeps (None: 50 on more than one CPU, 0 on one)")
    queue_capacity: int = knob(1024, "int", "requests queued or being computed at most")
    instances: int = knob(1, "int", "batcher processes serving the one queue")
    priority_levels: int = knob(1, "int", "requests carry a priority in [0, levels); 0 is "
                                "the most urgent")
    slo_ms: Optional[float] = knob(None, "float", "a latency objective: the batch limit adapts "
                                   "to it (AIMD)")
    admission: str = knob("deadline", "str", "'deadline': refuse at enqueue what cannot finish "
                          "before its deadline; 'none': only queue_capacity refuses")
    isolate_failures: bool = knob(True, "bool", "a failed batch is split and retried so only "
                                  "the failing requests fail")
    inputs: Optional[dict] = knob(None, "json", "named inputs {name: [dtype, shape]}; replace "
                                  "input_shape and input_dtype")
    outputs: Optional[dict] = knob(None, "json", "named outputs {name: [dtype, shape]}")
    max_input_shapes: Optional[dict] = knob(None, "json", "{name: bound} of each named input "
                                            "with a None dim")
    allowed_batch_sizes: Optional[Tuple] = knob(None, "ints", "every batch is padded up to one "
                                                "of these sizes")
    length_buckets: Optional[Tuple] = knob(None, "ints", "bounds of the variable dim: a batch "
                                           "holds one bucket, padded to its bound")
    max_batch_tokens: Optional[int] = knob(None, "int", "a batch's padded size along the "
                                           "variable dim, summed, at most this (iterative: "
                                           "the running batch's input lengths + max_steps)")
    iterative: bool = knob(False, "bool", "the factory returns a step model: requests join and "
                           "leave the running batch at every step, answers stream in chunks")
    max_steps: int = knob(256, "int", "iterative: the most chunks (steps) one request's answer "
                          "holds")
    sampling: bool = knob(False, "bool", "iterative: the step model returns logits and the "
                          "engine samples each request's next token (engine.Sampling)")
    max_logprobs: int = knob(5, "int", "sampling: the most top logprobs a request may ask "
                             "(0..20); each chunk holds this many ids and logprobs")
    eos_token_ids: Tuple = knob((), "ints", "sampling: the ids that end a request (stop), "
                                "unless its ignore_eos")
    prompt_logprobs: bool = knob(False, "bool", "sampling: requests may ask their prompt's "
                                 "logprobs; each slot holds them (L x (1 + 2 max_logprobs) x 4 "
                                 "B, L the prompt's bound)")
    warmup: bool = knob(False, "bool", "before ready (and a reload's switch), each batcher calls "
                        "its model on zeros at every batch size and length bucket")
    if TYPE_CHECKING:  # derived by __post_init__, per instance: no fields
        input_specs: ClassVar[Tuple[TensorSpec, ...]]
        output_specs: ClassVar[Tuple[TensorSpec, ...]]

    def __post_init__(self):
        knobs.check(self)
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen)
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise ValueError(f"name must match [A-Za-z0-9_.-]{{1,64}}, got {self.name!r}")
        put("input_shape", tensors.shape_of(self.input_shape, "input_shape", allow_none=True))
        put("output_shape", tensors.shape_of(self.output_shape, "output_shape"))
        for key in ("input_dtype", "output_dtype"):
            put(key, tensors.dtype_name(getattr(self, key), key))
        if self.sampling and self.outputs is None and self.inputs is not None:
            put("outputs", sampled_outputs(self.max_logprobs))  # its own (_check_sampling)
        if (self.inputs is None) != (self.outputs is None) and not (
                self.sampling and self.inputs is None):  # a sampling engine's outputs are named
            raise ValueError("inputs and outputs (named tensors) are given together")
        if self.inputs is not None:
            if self.max_input_shape is not None or None in self.input_shape:
                raise ValueError("named inputs take their bounds from max_input_shapes; "
                                 "input_shape and max_input_shape are the single-array form's")
            ins, outs = tensors.named_specs(self.inputs, self.outputs, self.max_input_shapes)
            if len(ins) + len(outs) > codes.MAX_TENSORS:
                raise ValueError(f"an engine has at most {codes.MAX_TENSORS} tensors (inputs and "
                                 f"outputs), got {len(ins)} + {len(outs)}")
            # stored as plain JSON-able values; the specs are derived
            put("inputs", {t.name: [t.dtype, list(t.shape)] for t in ins})
            put("outputs", {t.name: [t.dtype, list(t.shape)] for t in outs})
            put("max_input_shapes", {t.name: list(t.max_shape) for t in ins
                                     if t.var_axis is not None} or None)
        else:
            if self.max_input_shapes is not None:
                raise ValueError("max_input_shapes is for named inputs; the single-array form "
                                 "takes max_input_shape")
            var = [i for i, d in enumerate(self.input_shape) if d is None]
            if len(var) > 1:
                raise ValueError(f"input_shape may have one variable (None) dim, got "
                                 f"{self.input_shape}")
            if var:
                if self.max_input_shape is None:
                    raise ValueError(f"input_shape {self.input_shape} has a None dim: "
                                     "max_input_shape (the padding bound) is required")
                bound = tensors.shape_of(self.max_input_shape, "max_input_shape")
                fixed_ok = all(d is None or d == b for d, b in zip(self.input_shape, bound))
                if len(bound) != len(self.input_shape) or not fixed_ok:
                    raise ValueError(f"max_input_shape {bound} must match input_shape "
                                     f"{self.input_shape} in rank and fixed dims")
                put("max_input_shape", bound)
            elif self.max_input_shape is not None:
                raise ValueError("max_input_shape is only for an input_shape with a None dim")
            ins = (TensorSpec("", self.input_dtype, self.input_shape,
                              self.max_input_shape or self.input_shape),)
            outs = (TensorSpec("", self.output_dtype, self.output_shape, self.output_shape),)
        put("iterative", bool(self.iterative))
        if not 1 <= int(self.max_steps) <= codes.MAX_STEPS:
            raise ValueError(f"max_steps must be in 1..{codes.MAX_STEPS}, got {self.max_steps}")
        put("max_steps", int(self.max_steps))
        outs = self._check_sampling(put, outs)
        if self.iterative:  # an output's row holds every chunk of an answer
            outs = tuple(dataclasses.replace(t, max_shape=(self.max_steps, *t.shape)) for t in outs)
        var = [t for t in ins if t.var_axis is not None]
        self._check_batch_shapes(put, var)
        for key, low in (("max_batch_size", 1), ("queue_capacity", 1), ("instances", 1)):
            if int(getattr(self, key)) < low:
                raise ValueError(f"{key} must be >= {low}, got {getattr(self, key)}")
            put(key, int(getattr(self, key)))
        if self.queue_capacity > codes.MAX_CAPACITY:
            raise ValueError(f"queue_capacity must be <= {codes.MAX_CAPACITY}, got {self.queue_capacity}")
        if self.max_batch_size > self.queue_capacity:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) must be <= "
                             f"queue_capacity ({self.queue_capacity})")
        if self.instances > codes.MAX_INSTANCES:
            raise ValueError(f"instances must be <= {codes.MAX_INSTANCES}, got {self.instances}")
        if not 1 <= int(self.priority_levels) <= codes.MAX_PRIORITIES:
            raise ValueError(f"priority_levels must be in 1..{codes.MAX_PRIORITIES}, "
                             f"got {self.priority_levels}")
        put("priority_levels", int(self.priority_levels))
        if self.slo_ms is not None:
            if not float(self.slo_ms) > 0:
                raise ValueError(f"slo_ms must be > 0 or None, got {self.slo_ms}")
            put("slo_ms", float(self.slo_ms))
        if self.admission not in ("deadline", "none"):
            raise ValueError(f"admission must be 'deadline' or 'none', got {self.admission!r}")
        put("isolate_failures", bool(self.isolate_failures))
        put("warmup", bool(self.warmup))
        if not float(self.max_delay_ms) >= 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {self.max_delay_ms}")
        put("max_delay_ms", float(self.max_delay_ms))
        if self.idle_spin_us is not None:
            if not 0 <= float(self.idle_spin_us) <= MAX_IDLE_SPIN_US:
                raise ValueError(f"idle_spin_us must be in 0..{MAX_IDLE_SPIN_US} or None, got "
                                 f"{self.idle_spin_us}")
            put("idle_spin_us", float(self.idle_spin_us))
        # derived, not fields (no part of the JSON or of ==)
        put("input_specs", ins)
        put("output_specs", outs)
        # for check_input's and check_out's fast paths
        put("_exact_shape", None if (var or self.named) else self.input_shape)
        put("_input_dtype", np.dtype(self.input_dtype))
        put("_out_shape", None if self.named else tuple(outs[0].shape))
        put("_out_dtype", np.dtype(outs[0].dtype))
        named_out = self.named or self.sampling
        put("_output_names", tuple(s.name for s in outs) if named_out else None)  # None: bare

    def _check_batch_shapes(self, put, var) -> None:
        """allowed_batch_sizes, length_buckets and max_batch_tokens, validated."""
        if self.allowed_batch_sizes is not None:
            sizes = tuple(sorted({int(n) for n in self.allowed_batch_sizes}))
            if int(self.max_batch_size) > codes.MAX_TAKE:
                raise ValueError(f"allowed_batch_sizes needs max_batch_size <= {codes.MAX_TAKE}, "
                                 f"got {self.max_batch_size}")
            if not sizes or sizes[0] < 1 or sizes[-1] > int(self.max_batch_size):
                raise ValueError(f"allowed_batch_sizes must be sizes in 1..max_batch_size "
                                 f"({self.max_batch_size}), got {list(self.allowed_batch_sizes)}")
            put("allowed_batch_sizes", sizes)
        if self.iterative:
            if self.allowed_batch_sizes is not None or self.length_buckets is not None:
                raise ValueError("an iterative engine's running batch takes any size: "
                                 "allowed_batch_sizes and length_buckets are for one-shot ones")
            top = max((t.max_shape[t.var_axis] for t in var), default=0)
            if self.max_batch_tokens is not None:
                if int(self.max_batch_tokens) < top + int(self.max_steps):
                    raise ValueError(f"max_batch_tokens must be >= {top + int(self.max_steps)} "
                                     f"(one request's longest input {top} + max_steps), got "
                                     f"{self.max_batch_tokens}")
                put("max_batch_tokens", int(self.max_batch_tokens))
            return
        if self.length_buckets is None and self.max_batch_tokens is None:
            return
        if not var:
            raise ValueError("length_buckets and max_batch_tokens need an input with a "
                             "variable (None) dim")
        top = max(t.max_shape[t.var_axis] for t in var)
        if self.length_buckets is not None:
            bounds = sorted({int(b) for b in self.length_buckets})
            buckets = len(bounds) + (bool(bounds) and bounds[-1] < top)  # top is appended
            if not bounds or bounds[0] < 1 or bounds[-1] > top or buckets > codes.MAX_BUCKETS:
                raise ValueError(f"length_buckets must be at most {codes.MAX_BUCKETS} bounds in "
                                 f"1..{top} (the largest variable bound), got "
                                 f"{list(self.length_buckets)}")
            if bounds[-1] < top:
                bounds.append(top)  # every request fits a bucket
            put("length_buckets", tuple(bounds))
        if self.max_batch_tokens is not None:
            if int(self.max_batch_tokens) < top:
                raise ValueError(f"max_batch_tokens must be >= {top} (one request of the largest "
                                 f"length), got {self.max_batch_tokens}")
            put("max_batch_tokens", int(self.max_batch_tokens))

    def _check_sampling(self, put, outs):
        """sampling, max_logprobs and eos_token_ids, validated; a sampling
        engine's outputs, which are its own (sampled_outputs)."""
        put("sampling", bool(self.sampling))
        k = self.max_logprobs
        if type(k) is not int or not 0 <= k <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be an int in 0..{MAX_LOGPROBS}, got {k!r}")
        eos = tuple(self.eos_token_ids or ())
        if not all(type(i) is int and 0 <= i <= MAX_TOKEN_ID for i in eos):
            raise ValueError(f"eos_token_ids must be token ids in 0..{MAX_TOKEN_ID}, got "
                             f"{list(eos)}")
        put("eos_token_ids", eos)
        put("prompt_logprobs", bool(self.prompt_logprobs))
        if self.prompt_logprobs and not (self.sampling and not self.named
                                         and len(self.input_shape) == 1):
            raise ValueError(f"prompt_logprobs=True needs sampling=True and one input of token "
                             f"ids (input_shape of one dim), got sampling={self.sampling}, "
                             f"inputs {self.inputs or self.input_shape}")
        if not self.sampling:
            return outs
        if not self.iterative:
            raise ValueError("sampling=True needs iterative=True: the engine samples each step "
                             "of a step model's running batch")
        own = sampled_outputs(k)
        given = (self.outputs if self.outputs is not None
                 else {"": [self.output_dtype, list(self.output_shape)]})
        if given not in (own, {"": ["int64", []]}, {"": ["float32", [16]]}):
            raise ValueError(f"a sampling engine's outputs are its own: expected outputs "
                             f"{own} (or none given), got {given}")
        put("outputs", own)
        put("output_shape", ())
        put("output_dtype", "int64")
        return tuple(TensorSpec(name, dtype, tuple(shape), tuple(shape))
                     for name, (dtype, shape) in own.items())

    # -- derived ------------------------------------------------------------
    @property
    def slot_input_specs(self) -> Tuple[TensorSpec, ...]:
        """The inputs a slot holds: the model's, and with sampling the
        request's Sampling record after them (the model never sees it)."""
        return self.input_specs + ((SAMPLING_RECORD,) if self.sampling else ())

    @property
    def hidden_output_specs(self) -> Tuple[TensorSpec, ...]:
        """The rows a slot holds after the outputs: with prompt_logprobs, the
        prompt's logprobs, which the batcher writes at join (sampling.prompt_specs)."""
        return prompt_specs(self.padded_shape[0], self.max_logprobs) if self.prompt_logprobs \
            else ()

    @property
    def named(self) -> bool:
        """Named tensors: requests and answers are dicts of arrays."""
        return self.inputs is not None

    @property
    def slot_bytes(self) -> Tuple[int, ...]:
        """One slot's row of each tensor, inputs first: the segment's regions."""
        return tuple(t.slot_bytes for t in
                     self.slot_input_specs + self.output_specs + self.hidden_output_specs)

    @property
    def var_axis(self) -> Optional[int]:
        """The index of the single-array form's variable dim, or None."""
        if self.named:
            return None
        return next((i for i, d in enumerate(self.input_shape) if d is None), None)

    @property
    def in_place(self) -> bool:
        """Answers overwrite their own input rows (one region, not two): the
        output spec equals a fixed input spec."""
        return (not self.named and self.var_axis is None and self.input_shape == self.output_shape
                and self.input_dtype == self.output_dtype and not self.iterative)

    @property
    def padded_shape(self) -> Tuple:
        return self.max_input_shape if self.var_axis is not None else self.input_shape

    @property
    def input_slot_bytes(self) -> int:
        return sum(t.slot_bytes for t in self.slot_input_specs)

    @property
    def output_slot_bytes(self) -> int:
        return sum(t.slot_bytes for t in self.output_specs + self.hidden_output_specs)

    @property
    def lends_rows(self) -> bool:
        """request() lends a slot's row: one unnamed input of a fixed shape, and
        one answer (an iterative engine's streams)."""
        return not self.named and self.var_axis is None and not self.iterative

    def input_spec(self) -> str:
        if self.named:
            return "{" + ", ".join(f"{t.name}: {t.spec_text()}" for t in self.input_specs) + "}"
        return self.input_specs[0].spec_text()

    # -- a request and its answer, as the caller gives and gets them -------------
    # Inside the engine both are tensors in spec order (a tuple of arrays); the
    # single-array form is one array, named tensors a dict. These are the only
    # places that tell the two apart (the model's side is batching.model_call's).
    def check_input(self, x) -> Tuple[tuple, tuple]:
        """(arrays, real lengths along each one's variable dim, or 0), in spec
        order; InvalidInput otherwise."""
        if type(x) is np.ndarray and x.shape == self._exact_shape and x.dtype == self._input_dtype:
            return (x,), _NO_LENGTH  # the common case, in three comparisons
        if self.named:
            return tensors.check_named(self.input_specs, x)
        x, length = self.input_specs[0].check(x)
        return (x,), (length,)

    def check_many(self, xs) -> Tuple[tuple, tuple]:
        """((array of n inputs,), (their common real length or 0,)), for infer_many."""
        if self.named:
            raise InvalidInput(f"infer_many takes one array of inputs; an engine of named "
                               f"inputs {self.input_spec()} takes infer() or submit() of a dict")
        ok = isinstance(xs, np.ndarray) and xs.ndim == len(self.input_shape) + 1 and len(xs) > 0
        try:
            _, lengths = self.check_input(xs[0]) if ok else (None, 0)
        except InvalidInput:
            ok = False
        if not ok:
            got = describe(xs) if isinstance(xs, np.ndarray) else type(xs).__name__
            raise InvalidInput(f"expected an array of n >= 1 inputs, each {self.input_spec()}, "
                               f"got {got}")
        return (xs,), lengths

    def check_out(self, out) -> tuple:
        """out's arrays in spec order, each able to take its answer in place;
        InvalidInput otherwise."""
        if (type(out) is np.ndarray and out.shape == self._out_shape
                and out.dtype == self._out_dtype and out.flags.c_contiguous
                and out.flags.writeable):
            return (out,)  # the common case, without a call
        if self.named:
            return tensors.check_named_out(self.output_specs, out)
        tensors.check_out(self.output_specs[0], out)
        return (out,)

    def answer(self, outputs: tuple):
        """The caller's form of an answer given in spec order."""
        if self._output_names is None:
            return outputs[0]
        return dict(zip(self._output_names, outputs))

    def request_of(self, by_name: dict):
        """The caller's form of a request given by spec name (the single-array
        form's one tensor is named "")."""
        return dict(by_name) if self.named else by_name[""]

    def by_name(self, answer) -> dict:
        """An answer in the caller's form as its tensors by spec name."""
        return answer if self.named else {"": answer}

    @property
    def steps(self) -> int:
        """Chunks per slot: max_steps for an iterative engine, 0 for a one-shot one."""
        return self.max_steps if self.iterative else 0

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, blob: bytes) -> "EngineConfig":
        return cls(**json.loads(blob.decode()))


REAP_INTERVAL_S = 0.1

# a sampling engine's hidden input: each request's engine.Sampling record, as bytes
SAMPLING_RECORD = TensorSpec("sampling", "uint8", (RECORD_BYTES,), (RECORD_BYTES,))



def sampled_outputs(max_logprobs: int) -> dict:
    """A sampling engine's chunk: the token, its logprob, and with
    max_logprobs K > 0 the top K ids and their logprobs."""
    own = {"token": ["int64", []], "logprob": ["float32", []]}
    if max_logprobs:
        own.update(top_ids=["int64", [max_logprobs]], top_logprobs=["float32", [max_logprobs]])
    return own


_NO_LENGTH = (0,)  # one tensor of a fixed shape


def per_instance(value, instances: int, what: str):
    if value is None:
        return [None] * instances
    value = list(value)
    if len(value) != instances:
        raise ValueError(f"{what} must give one entry per instance ({instances}), got {len(value)}")
    return value


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The knobs only the engine's own process needs (the others are EngineConfig's)."""

    backend: object = knob("engine.backends:synthetic", "callable",
                           "MOD:FACTORY imported in each batcher, or a picklable callable")
    backend_args: dict = knob(None, "key_values", "keyword arguments for the factory")
    cpus: Optional[list] = knob(None, "cpus", "CPU affinity of each instance, e.g. [[0], [1]]")
    gpus: Optional[list] = knob(None, "gpus", "CUDA_VISIBLE_DEVICES of each instance, e.g. [0, 1]")
    start_timeout_s: float = knob(120.0, "float", "a batcher not serving by then fails start()")
    drain_timeout_s: float = knob(30.0, "float", "stop() answers what is queued for this long")
    batch_timeout_s: Optional[float] = knob(
        None, "float", "a batch running longer is a hung model: its batcher is killed and "
        "replaced, as one that died")
    reap_interval_s: float = knob(REAP_INTERVAL_S, "float",
                                  "how often dead clients' slots are looked for (a client that "
                                  "finds the ring full reclaims them at once)")

    def __post_init__(self):
        knobs.check(self)
        spec.check_spec(self.backend)
        object.__setattr__(self, "backend_args", dict(self.backend_args or {}))
        if self.batch_timeout_s is not None and not self.batch_timeout_s > 0:
            raise ValueError(f"batch_timeout_s must be > 0 or None, got {self.batch_timeout_s}")
        if not self.reap_interval_s > 0:
            raise ValueError(f"reap_interval_s must be > 0, got {self.reap_interval_s}")
