"""The engine's settings: the knobs, their validation, and the request spec.

EngineConfig holds the knobs a client needs too. It is validated once, stored
as JSON in the segment's header (immutable once the engine runs), and is how
a client learns the spec of the engine it attaches to: it checks every input
against that spec before anything is enqueued.
"""
import dataclasses
import json
import re
from typing import Optional, Tuple

import numpy as np

from engine import ring
from engine.errors import InvalidInput

NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}\Z")
DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
          "uint64", "float16", "float32", "float64", "complex64", "complex128")


def _shape(value, what: str, allow_none: bool = False) -> Tuple:
    if isinstance(value, (int, np.integer)) or value is None:
        value = (value,)
    dims = tuple(None if d is None else int(d) for d in value)
    for d in dims:
        if d is None and not allow_none:
            raise ValueError(f"{what} must have fixed dims, got {dims}")
        if d is not None and d < 1:
            raise ValueError(f"{what} dims must be >= 1, got {dims}")
    return dims


def shape_text(shape) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def describe(x: np.ndarray) -> str:
    return f"{x.dtype}{shape_text(x.shape)}"


def knob(default, cli: str, doc: str):
    """A dataclass field that is one of Engine(...)'s knobs: its default, how
    `shmbatch serve` parses its flag (str, int, float, shape, cpus, gpus,
    key_values, callable), and what it does. Engine, the CLI's flags and the
    TOML keys are all read off these fields (EngineConfig, EngineOptions)."""
    return dataclasses.field(default=default, metadata={"cli": cli, "doc": doc})


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

    def __post_init__(self):
        put = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen)
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise ValueError(f"name must match [A-Za-z0-9_.-]{{1,64}}, got {self.name!r}")
        put("input_shape", _shape(self.input_shape, "input_shape", allow_none=True))
        put("output_shape", _shape(self.output_shape, "output_shape"))
        for key in ("input_dtype", "output_dtype"):
            dtype = np.dtype(getattr(self, key)).name
            if dtype not in DTYPES:
                raise ValueError(f"{key} must be one of {', '.join(DTYPES)}, got {dtype}")
            put(key, dtype)
        var = [i for i, d in enumerate(self.input_shape) if d is None]
        if len(var) > 1:
            raise ValueError(f"input_shape may have one variable (None) dim, got {self.input_shape}")
        if var:
            if self.max_input_shape is None:
                raise ValueError(f"input_shape {self.input_shape} has a None dim: "
                                 "max_input_shape (the padding bound) is required")
            bound = _shape(self.max_input_shape, "max_input_shape")
            fixed_ok = all(d is None or d == b for d, b in zip(self.input_shape, bound))
            if len(bound) != len(self.input_shape) or not fixed_ok:
                raise ValueError(f"max_input_shape {bound} must match input_shape "
                                 f"{self.input_shape} in rank and fixed dims")
            put("max_input_shape", bound)
        elif self.max_input_shape is not None:
            raise ValueError("max_input_shape is only for an input_shape with a None dim")
        for key, low in (("max_batch_size", 1), ("queue_capacity", 1), ("instances", 1)):
            if int(getattr(self, key)) < low:
                raise ValueError(f"{key} must be >= {low}, got {getattr(self, key)}")
            put(key, int(getattr(self, key)))
        if self.queue_capacity > ring.MAX_CAPACITY:
            raise ValueError(f"queue_capacity must be <= {ring.MAX_CAPACITY}, got {self.queue_capacity}")
        if self.max_batch_size > self.queue_capacity:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) must be <= "
                             f"queue_capacity ({self.queue_capacity})")
        if self.instances > ring.MAX_INSTANCES:
            raise ValueError(f"instances must be <= {ring.MAX_INSTANCES}, got {self.instances}")
        if not 1 <= int(self.priority_levels) <= ring.MAX_PRIORITIES:
            raise ValueError(f"priority_levels must be in 1..{ring.MAX_PRIORITIES}, "
                             f"got {self.priority_levels}")
        put("priority_levels", int(self.priority_levels))
        if self.slo_ms is not None:
            if not float(self.slo_ms) > 0:
                raise ValueError(f"slo_ms must be > 0 or None, got {self.slo_ms}")
            put("slo_ms", float(self.slo_ms))
        if self.admission not in ("deadline", "none"):
            raise ValueError(f"admission must be 'deadline' or 'none', got {self.admission!r}")
        put("isolate_failures", bool(self.isolate_failures))
        if not float(self.max_delay_ms) >= 0:
            raise ValueError(f"max_delay_ms must be >= 0, got {self.max_delay_ms}")
        put("max_delay_ms", float(self.max_delay_ms))
        # for check_input's fast path (not fields: no part of the JSON or of ==)
        put("_exact_shape", None if var else self.input_shape)
        put("_input_dtype", np.dtype(self.input_dtype))

    # -- derived ------------------------------------------------------------
    @property
    def var_axis(self) -> Optional[int]:
        """The index of the variable dim, or None."""
        return next((i for i, d in enumerate(self.input_shape) if d is None), None)

    @property
    def in_place(self) -> bool:
        """Answers overwrite their own input rows (one region, not two): the
        output spec equals a fixed input spec."""
        return (self.var_axis is None and self.input_shape == self.output_shape
                and self.input_dtype == self.output_dtype)

    @property
    def padded_shape(self) -> Tuple:
        return self.max_input_shape if self.var_axis is not None else self.input_shape

    @property
    def input_slot_bytes(self) -> int:
        return int(np.prod(self.padded_shape, dtype=np.int64)) * np.dtype(self.input_dtype).itemsize

    @property
    def output_slot_bytes(self) -> int:
        return int(np.prod(self.output_shape, dtype=np.int64)) * np.dtype(self.output_dtype).itemsize

    def input_spec(self) -> str:
        if self.var_axis is None:
            return f"{self.input_dtype}{shape_text(self.input_shape)}"
        dims = [f"1..{b}" if d is None else str(d)
                for d, b in zip(self.input_shape, self.max_input_shape)]
        return f"{self.input_dtype}[{', '.join(dims)}]"

    def check_input(self, x) -> Tuple[np.ndarray, int]:
        """(array, real length of the variable dim or 0); InvalidInput otherwise."""
        if type(x) is np.ndarray and x.shape == self._exact_shape and x.dtype == self._input_dtype:
            return x, 0  # the common case, in three comparisons
        if not isinstance(x, np.ndarray):
            try:
                x = np.asarray(x, dtype=self.input_dtype)
            except (TypeError, ValueError) as e:
                raise InvalidInput(f"expected {self.input_spec()}, got {type(x).__name__} "
                                   f"not convertible to {self.input_dtype} ({e})") from None
        elif x.dtype != self.input_dtype:
            raise self._mismatch(x)
        if x.ndim != len(self.input_shape):
            raise self._mismatch(x)
        length = 0
        for axis, (got, want) in enumerate(zip(x.shape, self.input_shape)):
            if want is None:
                if not 1 <= got <= self.max_input_shape[axis]:
                    raise self._mismatch(x)
                length = got
            elif got != want:
                raise self._mismatch(x)
        return x, length

    def check_many(self, xs) -> Tuple[np.ndarray, int]:
        """(array of n inputs, their common real length or 0), for infer_many."""
        ok = isinstance(xs, np.ndarray) and xs.ndim == len(self.input_shape) + 1 and len(xs) > 0
        try:
            _, length = self.check_input(xs[0]) if ok else (None, 0)
        except InvalidInput:
            ok = False
        if not ok:
            got = describe(xs) if isinstance(xs, np.ndarray) else type(xs).__name__
            raise InvalidInput(f"expected an array of n >= 1 inputs, each {self.input_spec()}, "
                               f"got {got}")
        return xs, length

    def check_out(self, out) -> None:
        """InvalidInput unless out can take an answer in place."""
        if not (type(out) is np.ndarray and out.shape == self.output_shape
                and out.dtype == self.output_dtype and out.flags.c_contiguous
                and out.flags.writeable):
            got = (f"{describe(out)}{'' if out.flags.c_contiguous else ' not C-contiguous'}"
                   f"{'' if out.flags.writeable else ' read-only'}"
                   if isinstance(out, np.ndarray) else type(out).__name__)
            raise InvalidInput(f"out: expected a writable C-contiguous {self.output_dtype}"
                               f"{shape_text(self.output_shape)}, got {got}")

    def _mismatch(self, x: np.ndarray) -> InvalidInput:
        return InvalidInput(f"expected {self.input_spec()}, got {describe(x)}")

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_json(cls, blob: bytes) -> "EngineConfig":
        return cls(**json.loads(blob.decode()))
