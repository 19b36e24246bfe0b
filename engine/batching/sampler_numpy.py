"""The sampler's numpy path: sampler.py's rules on logits in host memory.

A step's full-row passes are few and cheap (a max, a compare, an exp where
the whole row's mass is needed); what sorts, sums and draws works on each
row's candidates, the ids that can be kept, gathered into [m, C] arrays with
C in the tens or thousands where V is 50,000:

- top_k rows: the ids at or above t, t the (k + 1 + masked)-th largest of the
  row's group maxima (GROUP ids a group), so at least k + 1 unmasked ids, and
  mostly not many more. p = exp((x - max) / T) is computed on them alone: it
  is monotone in x, so the k-th largest p is among them, and every p that
  ties it is too unless the largest p below t could equal it (then the row
  reads its whole row: a tie at the cut keeps every id on it).
- top_p rows without top_k: p over the row, and the ids at or above a p
  level (4 an octave, float32 bits >> LEVEL_SHIFT) whose mass holds top_p of
  the row's, so the nucleus: the level is guessed from every SAMPLE-th id's
  mass by level, checked by the mass gathered, and a row short of it guesses
  again below (what it gathered is exact), then reads its whole row.
- rows that neither top_k nor top_p truncate keep every id with p >= min_p:
  the inverse CDF runs over the row, in two levels (inverse_cdf).

The candidates are gathered in id order, so the draw is the documented one:
the first id whose float64 cumulative sum of kept p exceeds u * total. A
row's candidates, cuts and sums depend on its own values only, and every
candidate superset gives the same sums (sorted p summed in order; zeros
between kept ids add nothing), so a row draws the same alone and in any
batch. p is float32; the sums that decide a cut or a draw are float64. A row whose largest logit is NaN or +inf, or whose every
id is masked, takes its argmax.
"""
import numpy as np

BLOCK = 256  # ids per block of the inverse CDF's first level
GROUP = 64  # ids per group of a top_k threshold's group maxima
GROUPS_PER_ID = 4  # groups at least 4 times the ids a row needs: few groups hold 2 of them
LEVEL_SHIFT = 21  # float32 bits >> 21: 4 p levels an octave
LEVELS = (0x3F800000 >> LEVEL_SHIFT) + 1  # p in [0, 1]
SAMPLE = 8  # a nucleus's level masses are guessed from every 8th id of its row ...
REACH = 0.25  # ... with room: a guess short of the mass costs another gather
WIDE_GATHER = 256  # ids a row on average past which gathered copies row by row
TIE_SLACK = 1 + 2.0**-20  # a bound on p within an ulp or two of the cut counts as a tie


def sample(x: np.ndarray, plan) -> np.ndarray:
    """int64[n] tokens of float32 logits [n, V] by plan (sampler.Plan)."""
    n, vocab = x.shape
    tokens = np.zeros(n, np.int64)
    if len(plan.greedy):
        tokens[plan.greedy] = argmax(x, plan.greedy,
                                     *subset(plan.mask_rows, plan.mask_ids, plan.greedy))
    s = plan.sampled
    if not len(s):
        return tokens
    top_k, top_p = plan.top_k[s], plan.top_p[s]
    for part, draw in ((top_k > 0, top_k_tokens),
                       ((top_k == 0) & (top_p < 1), nucleus_tokens),
                       ((top_k == 0) & (top_p >= 1), plain_tokens)):
        rows = s[part]
        if not len(rows):
            continue
        xs = x if len(rows) == n else x[rows]  # all rows: a view, no copy
        mask_rows, mask_ids = subset(plan.mask_rows, plan.mask_ids, rows)
        tokens[rows] = draw(xs, plan.top_k[rows], plan.top_p[rows], plan.min_p[rows],
                            plan.temperature[rows], plan.uniforms[rows], mask_rows, mask_ids)
    return tokens


def argmax(x, rows, mask_rows, mask_ids) -> np.ndarray:
    """The argmax of x[rows] after the masks, reading a row twice only where
    its argmax is masked."""
    xs = x if len(rows) == len(x) else x[rows]
    tokens = xs.argmax(axis=1)
    if len(mask_rows):
        hit = mask_ids == tokens[mask_rows]  # the pairs that mask their row's argmax
        for r in np.unique(mask_rows[hit]).tolist() if hit.any() else ():
            row = xs[r].copy()
            row[mask_ids[mask_rows == r]] = -np.inf
            tokens[r] = row.argmax()
    return tokens


# -- top_k ---------------------------------------------------------------------------------
def top_k_tokens(x, k, top_p, min_p, temperature, uniforms, mask_rows, mask_ids, whole=False):
    m, vocab = x.shape
    need = np.minimum(k + 1 + np.bincount(mask_rows, minlength=m), vocab)
    if whole:  # every id a candidate
        t, largest = np.full(m, -np.inf, np.float32), x.max(axis=1)
    else:
        t, largest = threshold(x, need)
    broken = ~np.isfinite(largest)  # NaN or +inf in the row (or all -inf)
    t[broken] = np.nan  # gathers nothing
    ids, values = gathered(x, t, -np.inf, int(k.max()) + 1)
    if len(mask_rows):  # a few pairs: each compared with its row's candidates
        pair, at = np.nonzero(ids[mask_rows] == mask_ids[:, None])
        values[mask_rows[pair], at] = -np.inf
    top = values.max(axis=1)  # the largest unmasked logit: k + 1 unmasked ids are at or over t
    broken |= ~np.isfinite(top)
    top[broken] = 0
    p = np.exp((values - top[:, None]) / temperature[:, None])
    tokens, kth, _ = drawn(ids, p, k, top_p, min_p, uniforms)
    # ids below t have p at most bound: one that might tie the k-th p is not among the candidates
    bound = np.exp((np.nextafter(t, np.float32(-np.inf)) - top) / temperature)
    tied = np.flatnonzero(~broken & (kth > 0) & (bound * np.float32(TIE_SLACK) >= kth))
    if len(tied):
        tokens[tied] = top_k_tokens(x[tied], k[tied], top_p[tied], min_p[tied],
                                    temperature[tied], uniforms[tied],
                                    *subset(mask_rows, mask_ids, tied), whole=True)
    return finished(x, tokens, np.flatnonzero(broken), mask_rows, mask_ids)


def threshold(x, need):
    """(t, each row's max): t[i] a value with at least need[i] ids of row i at
    or above it, the need[i]-th largest of the row's group maxima; groups are
    strided (id j in group j mod cols), so one elementwise max pass finds them."""
    m, vocab = x.shape
    most = int(need.max())
    width = max(1, min(GROUP, vocab // (GROUPS_PER_ID * most)))
    cols = vocab // width
    maxima = x[:, :width * cols].reshape(m, width, cols).max(axis=1)
    if width * cols < vocab:  # the ids past the last full group: each a group of its own
        maxima = np.concatenate([maxima, x[:, width * cols:]], axis=1)
    g = maxima.shape[1]
    best = np.sort(np.partition(maxima, g - most, axis=1)[:, g - most:], axis=1)
    return best[np.arange(m), most - need], maxima.max(axis=1)


# -- top_p without top_k -------------------------------------------------------------------
def nucleus_tokens(x, k, top_p, min_p, temperature, uniforms, mask_rows, mask_ids):
    m = len(x)
    p, broken = probabilities(x, temperature, min_p, mask_rows, mask_ids)
    total = p.sum(axis=1).astype(np.float64)  # float32, pairwise: ample for top_p's share
    # a hair over the need: the kept mass, summed in another order, may round below it
    need = top_p * total * (1 + 1e-9)
    tokens = np.zeros(m, np.int64)
    t = np.full(m, np.nan, np.float32)  # each row's candidates: its ids with p >= t
    got = np.zeros(m, np.float64)  # the mass at or above t
    rows = np.flatnonzero(~broken)
    for attempt in range(3):  # a guess, a guess at what is missing, then the whole row
        if not len(rows):
            break
        for i in rows.tolist():
            t[i] = 0 if attempt == 2 else level_under(p[i], t[i], total[i] - got[i],
                                                       need[i] - got[i])
        ids, values = gathered(p if len(rows) == m else p[rows], t[rows], np.float32(-1), 1)
        got[rows] = np.maximum(values, 0).sum(axis=1, dtype=np.float64)  # -1: padding
        done = (got[rows] >= need[rows]) | (t[rows] == 0)
        if done.any():
            d = rows[done]
            tokens[d], _, _ = drawn(ids[done], values[done], k[d], top_p[d], min_p[d],
                                    uniforms[d], total[d])
        rows = rows[~done]
    return finished(x, tokens, np.flatnonzero(broken), mask_rows, mask_ids)


def level_under(p, above, rest: float, missing: float) -> float:
    """The lower edge of the highest p level under `above` (nan: none yet)
    whose ids, with those between it and `above`, hold the missing mass and
    REACH of the rest past it, as guessed from every SAMPLE-th id of the row
    (their mass by level, scaled to the rest under `above`); 0: the whole row."""
    q = p[::SAMPLE]
    if not np.isnan(above):
        q = q[q < above]
    levels = np.bincount(q.view(np.int32) >> LEVEL_SHIFT, weights=q, minlength=LEVELS)
    held = np.cumsum(levels[::-1])  # at or above each level, the top first
    if held[-1] <= 0 or missing >= rest:
        return 0.0
    at = int(np.argmax(held * (rest / held[-1]) >= missing + REACH * (rest - missing)))
    return float(np.array((LEVELS - 1 - at) << LEVEL_SHIFT, np.int32).view(np.float32))


# -- neither -------------------------------------------------------------------------------
def plain_tokens(x, k, top_p, min_p, temperature, uniforms, mask_rows, mask_ids):
    p, broken = probabilities(x, temperature, min_p, mask_rows, mask_ids)
    p[broken] = 0
    tokens = inverse_cdf(p, uniforms)
    return finished(x, tokens, np.flatnonzero(broken), mask_rows, mask_ids)


def probabilities(x, temperature, min_p, mask_rows, mask_ids):
    """(p = exp((x - max) / T) per row, zero where masked or below min_p, in
    one new [m, V] array; bool[m]: rows whose max is not finite)."""
    masked = len(mask_rows) > 0
    if masked:  # -inf before the row's max is read
        x = x.copy()
        x[mask_rows, mask_ids] = -np.inf
    top = x.max(axis=1)
    broken = ~np.isfinite(top)
    top[broken] = 0
    # the one new [m, V] array, row-major whatever x's order: a row's sums run as they always do
    p = np.subtract(x, top[:, None], out=x if masked else None, order="C")
    if (temperature != 1).any():  # T = 1 (OpenAI's default) divides by one: skipped
        np.divide(p, temperature[:, None], out=p)
    np.exp(p, out=p)
    if (min_p > 0).any():
        np.multiply(p, p >= min_p[:, None], out=p)
    return p, broken


# -- the candidates ------------------------------------------------------------------------
def gathered(values, t, fill, least: int):
    """(ids int64 [m, C], their values [m, C]): each row's ids whose value is
    at or above t[i], in id order, padded to the longest row (and at least
    `least`) with id -1 and value fill."""
    m, vocab = values.shape
    flat = np.flatnonzero(values >= t[:, None])  # ascending: row by row
    edges = np.searchsorted(flat, np.arange(m + 1) * vocab)
    counts = np.diff(edges)
    width = max(int(counts.max()) if m else 0, least)
    ids = np.full((m, width), -1, np.int64)
    out = np.full((m, width), fill, values.dtype)
    kept = values.reshape(-1)[flat]  # a copy first if values is strided
    if len(flat) <= WIDE_GATHER * m:  # a few ids a row: one scatter
        rows = np.repeat(np.arange(m), counts)
        into = rows * width + np.arange(len(flat)) - edges[rows]  # its rank in its row
        ids.reshape(-1)[into] = flat - rows * vocab
        out.reshape(-1)[into] = kept
        return ids, out
    # many: a contiguous copy a row (numpy's scatter costs ~3x as much an id)
    for i, (a, b) in enumerate(zip(edges[:-1].tolist(), edges[1:].tolist())):
        np.subtract(flat[a:b], i * vocab, out=ids[i, :b - a])
        out[i, :b - a] = kept[a:b]
    return ids, out


def drawn(ids, p, k, top_p, min_p, uniforms, total=None):
    """(tokens, the k-th largest p, whether the nucleus is within the
    candidates) of candidates ids [m, C] with p [m, C] in id order; total:
    each row's kept mass where not all of it is among them."""
    m = len(ids)
    rows = np.arange(m)
    order = np.sort(p, axis=1)[:, ::-1]  # descending
    kth = np.where(k > 0, order[rows, np.maximum(k, 1) - 1], 0)
    cut = np.maximum(min_p, kth)
    covered = np.ones(m, bool)
    nucleus = np.flatnonzero(top_p < 1)
    if len(nucleus):
        on = order[nucleus]
        mass = np.cumsum(np.where(on >= cut[nucleus, None], on, 0), axis=1, dtype=np.float64)
        kept = mass[:, -1] if total is None else total[nucleus]
        reached = mass >= (top_p[nucleus] * kept)[:, None]
        covered[nucleus] = reached[:, -1]
        at = np.where(covered[nucleus], on[np.arange(len(on)), reached.argmax(axis=1)], 0)
        cut[nucleus] = np.maximum(cut[nucleus], at)
    cdf = np.cumsum(np.where(p >= cut[:, None], p, 0), axis=1, dtype=np.float64)
    mass = cdf[:, -1]
    # u * mass may round up to mass: kept below it, the pick is a kept id
    target = np.minimum(uniforms * mass, np.nextafter(mass, 0))
    return ids[rows, (cdf > target[:, None]).argmax(axis=1)], kth, covered


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
    return np.minimum(block * BLOCK + within, vocab - 1)


def subset(mask_rows, mask_ids, rows):
    """The (row, id) mask pairs of rows (ascending), the rows renumbered 0..
    in their order."""
    if not len(mask_rows):
        return mask_rows, mask_ids
    at = np.full(int(rows.max()) + 1, -1, np.int64)
    at[rows] = np.arange(len(rows))
    local = at[np.minimum(mask_rows, len(at) - 1)]
    mine = (mask_rows < len(at)) & (local >= 0)
    return local[mine], mask_ids[mine]


def finished(x, tokens, broken, mask_rows, mask_ids):
    """tokens, with the broken rows' their argmax after the masks."""
    if len(broken):
        tokens[broken] = argmax(x, broken, *subset(mask_rows, mask_ids, broken))
    return tokens


# -- logprobs ------------------------------------------------------------------------------
def score(logits: np.ndarray, ids: np.ndarray, k: int, scale=None):
    """(logprob of ids[i] in row i, the top k ids of each row, their logprobs),
    of log_softmax(logits / scale); top ids by logprob, then by id; past V, -1
    and nan. float32 [m, V] logits."""
    m, vocab = logits.shape
    rows = np.arange(m)
    s = np.ones(m, np.float32) if scale is None else \
        np.broadcast_to(np.asarray(scale, np.float32).reshape(-1), (m,))
    top = logits.max(axis=1)
    top[~np.isfinite(top)] = 0
    z = np.subtract(logits, top[:, None])  # z = (x - max) / scale: the one [m, V] array
    if scale is not None:
        np.divide(z, s[:, None], out=z)
    chosen_z = z[rows, ids]
    log_total = np.log(np.exp(z, out=z).sum(axis=1))  # float32, pairwise: ample for a log
    chosen = chosen_z - log_total
    wide = min(k, vocab)
    out_ids, out = np.full((m, k), -1, np.int64), np.full((m, k), np.nan, np.float32)
    if wide:
        top_ids, values = top_logits(logits, top, s, wide)
        out_ids[:, :wide] = top_ids
        out[:, :wide] = values - log_total[:, None]
    return chosen, out_ids, out


def top_logits(logits, top, s, wide: int):
    """(ids [m, wide], (x - max) / s at them): each row's largest, by x / s
    then by id."""
    m = len(logits)
    t, largest = threshold(logits, np.full(m, wide))
    t[~np.isfinite(largest)] = -np.inf  # NaN or +inf in the row: every id
    ids, x = ranked(logits, t, s, wide)
    # ids below t have x / s at most bound: one that may tie the wide-th is not gathered
    bound = np.nextafter(t, np.float32(-np.inf)) / s
    again = np.flatnonzero(np.isfinite(t) & (bound >= x[:, -1] / s))
    if len(again):
        ids[again], x[again] = ranked(logits[again], np.full(len(again), -np.inf, np.float32),
                                      s[again], wide)
    return ids, (x - top[:, None]) / s[:, None]


def ranked(logits, t, s, wide: int):
    """(ids, x at them) of each row's wide largest ids at or above t, by x /
    s then by id."""
    ids, x = gathered(logits, t, -np.inf, wide)
    order = np.lexsort((ids, -(x / s[:, None])), axis=1)[:, :wide]
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(x, order, axis=1)
