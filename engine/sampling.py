"""A request's sampling parameters, checked, and their fixed-size record.

`Sampling` is what a client asks of an engine that samples (vLLM's
SamplingParams are the model): it is checked when made, so a bad value fails
the caller at once with InvalidInput saying what was expected and what came.
It travels to the batcher as one record of RECORD_DTYPE (RECORD_BYTES, the
same for every request, so it can sit in the segment beside the request's
input): a 48-byte head of the scalars, then MAX_STOP_TOKEN_IDS int32 stop ids.
The batcher reads it back with `Sampling.decode`, which checks it again: a
record is data another process wrote, and a scribbled one fails its request
alone.
"""
import dataclasses
import math
import numbers
import struct
from typing import Optional, Tuple

import numpy as np

from engine.errors import InvalidInput
from engine.tensors import TensorSpec

MAX_LOGPROBS = 20          # the most top logprobs any engine offers (its max_logprobs is 0..this)
MAX_STOP_TOKEN_IDS = 32    # the record's room for stop ids
MAX_TOKEN_ID = 2**31 - 1   # ids and counts travel as (u)int32
MAX_SEED = 2**64 - 1
GREEDY_BELOW = 1e-5        # vLLM's _SAMPLING_EPS: a lower temperature is the argmax
RECORD_VERSION = 1

_HAS_SEED, _IGNORE_EOS, _HAS_PROMPT_LOGPROBS = 1, 2, 4
_FLAGS = _HAS_SEED | _IGNORE_EOS | _HAS_PROMPT_LOGPROBS

RECORD_DTYPE = np.dtype([
    ("seed", "<u8"),
    ("temperature", "<f8"),  # float64: a record reads back as exactly the Sampling written
    ("top_p", "<f8"),
    ("min_p", "<f8"),
    ("top_k", "<u4"),
    ("min_tokens", "<u4"),
    ("version", "u1"),
    ("flags", "u1"),
    ("logprobs", "u1"),
    ("prompt_logprobs", "u1"),
    ("n_stop", "u1"),
    ("reserved", "V3"),
    ("stop_token_ids", "<i4", (MAX_STOP_TOKEN_IDS,)),
])
HEAD_BYTES = 48  # the scalars; the stop ids follow
RECORD_BYTES = RECORD_DTYPE.itemsize
_RECORD = struct.Struct(f"<QdddIIBBBBB3x{MAX_STOP_TOKEN_IDS}i")  # RECORD_DTYPE, field by field
assert RECORD_BYTES == _RECORD.size == HEAD_BYTES + 4 * MAX_STOP_TOKEN_IDS


def prompt_specs(length: int, k: int) -> tuple:
    """A prompt_logprobs engine's rows per slot after its outputs, for a
    prompt bound `length` and max_logprobs k: row j (j >= 1) the logprob of
    prompt token j then the top k logprobs at it (float32 [length, 1 + k]),
    and their ids (int32 [length, k]: ids are < 2**31), written by the batcher
    at join. (1 + 2k) * 4 B per prompt position."""
    values = TensorSpec("prompt_logprobs", "float32", (length, 1 + k), (length, 1 + k))
    ids = TensorSpec("prompt_top_ids", "int32", (length, k), (length, k))
    return (values, ids) if k else (values,)


def _is_int(v) -> bool:
    return type(v) is int or (  # the common case without the ABCs' checks
        isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)))


def _is_real(v) -> bool:
    return type(v) in (float, int) or (
        isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)))


def _shown(v) -> str:
    """v's repr, cut short: a message names what came without copying it whole."""
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _int_in(name: str, v, lo: int, hi: int, text: Optional[str] = None) -> int:
    if not _is_int(v) or not lo <= v <= hi:
        raise InvalidInput(f"{name}: expected {text or f'an int in {lo}..{hi}'}, got {_shown(v)}")
    return int(v)


@dataclasses.dataclass(frozen=True, slots=True)
class Sampling:
    """How a request's tokens are picked from the model's logits.

    temperature: 0 (below 1e-5, as vLLM) is greedy, else logits / temperature.
    top_p, top_k, min_p: truncate the distribution (off at 1, 0 (or -1), 0).
    seed: the request's own random stream, whatever else is in the batch.
    min_tokens: eos and stop_token_ids cannot be sampled before this many tokens.
    ignore_eos: eos is never sampled (so never ends the request).
    stop_token_ids: tokens that end the request (at most MAX_STOP_TOKEN_IDS).
    logprobs: each token comes with its logprob and the top `logprobs` ones.
    prompt_logprobs: None, or the prompt's logprobs with the top k at each.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Tuple[int, ...] = ()
    logprobs: int = 0
    prompt_logprobs: Optional[int] = None
    _record: bytes = dataclasses.field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        t, p, m = self.temperature, self.top_p, self.min_p
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise InvalidInput(f"temperature: expected a finite number >= 0, got {_shown(t)}")
        if not _is_real(p) or not 0 < p <= 1:
            raise InvalidInput(f"top_p: expected a number in (0, 1], got {_shown(p)}")
        if not _is_real(m) or not 0 <= m <= 1:
            raise InvalidInput(f"min_p: expected a number in [0, 1], got {_shown(m)}")
        top_k = _int_in("top_k", self.top_k, -1, MAX_TOKEN_ID,
                        f"-1 or 0 (off), or an int in 1..{MAX_TOKEN_ID}")
        seed = None if self.seed is None else _int_in(
            "seed", self.seed, 0, MAX_SEED, "None or an int in 0..2**64-1")
        min_tokens = _int_in("min_tokens", self.min_tokens, 0, MAX_TOKEN_ID)
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise InvalidInput(f"ignore_eos: expected a bool, got {_shown(self.ignore_eos)}")
        logprobs = _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        prompt = None if self.prompt_logprobs is None else _int_in(
            "prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS,
            f"None or an int in 0..{MAX_LOGPROBS}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not hasattr(stops, "__len__"):
            raise InvalidInput(f"stop_token_ids: expected a sequence of token ids, got {_shown(stops)}")
        if len(stops) > MAX_STOP_TOKEN_IDS:
            raise InvalidInput(f"stop_token_ids: expected at most {MAX_STOP_TOKEN_IDS} ids, got "
                               f"{len(stops)}")
        stops = tuple(_int_in(f"stop_token_ids[{i}]", s, 0, MAX_TOKEN_ID,
                              f"a token id in 0..{MAX_TOKEN_ID}") for i, s in enumerate(stops))
        # canonical values: a record decodes to an equal Sampling
        canon = {"temperature": float(t), "top_p": float(p), "min_p": float(m),
                 "top_k": max(top_k, 0), "seed": seed, "min_tokens": min_tokens,
                 "ignore_eos": bool(self.ignore_eos), "stop_token_ids": stops,
                 "logprobs": logprobs, "prompt_logprobs": prompt}
        for name, value in canon.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_record", self._pack())

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def check(self, max_logprobs: int, max_steps: Optional[int] = None) -> "Sampling":
        """self, if the engine can honour it: logprobs and prompt_logprobs at
        most its max_logprobs, min_tokens at most the request's max_steps."""
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k > max_logprobs:
                raise InvalidInput(f"{name}: expected at most {max_logprobs} (the engine's "
                                   f"max_logprobs), got {k}")
        if max_steps is not None and self.min_tokens > max_steps:
            raise InvalidInput(f"min_tokens: expected at most {max_steps} (the request's "
                               f"max_steps), got {self.min_tokens}")
        return self

    # -- the record -----------------------------------------------------------------------
    def encode(self) -> bytes:
        """The record, RECORD_BYTES long (made once, when self was)."""
        return self._record

    def _pack(self) -> bytes:
        stops = self.stop_token_ids
        flags = ((_HAS_SEED if self.seed is not None else 0)
                 | (_IGNORE_EOS if self.ignore_eos else 0)
                 | (_HAS_PROMPT_LOGPROBS if self.prompt_logprobs is not None else 0))
        return _RECORD.pack(self.seed or 0, self.temperature, self.top_p, self.min_p, self.top_k,
                            self.min_tokens, RECORD_VERSION, flags, self.logprobs,
                            self.prompt_logprobs or 0, len(stops),
                            *stops, *(0,) * (MAX_STOP_TOKEN_IDS - len(stops)))

    @classmethod
    def decode(cls, record) -> "Sampling":
        """The Sampling a record holds (bytes, or an element of an array of
        RECORD_DTYPE), checked as when made; InvalidInput saying what is wrong
        otherwise. Its values are data: nothing in it is trusted."""
        if isinstance(record, (bytes, bytearray, memoryview)):
            raw = bytes(record)
        elif getattr(record, "dtype", None) == RECORD_DTYPE and getattr(record, "size", 0) == 1:
            raw = record.tobytes()
        else:
            raise InvalidInput(f"sampling record: expected bytes or an element of RECORD_DTYPE, got "
                               f"{type(record).__name__}")
        if len(raw) != RECORD_BYTES:
            raise InvalidInput(f"sampling record: expected {RECORD_BYTES} bytes, got {len(raw)}")
        (seed, temperature, top_p, min_p, top_k, min_tokens, version, flags, logprobs, prompt,
         n_stop, *stops) = _RECORD.unpack(raw)
        if version != RECORD_VERSION:
            raise InvalidInput(f"sampling record: expected version {RECORD_VERSION}, got {version}")
        if flags & ~_FLAGS:
            raise InvalidInput(f"sampling record: expected flags within {_FLAGS:#x}, got {flags:#x}")
        if n_stop > MAX_STOP_TOKEN_IDS:
            raise InvalidInput(f"sampling record: expected at most {MAX_STOP_TOKEN_IDS} stop ids, "
                               f"got {n_stop}")
        try:
            return cls(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                       seed=seed if flags & _HAS_SEED else None, min_tokens=min_tokens,
                       ignore_eos=bool(flags & _IGNORE_EOS), stop_token_ids=tuple(stops[:n_stop]),
                       logprobs=logprobs,
                       prompt_logprobs=prompt if flags & _HAS_PROMPT_LOGPROBS else None)
        except InvalidInput as e:
            raise InvalidInput(f"sampling record: {e}") from None
