"""The engine's sampler: each running request's next token, from the model's logits.

An iterative batcher that samples holds a `Rows` beside its running batch,
row i for the i-th active request (add() as requests join, keep() with the
Group's mask as they leave), and calls `Rows.sample(logits)` once a step:
logits [n, V], numpy float16/32/64 or a torch tensor on any device. A tensor
on an accelerator is sampled there by sampler_torch (only [n]-sized arrays
cross to or from the host); one in host memory is read by the numpy path
through a view, no copy (numpy's kernels are the faster on a CPU). This
module never imports torch; sampler_torch does, and is imported only for
torch logits. Per row, in vLLM's order:

1. min_tokens masks eos and the row's stop ids until that many tokens were
   sampled; ignore_eos masks eos always (as llama.cpp; vLLM samples it and
   goes on). Masked ids are set to -inf.
2. temperature below 1e-5 (as vLLM) takes the argmax; otherwise p = exp((x -
   max) / T), so the largest p is 1.
3. min_p keeps p >= min_p; top_k keeps p >= the k-th largest p; top_p keeps
   the fewest largest p, among those kept so far, holding top_p of their mass.
   Each is a threshold on p, so ties at the cut are all kept and a row's result
   depends on its own values only. top_k and top_p read a sorted set of
   candidates: the max(top_k, 1024) largest p (np.partition / torch.topk); a
   row whose nucleus is not within them reads 4 times as many, and so on.
4. The token is drawn by inverse CDF with ONE uniform per sampled row: the
   first id whose float64 cumulative sum of kept p exceeds u * total (on
   numpy in two levels, blocks of 256 ids then ids, see inverse_cdf). A
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

from engine.sampling import GREEDY_BELOW, MAX_STOP_TOKEN_IDS, Sampling
from engine.tensors import BadResult

CANDIDATES = 1024  # top_p's first candidates: a nucleus is mostly far smaller than V
WIDEN = 4  # a nucleus past the candidates: 4 times as many, and so on up to the whole row
BLOCK = 256  # ids per block of the inverse CDF's first level
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
            with np.errstate(**QUIET):
                out = sample_numpy(logits, self.plan(logits.shape[1]))
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


# -- numpy -------------------------------------------------------------------------------
def sample_numpy(logits: np.ndarray, plan: Plan) -> Sampled:
    n, vocab = logits.shape
    x = logits
    if len(plan.mask_rows):
        x = logits.copy()
        x[plan.mask_rows, plan.mask_ids] = -np.inf
    tokens = np.zeros(n, np.int64)
    g, s = plan.greedy, plan.sampled
    if len(g):
        tokens[g] = (x if len(g) == n else x[g]).argmax(axis=1)
    if len(s):
        rows = slice(None) if len(s) == n else s
        tokens[s] = draw_numpy(x[rows], plan.temperature[rows], plan.top_k[rows],
                               plan.top_p[rows], plan.min_p[rows], plan.uniforms[rows])
    return with_logprobs(logits, tokens, plan)


def draw_numpy(x, temperature, top_k, top_p, min_p, uniforms) -> np.ndarray:
    """One token per row of x (float32 [m, V], masked ids -inf), by inverse CDF."""
    p = x / temperature[:, None]
    top = p.max(axis=1, keepdims=True)
    top[~np.isfinite(top)] = 0  # a row all -inf (every id masked), or broken logits
    p -= top
    np.exp(p, out=p)
    cut = min_p.copy()  # relative to the largest p, which is 1
    trunc = np.flatnonzero((top_k > 0) | (top_p < 1))
    if len(trunc):
        rows = slice(None) if len(trunc) == len(p) else trunc  # a slice copies nothing
        cut[rows] = truncation_cut(p[rows], cut[rows], top_k[rows], top_p[rows])
    np.multiply(p, p >= cut[:, None], out=p)
    return inverse_cdf(p, uniforms)


def inverse_cdf(p, uniforms) -> np.ndarray:
    """Per row, the first id whose cumulative p exceeds u * total, in two
    levels (a cumsum over V is the dearest pass on numpy; sums of blocks are
    not): the block, by the cumsum of BLOCK-wide sums, then the id within it."""
    m, vocab = p.shape
    full = vocab // BLOCK
    sums = np.empty((m, -(-vocab // BLOCK)), np.float64)
    sums[:, :full] = p[:, :full * BLOCK].reshape(m, full, BLOCK).sum(axis=2, dtype=np.float64)
    if full < sums.shape[1]:
        sums[:, full] = p[:, full * BLOCK:].sum(axis=1, dtype=np.float64)
    cdf = np.cumsum(sums, axis=1)
    total = cdf[:, -1]
    # u * total may round up to total: kept below it, the pick is a kept id
    target = np.minimum(uniforms * total, np.nextafter(total, 0))
    block = (cdf > target[:, None]).argmax(axis=1)
    before = np.where(block > 0, cdf[np.arange(m), block - 1], 0.0)
    width = min(BLOCK, vocab)
    ids = block[:, None] * BLOCK + np.arange(width)
    values = np.take_along_axis(p, np.minimum(ids, vocab - 1), axis=1)
    values[ids >= vocab] = 0
    hit = np.cumsum(values, axis=1, dtype=np.float64) + before[:, None] > target[:, None]
    # the block's sums, added in another order, may fall short: its last kept id
    last = width - 1 - (values[:, ::-1] > 0).argmax(axis=1)
    within = np.where(hit.any(axis=1), hit.argmax(axis=1), last)
    return np.minimum(block * BLOCK + within, vocab - 1)  # a row with nothing kept: any id


def truncation_cut(p, cut, top_k, top_p) -> np.ndarray:
    """Each row's threshold on p after min_p (cut), top_k and top_p."""
    vocab = p.shape[1]
    wide = int(top_k.max()) if (top_k > 0).any() else 0
    if (top_p < 1).any():
        wide = max(wide, CANDIDATES)
    cand = largest(p, min(wide, vocab))
    k = np.flatnonzero(top_k > 0)
    cut = cut.copy()
    cut[k] = np.maximum(cut[k], cand[k, top_k[k] - 1])
    nucleus = np.flatnonzero(top_p < 1)
    if len(nucleus):
        rows = slice(None) if len(nucleus) == len(p) else nucleus
        pn, cn, cand_n = p[rows], cut[rows], cand[rows]
        # the mass kept so far: the candidates' where they hold all that is kept
        within = (cand_n[:, -1] < cn) | (cand.shape[1] == vocab)
        mass = np.where(cand_n >= cn[:, None], cand_n, 0).sum(axis=1, dtype=np.float64)
        far = np.flatnonzero(~within)
        if len(far):
            pf = pn if len(far) == len(pn) else pn[far]
            mass[far] = np.where(pf >= cn[far, None], pf, 0).sum(axis=1)
        need = top_p[rows] * mass
        at, covered = nucleus_cut(cand_n, cn, need)
        for wide in widths(cand.shape[1], vocab):  # a nucleus past the candidates
            short = np.flatnonzero(~covered)
            if not len(short):
                break
            at[short], covered[short] = nucleus_cut(largest(pn[short], wide), cn[short],
                                                    need[short])
        cut[rows] = np.maximum(cn, at)
    return cut


def widths(wide: int, vocab: int):
    """The candidates read after wide, WIDEN times as many each time, up to vocab."""
    while wide < vocab:
        wide = min(wide * WIDEN, vocab)
        yield wide


def largest(p, wide: int) -> np.ndarray:
    """The wide largest values of each row, sorted descending."""
    vocab = p.shape[1]
    top = p if wide == vocab else np.partition(p, vocab - wide, axis=1)[:, vocab - wide:]
    return np.sort(top, axis=1)[:, ::-1]


def nucleus_cut(cand, cut, need):
    """(the smallest candidate p at which the kept mass reaches need, whether
    the candidates reach it) per row; cand sorted descending."""
    live = np.where(cand >= cut[:, None], cand, 0)
    mass = np.cumsum(live, axis=1, dtype=np.float64)
    reached = mass >= need[:, None]
    covered = reached[:, -1]
    at = np.take_along_axis(cand, reached.argmax(axis=1)[:, None], axis=1)[:, 0]
    return np.where(covered, at, 0).astype(cand.dtype), covered


def with_logprobs(logits: np.ndarray, tokens: np.ndarray, plan: Plan) -> Sampled:
    n = len(tokens)
    logprobs = np.full(n, np.nan, np.float32)
    a = plan.asked
    if not len(a):
        return Sampled(tokens, logprobs, None, None)
    rows = slice(None) if len(a) == n else a
    scale = None if (plan.scale == 1).all() else plan.scale
    chosen, ids, top = score_numpy(logits[rows], tokens[rows], int(plan.logprobs.max()), scale)
    logprobs[a] = chosen
    k = ids.shape[1]
    top_ids, top_logprobs = np.full((n, k), -1, np.int64), np.full((n, k), np.nan, np.float32)
    past = np.arange(k)[None, :] >= plan.logprobs[:, None]
    ids[past], top[past] = -1, np.nan
    top_ids[a], top_logprobs[a] = ids, top
    return Sampled(tokens, logprobs, top_ids, top_logprobs)


def score_numpy(logits: np.ndarray, ids: np.ndarray, k: int, scale=None):
    """(logprob of ids[i] in row i, the top k ids of each row, their logprobs),
    of log_softmax(logits / scale); top ids by logprob, then by id; past V, -1
    and nan. float32 [m, V] logits."""
    x = logits if scale is None else logits / np.asarray(scale, np.float32).reshape(-1, 1)
    m, vocab = x.shape
    top = x.max(axis=1)
    top[~np.isfinite(top)] = 0
    shifted = x - top[:, None]
    total = np.exp(shifted, out=shifted).sum(axis=1)  # float32, pairwise: ample for a log
    lse = (np.log(total) + top).astype(np.float32)
    chosen = x[np.arange(m), ids] - lse
    wide = min(k, vocab)
    out_ids, out = np.full((m, k), -1, np.int64), np.full((m, k), np.nan, np.float32)
    if wide:
        top_ids = np.argpartition(x, vocab - wide, axis=1)[:, vocab - wide:]
        values = np.take_along_axis(x, top_ids, axis=1)
        order = np.lexsort((top_ids, -values), axis=1)
        out_ids[:, :wide] = np.take_along_axis(top_ids, order, axis=1)
        out[:, :wide] = np.take_along_axis(values, order, axis=1) - lse[:, None]
    return chosen, out_ids, out


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
        return score_numpy(logits, ids, k, None if temperature == 1.0 else [temperature])
