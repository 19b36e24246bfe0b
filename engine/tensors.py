"""Tensors: what one request's input or answer is made of, and its checks.

An engine has input tensors and output tensors. The single-array form
(input_shape, output_shape) is one unnamed tensor each way; named tensors
(inputs={name: (dtype, shape)}) are any number of each. Each tensor is one
region of the segment, [capacity, *max_shape] of its dtype, so a contiguous
run of slots is a contiguous batch of every tensor. An input tensor may have
one variable (None) dim, padded to its bound (max_input_shapes); a request's
real length along it travels with the request.
"""
import dataclasses
from typing import Optional, Tuple

import numpy as np

from engine.errors import InvalidInput

DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
          "uint64", "float16", "float32", "float64", "complex64", "complex128")


def shape_of(value, what: str, allow_none: bool = False) -> Tuple:
    """A shape as a tuple of ints (and None where allowed); "none" reads as None
    (TOML has no null)."""
    if isinstance(value, (int, np.integer)) or value is None:
        value = (value,)
    dims = tuple(None if d is None or (isinstance(d, str) and d.lower() == "none") else int(d)
                 for d in value)
    for d in dims:
        if d is None and not allow_none:
            raise ValueError(f"{what} must have fixed dims, got {dims}")
        if d is not None and d < 1:
            raise ValueError(f"{what} dims must be >= 1, got {dims}")
    return dims


def dtype_name(value, what: str) -> str:
    name = np.dtype(value).name
    if name not in DTYPES:
        raise ValueError(f"{what} must be one of {', '.join(DTYPES)}, got {name}")
    return name


def shape_text(shape) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def describe(x: np.ndarray) -> str:
    return f"{x.dtype}{shape_text(x.shape)}"


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor: its name ("" for the single-array form), dtype, shape (a
    None dim is variable) and max_shape (the shape of its row in a slot)."""

    name: str
    dtype: str
    shape: Tuple
    max_shape: Tuple

    @property
    def var_axis(self) -> Optional[int]:
        return next((i for i, d in enumerate(self.shape) if d is None), None)

    @property
    def slot_bytes(self) -> int:
        return int(np.prod(self.max_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    def spec_text(self) -> str:
        dims = [f"1..{b}" if d is None else str(d) for d, b in zip(self.shape, self.max_shape)]
        return f"{self.dtype}[{', '.join(dims)}]"

    def check(self, x) -> Tuple[np.ndarray, int]:
        """(array, real length of the variable dim or 0); InvalidInput, naming
        the tensor, otherwise."""
        where = f"{self.name}: " if self.name else ""
        if not isinstance(x, np.ndarray):
            try:
                x = np.asarray(x, dtype=self.dtype)
            except (TypeError, ValueError) as e:
                raise InvalidInput(f"{where}expected {self.spec_text()}, got {type(x).__name__} "
                                   f"not convertible to {self.dtype} ({e})") from None
        length = 0
        ok = x.dtype == self.dtype and x.ndim == len(self.shape)
        for axis, want in enumerate(self.shape if ok else ()):
            got = x.shape[axis]
            if want is None:
                ok = ok and 1 <= got <= self.max_shape[axis]
                length = got
            else:
                ok = ok and got == want
        if not ok:
            raise InvalidInput(f"{where}expected {self.spec_text()}, got {describe(x)}")
        return x, length


def spec_of(name: str, value, bound, what: str) -> TensorSpec:
    """A TensorSpec from (dtype, shape) and, for a variable dim, its bound."""
    try:
        dtype, shape = value
    except (TypeError, ValueError):
        raise ValueError(f"{what} {name!r} must be (dtype, shape), got {value!r}") from None
    dtype = dtype_name(dtype, f"{what} {name!r} dtype")
    shape = shape_of(shape, f"{what} {name!r}", allow_none=(what == "input"))
    var = [i for i, d in enumerate(shape) if d is None]
    if len(var) > 1:
        raise ValueError(f"{what} {name!r} may have one variable (None) dim, got {shape}")
    if not var:
        if bound is not None:
            raise ValueError(f"max_input_shapes[{name!r}] is only for an input with a None dim")
        return TensorSpec(name, dtype, shape, shape)
    if bound is None:
        raise ValueError(f"{what} {name!r} has a None dim: max_input_shapes[{name!r}] "
                         "(the padding bound) is required")
    bound = shape_of(bound, f"max_input_shapes[{name!r}]")
    if len(bound) != len(shape) or not all(d is None or d == b for d, b in zip(shape, bound)):
        raise ValueError(f"max_input_shapes[{name!r}] {bound} must match {shape} in rank "
                         "and fixed dims")
    return TensorSpec(name, dtype, shape, bound)


def named_specs(inputs: dict, outputs: dict, max_input_shapes: Optional[dict]):
    """(input specs, output specs) of named tensors, validated."""
    bounds = dict(max_input_shapes or {})
    if not isinstance(inputs, dict) or not isinstance(outputs, dict) or not inputs or not outputs:
        raise ValueError("inputs and outputs must both be non-empty dicts {name: (dtype, shape)}")
    unknown = sorted(set(bounds) - set(inputs))
    if unknown:
        raise ValueError(f"max_input_shapes names {unknown}, which are not inputs")
    for name in list(inputs) + list(outputs):
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
    both = sorted(set(inputs) & set(outputs))
    if both:
        raise ValueError(f"{both} named both an input and an output")
    ins = tuple(spec_of(n, v, bounds.get(n), "input") for n, v in inputs.items())
    outs = tuple(spec_of(n, v, None, "output") for n, v in outputs.items())
    return ins, outs


def check_named(specs: Tuple[TensorSpec, ...], x) -> Tuple[tuple, tuple]:
    """(arrays, real lengths), both in spec order, of a dict of named inputs."""
    if not isinstance(x, dict):
        raise InvalidInput(f"expected a dict of inputs {{{', '.join(repr(s.name) for s in specs)}}}"
                           f", got {type(x).__name__}")
    names = [s.name for s in specs]
    missing = [n for n in names if n not in x]
    extra = [n for n in x if n not in names]
    if missing or extra:
        raise InvalidInput(f"expected inputs {names}, got {sorted(x, key=str)}"
                           + (f" (missing {missing})" if missing else "")
                           + (f" (unexpected {extra})" if extra else ""))
    checked = [spec.check(x[spec.name]) for spec in specs]
    return tuple(a for a, _ in checked), tuple(n for _, n in checked)


def check_named_out(specs: Tuple[TensorSpec, ...], out) -> tuple:
    """out's arrays in spec order if out is a dict of arrays that can take the
    answers; InvalidInput otherwise."""
    if not isinstance(out, dict) or sorted(out) != sorted(s.name for s in specs):
        got = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise InvalidInput(f"out: expected a dict of outputs {[s.name for s in specs]}, got {got}")
    for spec in specs:
        check_out(spec, out[spec.name], f"out[{spec.name!r}]")
    return tuple(out[spec.name] for spec in specs)


def check_out(spec: TensorSpec, a, where: str = "out") -> None:
    """InvalidInput unless array a can take an answer of spec in place."""
    if not (type(a) is np.ndarray and a.shape == spec.shape and a.dtype == spec.dtype
            and a.flags.c_contiguous and a.flags.writeable):
        got = (f"{describe(a)}{'' if a.flags.c_contiguous else ' not C-contiguous'}"
               f"{'' if a.flags.writeable else ' read-only'}"
               if isinstance(a, np.ndarray) else type(a).__name__)
        raise InvalidInput(f"{where}: expected a writable C-contiguous "
                           f"{spec.dtype}{shape_text(spec.shape)}, got {got}")


class BadResult(Exception):
    """A backend returned something that is not n outputs of the right spec."""


def checked_result(result, n: int, dtype: np.dtype, shape, name: str) -> np.ndarray:
    """result as n rows of (dtype, shape), or BadResult saying what came."""
    where = f"output {name!r}: " if name else ""
    if type(result) is np.ndarray and result.dtype == dtype and result.shape == (n, *shape):
        return result
    try:
        out = np.asarray(result)
    except Exception as e:
        raise BadResult(f"{where}backend result is not an array ({type(e).__name__}: {e})") from None
    want = (n, *shape)
    if out.shape != want:
        raise BadResult(f"{where}expected {dtype}{shape_text(want)} (one row per "
                        f"request), got {describe(out)}")
    if not np.can_cast(out.dtype, dtype, casting="same_kind"):
        raise BadResult(f"{where}expected {dtype}{shape_text(want)}, got {describe(out)}")
    return out
