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
from typing import Any, Optional, Tuple

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
    if sampling.prompt_logprobs is not None and not cfg.prompt_logprobs:
        raise InvalidInput(f"prompt_logprobs: engine {cfg.name!r} has prompt_logprobs=False "
                           f"(no room for them in its slots); expected None, got "
                           f"{sampling.prompt_logprobs}")
    sampling.check(cfg.max_logprobs, max_steps or cfg.max_steps)
    return np.frombuffer(sampling.encode(), np.uint8), sampling.logprobs


def records(seg, sampling, n: int, max_steps: Optional[int]):
    """(records as uint8[n, RECORD_BYTES] or None, each row's k) for a bulk
    call of n rows: sampling is one Sampling (or None) for every row, or a
    sequence of n of them, each checked as record() checks one."""
    if sampling is None or isinstance(sampling, Sampling):
        refuse_prompt("infer_many()", sampling)
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
            refuse_prompt("infer_many()", s)
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


def asks_prompt(sampling) -> bool:
    """Whether sampling= asks the prompt's logprobs."""
    return isinstance(sampling, Sampling) and sampling.prompt_logprobs is not None


def refuse_prompt(call: str, sampling) -> None:
    """InvalidInput for a call that cannot return the prompt's logprobs asked."""
    if asks_prompt(sampling):
        raise InvalidInput(f"prompt_logprobs: {call} does not return them; expected None, got "
                           f"{sampling.prompt_logprobs} (infer(), infer_async() and the streams "
                           f"do)")


def scored(client, x, timeout, priority: int, max_steps, sampling: Optional[Sampling]) -> Any:
    """infer() of a request that asked its prompt's logprobs: its stream read
    to the end (the prompt's logprobs come before its first chunk)."""
    with client.stream(x, timeout, priority=priority, max_steps=max_steps,
                       sampling=sampling) as chunks:
        got = list(chunks)
    return stacked(got, sampling.logprobs if sampling else 0, chunks.prompt_logprobs)


async def scored_async(client, x, timeout, priority: int, max_steps,
                       sampling: Optional[Sampling]) -> Any:
    """infer_async() of a request that asked its prompt's logprobs (scored's)."""
    chunks = client.open_stream_async(x, timeout, priority=priority, max_steps=max_steps,
                                      sampling=sampling)
    try:
        got = [chunk async for chunk in chunks]
    finally:
        await chunks.aclose()
    return stacked(got, sampling.logprobs if sampling else 0, chunks.prompt_logprobs)


def prompt_ask(seg, sampling: Optional[Sampling], x) -> Optional[Tuple[int, int]]:
    """(k, the prompt's length) of a request that asked its prompt's
    logprobs (x: its input, already checked: one array of token ids); else None."""
    if sampling is None or sampling.prompt_logprobs is None or not seg.config.prompt_logprobs:
        return None
    return sampling.prompt_logprobs, int(np.shape(x)[0])


def prompt_entries(seg, slot: int, ask: Tuple[int, int]) -> list:
    """The prompt's logprobs as the batcher wrote them into the slot at join:
    None for the first token, then (logprob, top_ids int64[k], top_logprobs
    float32[k]) per token. Only the request's own length and k are read:
    what the slot holds is data, never a bound."""
    k, length = ask
    values, ids = seg.prompt_regions
    length = min(length, values.shape[1])
    v = values[slot, :length].copy()
    top_ids = (ids[slot, :length, :k].astype(np.int64) if ids is not None
               else np.zeros((length, 0), np.int64))
    return [None] + [(float(v[j, 0]), top_ids[j], v[j, 1:1 + k]) for j in range(1, length)]


def stacked(chunks: list, k: int, prompt_logprobs: Optional[list]) -> dict:
    """A scored request's answer, as infer() returns it: its chunks stacked
    per key (the token alone as "token") and its prompt's logprobs."""
    answer: dict
    if k == 0:
        answer = {"token": np.array(chunks, np.int64)}
    else:
        answer = {key: np.stack([c[key] for c in chunks]) for key in chunks[0]} if chunks else {}
    answer["prompt_logprobs"] = prompt_logprobs
    return answer
