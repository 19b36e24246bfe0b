"""The sampler's torch path: sampler.py's steps, with torch ops on the logits' device.

Imported only when the logits are a torch tensor (torch is then loaded). The
plan comes from the host (sampler.Plan: which rows do what, and each sampled
row's uniform); what crosses to the device is [n]-sized, in two buffers (one
float64, one int64), and what comes back is the tokens and the logprobs: the
[n, V] logits never leave their device. The rules are sampler.py's, so a
row's pick is the same function of its logits and its uniform on either path
(up to the device's float rounding).
"""
import numpy as np
import torch

from engine.tensors import BadResult


def shape_of(logits: torch.Tensor, n: int):
    """(n, V) of float logits [n, V]; BadResult saying what came otherwise."""
    if not logits.is_floating_point() or logits.ndim != 2 or logits.shape[0] != n \
            or logits.shape[1] < 1:
        raise BadResult(f"logits: expected float[{n}, V], got torch "
                        f"{str(logits.dtype).removeprefix('torch.')}{list(logits.shape)} on "
                        f"{logits.device}")
    return n, int(logits.shape[1])


def upload(device, dtype, *arrays):
    """The host arrays as tensors on device, through one copy."""
    flat = np.concatenate([np.asarray(a, dtype).reshape(-1) for a in arrays])
    return torch.from_numpy(flat).to(device).split([int(np.size(a)) for a in arrays])


def sample(logits: torch.Tensor, plan, candidates: int, widths):
    """(tokens, logprobs, top_ids, top_logprobs) as numpy, sampler.Sampled's fields."""
    n, vocab = logits.shape
    device = logits.device
    s = plan.sampled
    temperature, min_p, top_p, uniforms = upload(
        device, np.float64, plan.temperature[s], plan.min_p[s], plan.top_p[s], plan.uniforms[s])
    mask_rows, mask_ids, greedy, sampled, top_k = upload(
        device, np.int64, plan.mask_rows, plan.mask_ids, plan.greedy, s, plan.top_k[s])
    x = logits.float()
    if len(plan.mask_rows):
        x = x.clone() if x is logits else x
        x[mask_rows, mask_ids] = -torch.inf
    tokens = torch.zeros(n, dtype=torch.int64, device=device)
    if len(plan.greedy):
        tokens[greedy] = (x if len(plan.greedy) == n else x[greedy]).argmax(dim=1)
    if len(s):
        trunc = bool(((plan.top_k[s] > 0) | (plan.top_p[s] < 1)).any())
        kmax = int(plan.top_k[s].max())
        width = min(vocab, max(kmax, candidates if (plan.top_p[s] < 1).any() else 0))
        xs = x if len(s) == n else x[sampled]
        tokens[sampled] = draw(xs, temperature.float(), top_k, top_p, min_p.float(), uniforms,
                               width if trunc else 0, widths)
    logprobs = np.full(n, np.nan, np.float32)
    a = plan.asked
    host_tokens = tokens.cpu().numpy()
    if not len(a):
        return host_tokens, logprobs, None, None
    chosen, ids, top = score(logits, host_tokens[a], int(plan.logprobs.max()), plan.scale,
                             rows=a)
    logprobs[a] = chosen
    k = ids.shape[1]
    past = np.arange(k)[None, :] >= plan.logprobs[:, None]
    ids[past], top[past] = -1, np.nan
    top_ids, top_logprobs = np.full((n, k), -1, np.int64), np.full((n, k), np.nan, np.float32)
    top_ids[a], top_logprobs[a] = ids, top
    return host_tokens, logprobs, top_ids, top_logprobs


def draw(x, temperature, top_k, top_p, min_p, uniforms, width: int, widths) -> torch.Tensor:
    """One token per row of x (float32 [m, V], masked ids -inf), by inverse
    CDF; width: how many candidates top_k and top_p read (0: no row truncates),
    widths(width, V): how many a row whose nucleus is not within them reads next."""
    vocab = x.shape[1]
    p = x / temperature[:, None]
    top = p.amax(dim=1, keepdim=True)
    p = (p - torch.where(torch.isfinite(top), top, 0)).exp_()
    cut = min_p
    if width:
        cut = truncation_cut(p, cut, top_k, top_p, width, widths)
    p.masked_fill_(p < cut[:, None], 0)
    cdf = torch.cumsum(p, dim=1, dtype=torch.float64)
    total = cdf[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(0, vocab - 1)


def truncation_cut(p, cut, top_k, top_p, width: int, widths) -> torch.Tensor:
    """Each row's threshold on p after min_p (cut), top_k and top_p."""
    vocab = p.shape[1]
    cand = torch.topk(p, width, dim=1, sorted=True).values
    kth = cand.gather(1, (top_k.clamp(1, width) - 1)[:, None])[:, 0]
    cut = torch.where(top_k > 0, torch.maximum(cut, kth), cut)
    nucleus = top_p < 1
    mass = torch.where(p >= cut[:, None], p, 0).sum(dim=1, dtype=torch.float64)
    need = top_p * mass
    at, covered = nucleus_cut(cand, cut, need)
    for wide in widths(width, vocab):  # a nucleus past the candidates
        short = nucleus & ~covered
        if not bool(short.any()):
            break
        rows = short.nonzero()[:, 0]
        more = torch.topk(p[rows], wide, dim=1, sorted=True).values
        at[rows], covered[rows] = nucleus_cut(more, cut[rows], need[rows])
    return torch.where(nucleus, torch.maximum(cut, at), cut)


def nucleus_cut(cand, cut, need):
    """(the smallest candidate p at which the kept mass reaches need, whether
    the candidates reach it) per row; cand sorted descending."""
    live = torch.where(cand >= cut[:, None], cand, 0)
    reached = torch.cumsum(live, dim=1, dtype=torch.float64) >= need[:, None]
    first = (~reached).sum(dim=1).clamp_(max=cand.shape[1] - 1)  # reached only grows
    at = cand.gather(1, first[:, None])[:, 0]
    covered = reached[:, -1]
    return torch.where(covered, at, 0), covered


def score(logits: torch.Tensor, ids: np.ndarray, k: int, scale=None, rows=None):
    """sampler.score_numpy on the device: (logprob of ids[i] in row i, the top
    k ids, their logprobs), of log_softmax(logits[rows] / scale), as numpy."""
    device = logits.device
    m, vocab = len(ids), logits.shape[1]
    scale = np.ones(m) if scale is None else np.broadcast_to(np.asarray(scale, np.float64), (m,))
    row_ids = np.arange(m) if rows is None else rows
    index, chosen_ids = upload(device, np.int64, row_ids, ids)
    (scales,) = upload(device, np.float64, scale)
    x = logits[index].float() / scales.float()[:, None]
    lse = torch.logsumexp(x, dim=1)
    chosen = x.gather(1, chosen_ids[:, None])[:, 0] - lse
    wide = min(k, vocab)
    values, top_ids = torch.topk(x, wide, dim=1, sorted=True)
    if wide:  # topk takes any of the ids tied at the last place: the smallest, as numpy
        last = values[:, -1:]
        crossing = ((x == last).sum(dim=1) > (values == last).sum(dim=1)).nonzero()[:, 0]
        if len(crossing):
            top_ids[crossing] = smallest_tied(x[crossing], last[crossing], wide)
            values[crossing] = x[crossing].gather(1, top_ids[crossing])
    # ties in id order, as the numpy path: by id, then stably by value
    by_id = top_ids.argsort(dim=1)
    top_ids, values = top_ids.gather(1, by_id), values.gather(1, by_id)
    order = values.argsort(dim=1, descending=True, stable=True)
    top_ids, values = top_ids.gather(1, order), values.gather(1, order) - lse[:, None]
    out_ids, out = np.full((m, k), -1, np.int64), np.full((m, k), np.nan, np.float32)
    out_ids[:, :wide] = top_ids.cpu().numpy()
    out[:, :wide] = values.cpu().numpy()
    return chosen.cpu().numpy(), out_ids, out


def smallest_tied(x: torch.Tensor, last: torch.Tensor, wide: int) -> torch.Tensor:
    """Per row, in id order, the ids above last[i] and the smallest ids equal
    to it: wide of them (last the wide-th largest)."""
    above, tied = x > last, x == last
    room = wide - above.sum(dim=1, keepdim=True)
    chosen = above | (tied & (torch.cumsum(tied, dim=1, dtype=torch.int32) <= room))
    return chosen.nonzero()[:, 1].view(-1, wide)
