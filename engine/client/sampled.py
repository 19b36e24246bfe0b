"""A sampling engine's side of a request: its Sampling record, and its chunks' shape.

A request to an engine with sampling=True carries an engine.Sampling (the
default one, temperature 1, when the caller gives none): checked here
against the engine (its max_logprobs, the request's max_steps), its record
then written into the slot's hidden input beside the request's tensors, which
the batcher decodes and checks again at join. The engine writes every chunk
with the engine's max_logprobs top ids; the caller gets its own share of it
(cut): the token alone when the request asked no logprobs, else a dict of the
token, its logprob and the request's own k top ids and logprobs.
"""
from typing import Any, Optional

import numpy as np

from engine.errors import InvalidInput
from engine.sampling import RECORD_BYTES, Sampling

DEFAULT = Sampling()


def record(seg, sampling: Optional[Sampling], max_steps: Optional[int]):
    """(record as uint8[RECORD_BYTES] or None, k): what the request writes
    into its slot, and its chunks' logprobs count (None: not a sampling
    engine). InvalidInput for sampling= to an engine without sampling, or
    one the engine cannot honour."""
    cfg = seg.config
    if not cfg.sampling:
        if sampling is not None:
            raise InvalidInput(f"sampling: engine {cfg.name!r} does not sample (its model "
                               f"returns its outputs, not logits); expected sampling=None, got "
                               f"{type(sampling).__name__}")
        return None, None
    if sampling is None:
        sampling = DEFAULT
    elif not isinstance(sampling, Sampling):
        raise InvalidInput(f"sampling: expected an engine.Sampling or None, got "
                           f"{type(sampling).__name__}")
    if sampling.prompt_logprobs is not None:
        raise InvalidInput(f"prompt_logprobs: not served yet by this engine; expected None, got "
                           f"{sampling.prompt_logprobs}")
    sampling.check(cfg.max_logprobs, max_steps or cfg.max_steps)
    return np.frombuffer(sampling.encode(), np.uint8), sampling.logprobs


def records(seg, sampling, n: int, max_steps: Optional[int]):
    """(records as uint8[n, RECORD_BYTES] or None, each row's k) for a bulk
    call of n rows: sampling is one Sampling (or None) for every row, or a
    sequence of n of them, each checked as record() checks one."""
    if sampling is None or isinstance(sampling, Sampling):
        record_, k = record(seg, sampling, max_steps)
        rows = None if record_ is None else np.broadcast_to(record_, (n, len(record_)))
        return rows, [k] * n
    if isinstance(sampling, (str, bytes, dict)) or not hasattr(sampling, "__len__"):
        raise InvalidInput(f"sampling: expected an engine.Sampling, None, or a sequence of {n} "
                           f"(one per row), got {type(sampling).__name__}")
    if len(sampling) != n:
        raise InvalidInput(f"sampling: expected one per row ({n}), got {len(sampling)}")
    if not seg.config.sampling:
        record(seg, sampling, max_steps)  # the refusal of sampling= on an engine without it
    rows = np.empty((n, RECORD_BYTES), np.uint8)
    ks = []
    for i, s in enumerate(sampling):
        try:
            rows[i], k = record(seg, s, max_steps)
        except InvalidInput as e:
            raise InvalidInput(f"sampling[{i}]: {e}") from None
        ks.append(k)
    return rows, ks


def k_of(seg, sampling: Optional[Sampling]) -> Optional[int]:
    """The logprobs count a request's chunks are cut to; None when its engine
    does not sample (its chunks are the model's)."""
    if not seg.config.sampling:
        return None
    return 0 if sampling is None else sampling.logprobs


def cut(answer: Any, k: Optional[int]) -> Any:
    """A chunk (or chunks stacked) of a sampling engine as its request asked
    it: the token with k = 0, else a dict with k top ids and logprobs; answer
    itself when k is None (not a sampling engine)."""
    if k is None:
        return answer
    if k == 0:
        return answer["token"]
    return {"token": answer["token"], "logprob": answer["logprob"],
            "top_ids": answer["top_ids"][..., :k], "top_logprobs": answer["top_logprobs"][..., :k]}
