"""The engine's sampler: each running request's next token, from the model's logits.

An iterative batcher that samples holds a `Rows` beside its running batch,
row i for the i-th active request (add() as requests join, keep() with the
Group's mask as they leave), and calls `Rows.sample(logits)` once a step:
logits [n, V], numpy float16/32/64 or a torch tensor on any device. A tensor
on an accelerator is sampled there by sampler_torch (only [n]-sized arrays
cross to or from the host); one in host memory is read by the numpy path
(sampler_numpy) through a view, no copy (numpy's kernels are the faster on a
CPU). This module never imports torch; sampler_torch does, and is imported
only for torch logits. Per row, in vLLM's order:

1. min_tokens masks eos and the row's stop ids until that many tokens were
   sampled; ignore_eos masks eos always (as llama.cpp; vLLM samples it and
   goes on). Masked ids are set to -inf.
2. temperature below 1e-5 (as vLLM) takes the argmax; otherwise p = exp((x -
   max) / T), so the largest p is 1.
3. min_p keeps p >= min_p; top_k keeps p >= the k-th largest p; top_p keeps
   the fewest largest p, among those kept so far, holding top_p of their mass.
   Each is a threshold on p, so ties at the cut are all kept and a row's result
   depends on its own values only. top_k and top_p read a sorted set of
   candidates: on numpy, the ids that can be kept, found by a threshold on
   the row (sampler_numpy); on torch, the max(top_k, 1024) largest p
   (torch.topk), and a row whose nucleus is not within them reads 4 times as
   many, and so on.
4. The token is drawn by inverse CDF with ONE uniform per sampled row: the
   first id whose float64 cumulative sum of kept p exceeds u * total. A
   seeded row draws u from its own numpy Generator(PCG64(seed)), kept across
   steps, the others from one generator of the Rows: so a seeded row's tokens
   do not depend on what else is in the batch. The torch path draws u the same
   way (n floats cross to the device), so a seed picks the same draws on
   either path, and no per-row torch.Generator costs a launch per row per step.

Logprobs are computed only for rows that asked (logprobs > 0): the chosen
token's and the top `logprobs` ids'. logprobs_mode "raw" (vLLM V1's default,
"raw_logprobs") reports log_softmax(logits), before temperature, masks and
truncation; "scaled" reports log_softmax(logits / T), after temperature but
before masks and truncation. Greedy rows report raw logprobs in either mode.
Tokens are always ids in [0, V), whatever the logits hold (values from a
model are data); a row whose every id is masked, or whose logits are NaN,
gets one of them, which one unspecified.
"""
import math
import sys
from typing import NamedTuple, Optional, Sequence

import numpy as np

from engine.batching import sampler_numpy
from engine.sampling import GREEDY_BELOW, MAX_STOP_TOKEN_IDS, Sampling
from engine.tensors import BadResult

CANDIDATES = 1024  # the torch path's first top_p candidates: a nucleus is mostly far smaller
WIDEN = 4  # a nucleus past the candidates: 4 times as many, and so on up to the whole row
LOGPROBS_MODES = ("raw", "scaled")
TORCH_CPU_AS_NUMPY = True  # torch logits in host memory take the numpy path (device_logits)
QUIET = {"divide": "ignore", "invalid": "ignore", "over": "ignore"}  # a model's inf and nan are data


class Sampled(NamedTuple):
    """One step's picks for n rows."""

    tokens: np.ndarray                  # int64[n], each in [0, V)
    logprobs: np.ndarray                # float32[n]; nan where the row asked none
    top_ids: Optional[np.ndarray]       # int64[n, k]: k the most any row asked; None if none did;
    top_logprobs: Optional[np.ndarray]  # float32[n, k]; past a row's own count: -1 and nan


class Plan(NamedTuple):
    """One step's per-row work, worked out on the host from the Rows alone."""

    greedy: np.ndarray       # intp: rows that take the argmax
    sampled: np.ndarray      # intp: rows that draw
    temperature: np.ndarray  # float32[n]; 1 for greedy rows
    top_k: np.ndarray        # int64[n]; 0 off (and at or past V)
    top_p: np.ndarray        # float64[n]
    min_p: np.ndarray        # float32[n]
    uniforms: np.ndarray     # float64[n]: each sampled row's draw in [0, 1)
    mask_rows: np.ndarray    # int64: the (row, id) pairs set to -inf
    mask_ids: np.ndarray
    asked: np.ndarray        # intp: rows that want logprobs
    logprobs: np.ndarray     # int64[len(asked)]: how many top ids each wants
    scale: np.ndarray        # float32[len(asked)]: what their logits are divided by for logprobs


class Rows:
    """The sampling state of a running batch, in the batch's order."""

    def __init__(self, size: int, eos_token_ids: Sequence[int] = (),
                 logprobs_mode: str = "raw", seed: Optional[int] = None):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got "
                             f"{logprobs_mode!r}")
        eos = np.asarray(eos_token_ids, np.int64).reshape(-1)
        if (eos < 0).any():
            raise ValueError(f"eos_token_ids must be ids >= 0, got {list(eos_token_ids)}")
        self.eos, self.mode, self.n = eos, logprobs_mode, 0
        self.shared = np.random.default_rng(seed)  # the unseeded rows' stream
        self.temperature = np.zeros(size, np.float32)
        self.top_p = np.ones(size, np.float64)
        self.min_p = np.zeros(size, np.float32)
        self.top_k = np.zeros(size, np.int64)
        self.min_tokens = np.zeros(size, np.int64)
        self.ignore_eos = np.zeros(size, bool)
        self.logprobs = np.zeros(size, np.int64)
        self.seeded = np.zeros(size, bool)
        self.stop_ids = np.full((size, MAX_STOP_TOKEN_IDS), -1, np.int64)  # -1: none
        self.steps = np.zeros(size, np.int64)  # tokens sampled so far
        self.fields = (self.temperature, self.top_p, self.min_p, self.top_k, self.min_tokens,
                       self.ignore_eos, self.logprobs, self.seeded, self.stop_ids, self.steps)
        self.generators: list = []  # a seeded row's Generator, else None

    def add(self, params: Sequence[Sampling]) -> None:
        """Rows for requests that join, after the running ones."""
        n, k = self.n, len(params)
        if n + k > len(self.steps):
            raise ValueError(f"Rows of {len(self.steps)} cannot take {k} more after {n}")
        for i, s in enumerate(params, n):
            self.temperature[i], self.top_p[i], self.min_p[i] = s.temperature, s.top_p, s.min_p
            self.top_k[i], self.min_tokens[i], self.ignore_eos[i] = s.top_k, s.min_tokens, \
                s.ignore_eos
            self.logprobs[i], self.seeded[i] = s.logprobs, s.seed is not None
            self.stop_ids[i] = -1
            self.stop_ids[i, :len(s.stop_token_ids)] = s.stop_token_ids
            self.steps[i] = 0
            self.generators.append(None if s.seed is None
                                   else np.random.Generator(np.random.PCG64(s.seed)))
        self.n = n + k

    def keep(self, mask: np.ndarray) -> None:
        """Keeps the rows where mask (over the first n) is True, in order."""
        k = int(mask.sum())
        for field in self.fields:
            field[:k] = field[:self.n][mask]
        self.generators = [g for g, kept in zip(self.generators, mask.tolist()) if kept]
        self.n = k

    # -- a step -------------------------------------------------------------------------
    def sample(self, logits) -> Sampled:
        """Each row's next token (and logprobs where asked); counts the step."""
        device = device_logits(logits, self.n)
        if device is not None:
            from engine.batching import sampler_torch
            plan = self.plan(device.shape[1])
            out = Sampled(*sampler_torch.sample(device, plan, CANDIDATES, widths))
        else:
            logits = numpy_logits(logits, self.n)
            plan = self.plan(logits.shape[1])
            with np.errstate(**QUIET):
                out = with_logprobs(logits, sampler_numpy.sample(logits, plan), plan)
        self.steps[:self.n] += 1
        return out

    def stops(self, tokens: np.ndarray) -> np.ndarray:
        """bool[n]: the rows whose token ends them (eos, unless ignore_eos, or
        one of their stop ids)."""
        n = self.n
        tokens = np.asarray(tokens, np.int64)
        eos = np.isin(tokens, self.eos) & ~self.ignore_eos[:n]
        return eos | (self.stop_ids[:n] == tokens[:, None]).any(axis=1)

    def plan(self, vocab: int) -> Plan:
        n = self.n
        temperature = self.temperature[:n]
        greedy = temperature < GREEDY_BELOW
        early = self.steps[:n] < self.min_tokens[:n]
        # (row, id) pairs to mask; ids past this vocabulary mask nothing
        eos = self.eos[self.eos < vocab]
        eos_rows = np.flatnonzero(early | self.ignore_eos[:n])
        stop = self.stop_ids[:n]
        stop_rows, stop_cols = np.nonzero(early[:, None] & (stop >= 0) & (stop < vocab))
        mask_rows = np.concatenate([np.repeat(eos_rows, len(eos)), stop_rows]).astype(np.int64)
        mask_ids = np.concatenate([np.tile(eos, len(eos_rows)), stop[stop_rows, stop_cols]])
        # one uniform per sampled row: a seeded row from its own stream
        uniforms = np.zeros(n, np.float64)
        draws = ~greedy
        seeded = draws & self.seeded[:n]
        for i in np.flatnonzero(seeded).tolist():
            uniforms[i] = self.generators[i].random()
        shared = np.flatnonzero(draws & ~seeded)
        if len(shared):
            uniforms[shared] = self.shared.random(len(shared))
        top_k = self.top_k[:n].copy()
        top_k[top_k >= vocab] = 0
        asked = np.flatnonzero(self.logprobs[:n] > 0)
        scale = (np.where(greedy[asked], 1.0, temperature[asked]) if self.mode == "scaled"
                 else np.ones(len(asked))).astype(np.float32)
        return Plan(np.flatnonzero(greedy), np.flatnonzero(draws),
                    np.where(greedy, 1.0, temperature).astype(np.float32), top_k,
                    self.top_p[:n].copy(), self.min_p[:n].copy(), uniforms, mask_rows, mask_ids,
                    asked, self.logprobs[:n][asked], scale)


def is_torch(x) -> bool:
    """Whether x is a torch tensor (torch is loaded if one exists)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def device_logits(logits, n: int):
    """Torch logits [n, V] that the torch path samples where they are; None
    for the numpy path: numpy logits, and torch logits in host memory, which
    numpy reads through a view (no copy), and samples faster than torch's CPU
    kernels do (bench/sampler_cost.py)."""
    if not is_torch(logits):
        return None
    from engine.batching import sampler_torch
    sampler_torch.shape_of(logits, n)
    return logits if logits.device.type != "cpu" or not TORCH_CPU_AS_NUMPY else None


def numpy_logits(logits, n: int) -> np.ndarray:
    """logits as float32 [n, V] (a torch CPU tensor's through a view);
    BadResult saying what came otherwise."""
    if is_torch(logits):
        logits = logits.detach()
        numpy_has = str(logits.dtype) in ("torch.float16", "torch.float32", "torch.float64")
        logits = (logits if numpy_has else logits.float()).numpy()  # bfloat16: numpy has none
    x = logits if isinstance(logits, np.ndarray) else None
    if x is None or x.dtype.kind != "f" or x.ndim != 2 or x.shape[0] != n or x.shape[1] < 1:
        got = (f"{x.dtype}{list(x.shape)}" if x is not None else type(logits).__name__)
        raise BadResult(f"logits: expected float[{n}, V], got {got}")
    return x if x.dtype == np.float32 else x.astype(np.float32)


def widths(wide: int, vocab: int):
    """The candidates the torch path reads after wide, WIDEN times as many
    each time, up to vocab."""
    while wide < vocab:
        wide = min(wide * WIDEN, vocab)
        yield wide


def with_logprobs(logits: np.ndarray, tokens: np.ndarray, plan: Plan) -> Sampled:
    n = len(tokens)
    logprobs = np.full(n, np.nan, np.float32)
    a = plan.asked
    if not len(a):
        return Sampled(tokens, logprobs, None, None)
    rows = slice(None) if len(a) == n else a
    scale = None if (plan.scale == 1).all() else plan.scale
    chosen, ids, top = sampler_numpy.score(logits[rows], tokens[rows], int(plan.logprobs.max()), scale)
    logprobs[a] = chosen
    k = ids.shape[1]
    top_ids, top_logprobs = np.full((n, k), -1, np.int64), np.full((n, k), np.nan, np.float32)
    past = np.arange(k)[None, :] >= plan.logprobs[:, None]
    ids[past], top[past] = -1, np.nan
    top_ids[a], top_logprobs[a] = ids, top
    return Sampled(tokens, logprobs, top_ids, top_logprobs)


def score(logits, ids, k: int, temperature: float = 1.0):
    """The logprobs of given ids and the top k at each row of logits [m, V]
    (numpy or torch, as Rows.sample takes them), of log_softmax(logits /
    temperature): a prompt's logprobs, row j predicting ids[j]. numpy
    (float32[m], int64[m, k], float32[m, k])."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    ids = np.asarray(ids, np.int64).reshape(-1)
    device = device_logits(logits, len(ids))
    if device is None:
        logits = numpy_logits(logits, len(ids))
    vocab = logits.shape[1]
    if len(ids) and ((ids < 0) | (ids >= vocab)).any():
        raise ValueError(f"ids must be in 0..{vocab - 1}, got {ids.min()}..{ids.max()}")
    if device is not None:
        from engine.batching import sampler_torch
        return sampler_torch.score(device, ids, k, temperature)
    with np.errstate(**QUIET):
        return sampler_numpy.score(logits, ids, k,
                                   None if temperature == 1.0 else [temperature])
