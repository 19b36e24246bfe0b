"""The running batch of an iterative engine that samples (sampling=True).

Its step model returns logits, and the engine picks each request's tokens:

    join(ids, batch, lengths) -> logits [k, V]   each one's last prompt position
    step(ids, tokens) -> (logits [n, V], done)   tokens: what was sampled for them last
    leave(ids)

logits are numpy, or torch tensors on any device (batching.sampler). A
request's engine.Sampling comes as a record in its slot (a hidden input the
model never sees), decoded and checked when its batcher claims it: one that
does not decode fails that request alone (EngineCorrupt at its client). Each
iteration of the loop (iterative.Stepper's) steps the requests that were
running with the tokens sampled for them last, and the requests that joined
in it (whose logits came from join) are sampled with them, in one call of
`Rows.sample` over the active group's order: so a request's first chunk is
written in the iteration it joined. Each chunk is the token, its logprob
(log_softmax of the model's logits, nan where the request asked none) and the
engine's max_logprobs top ids and logprobs (past the request's own count: -1
and nan; its client cuts them off).

A request ends "stop" when it samples an eos id (unless ignore_eos) or one
of its stop_token_ids, that token its last chunk (as vLLM's token ids hold
the eos); or when its model says done; "length" at its max_steps. The Rows
follow the active group through every add and keep (joins, expiries,
failures, withdrawals, a dead predecessor's retries), in the same order.
"""
import numpy as np

from engine.batching.iterative import Stepper, request_ids
from engine.batching.loop import error_text
from engine.batching.sampler import Rows, device_logits, is_torch, numpy_logits, score
from engine.errors import InvalidInput
from engine.sampling import Sampling
from engine.shm import codes
from engine.tensors import BadResult


class SampledStepper(Stepper):
    """A Stepper whose model returns logits, and which samples its tokens."""

    def __init__(self, segment, instance: int, model, epoch: int = 0):
        super().__init__(segment, instance, model, epoch)
        cfg = self.cfg
        self.rows = Rows(cfg.max_batch_size, cfg.eos_token_ids)
        self.params: dict = {}  # claimed, not yet joined: id -> Sampling
        self.last = np.zeros(cfg.max_batch_size, np.int64)  # each active request's last token
        self.fresh: list = []  # this iteration's joins' logits, in join order
        self.fresh_rows = 0  # the active group's last rows, joined in this iteration
        self.top = cfg.max_logprobs

    # -- claims and joins ---------------------------------------------------------------
    def stage(self, slots, gens, lengths, levels=0, arrivals=0) -> None:
        """Decodes each claimed request's record; one that does not decode
        (or asks what this engine cannot do) fails alone, unstarted."""
        good = np.ones(len(slots), bool)
        params = []
        for i, slot in enumerate(slots.tolist()):
            try:
                params.append(self.decoded(self.seg.records[slot].tobytes()))
            except InvalidInput as e:
                good[i] = False
                if self.ring.complete_some(self.instance, slots[i:i + 1], gens[i:i + 1],
                                           codes.STATUS_CORRUPT, error_text(e)):
                    self.ring.wake_done()
        if not good.all():
            slots, gens, lengths = slots[good], gens[good], lengths[good]
            levels = levels[good] if np.ndim(levels) else levels
            arrivals = arrivals[good] if np.ndim(arrivals) else arrivals
        self.params.update(zip(request_ids(slots, gens).tolist(), params))
        super().stage(slots, gens, lengths, levels, arrivals)

    def decoded(self, record: bytes) -> Sampling:
        s = Sampling.decode(record).check(self.top)
        if s.prompt_logprobs is not None and self.seg.prompt_regions is None:
            raise InvalidInput(f"prompt_logprobs: engine {self.cfg.name!r} has "
                               f"prompt_logprobs=False; expected None, got {s.prompt_logprobs}")
        return s

    def prefill(self, ids: np.ndarray, slots: np.ndarray, batch: list, lengths) -> None:
        x, real = self.call.args(batch, lengths)
        asks = [self.params[i].prompt_logprobs for i in ids.tolist()]
        if all(k is None for k in asks):  # every position's logits only when one wants them
            self.fresh.append(checked_logits(self.model.join(ids.copy(), x, real), len(ids)))
            return
        every = self.model.join(ids.copy(), x, real, positions="all")
        real = np.full(len(ids), x.shape[1]) if real is None else real
        every = checked_positions(every, len(ids), x.shape[1])
        rows = np.arange(len(ids))
        last = real - 1  # each one's last prompt position: its first token's logits
        self.fresh.append(checked_logits(
            every[rows, last] if not is_torch(every) else every[rows.tolist(), last.tolist()],
            len(ids)))
        for i, k in enumerate(asks):
            if k is not None:
                self.write_prompt(int(slots[i]), x[i, :real[i]], every[i, :real[i] - 1], k)

    def write_prompt(self, slot: int, prompt: np.ndarray, logits, k: int) -> None:
        """Row j (1 <= j < len(prompt)) of the slot's prompt region: the
        logprob of prompt[j] from position j - 1's logits, the top k at it."""
        values, ids = self.seg.prompt_regions
        n = len(prompt)
        values[slot, :n] = np.nan
        if ids is not None:
            ids[slot, :n] = -1
        if n < 2:
            return
        chosen, top_ids, top = score(logits, prompt[1:], k)
        values[slot, 1:n, 0] = chosen
        values[slot, 1:n, 1:1 + k] = top[:, :k]
        if k:
            ids[slot, 1:n, :k] = top_ids[:, :k]

    def joined(self, ids: np.ndarray) -> None:
        n = self.active.n
        self.rows.add([self.params.pop(i) for i in ids.tolist()])
        self.last[n - len(ids):n] = 0
        self.fresh_rows += len(ids)

    def settle(self, group, mask, status, message, left=True, in_step=False) -> None:
        if group is self.active:  # the rows follow the group's order
            keep = ~mask
            n = group.n
            if self.fresh_rows and mask[n - self.fresh_rows:].any():
                self.drop_fresh(keep[n - self.fresh_rows:])
            self.rows.keep(keep)
            self.last[:int(keep.sum())] = self.last[:n][keep]
        elif group is self.waiting:
            for i in group.ids[:group.n][mask].tolist():
                self.params.pop(i, None)
        super().settle(group, mask, status, message, left, in_step)

    def drop_fresh(self, keep: np.ndarray) -> None:
        """Only the joins' logits of the fresh rows kept."""
        logits = concatenated(self.fresh)
        kept = np.flatnonzero(keep)
        self.fresh = [logits[kept] if not is_torch(logits) else logits[kept.tolist()]]
        self.fresh_rows = len(kept)

    # -- a step -------------------------------------------------------------------------
    def step(self, joined: np.ndarray, start_ns: int) -> None:
        active = self.active
        n = active.n
        self.report(n)
        old = n - self.fresh_rows
        parts, done_old = [], None
        if old:
            try:
                result = self.model.step(active.ids[:old].copy(), self.last[:old].copy())
                logits, done_old = self.checked(result, old)
                parts.append(logits)
            except Exception as e:  # fails the requests it named: the fresh ones go on
                mask = np.zeros(n, bool)
                mask[:old] = True
                self.settle(active, mask, codes.STATUS_BACKEND, error_text(e), in_step=True)
                old, done_old = 0, None
        parts += self.fresh
        self.fresh, self.fresh_rows = [], 0
        n_now = active.n
        if n_now:
            self.sampled(parts, done_old, old)
        self.finish(joined, n, start_ns)

    def sampled(self, parts: list, done_old, old: int) -> None:
        """Samples every active request's token, writes it as its chunk,
        publishes the counts and answers the requests that ended."""
        active = self.active
        n = active.n
        slots, steps = active.slots[:n], active.steps[:n]
        try:
            s = self.rows.sample(concatenated(parts))
            self.write(slots, steps, s)
        except Exception as e:
            self.settle(active, np.ones(n, bool), codes.STATUS_BACKEND, error_text(e),
                        in_step=True)
            return
        self.last[:n] = s.tokens
        done = self.rows.stops(s.tokens)
        if old:
            done[:old] |= done_old
        self.publish(done)

    def write(self, slots: np.ndarray, steps: np.ndarray, s) -> None:
        regions = self.seg.out_regions
        regions[0][slots, steps] = s.tokens
        regions[1][slots, steps] = s.logprobs
        if not self.top:
            return
        k = 0 if s.top_ids is None else s.top_ids.shape[1]
        if k:
            regions[2][slots, steps, :k] = s.top_ids
            regions[3][slots, steps, :k] = s.top_logprobs
        if k < self.top:
            regions[2][slots, steps, k:] = -1
            regions[3][slots, steps, k:] = np.nan

    def checked(self, result, n: int):
        """step()'s (logits, done), logits [n, V] checked, done as bool[n];
        BadResult saying what came otherwise."""
        if not (isinstance(result, tuple) and len(result) == 2):
            raise BadResult(f"step() returns (logits, done), got {type(result).__name__}")
        logits, done = result
        done = np.asarray(done)
        if done.shape != (n,):
            raise BadResult(f"done: expected bool[{n}], got {done.dtype}{list(done.shape)}")
        return checked_logits(logits, n), done.astype(bool, copy=False)


def checked_logits(logits, n: int):
    """logits [n, V] as the sampler takes them: a torch tensor that stays on
    its device, else numpy float32; BadResult saying what came otherwise."""
    return logits if device_logits(logits, n) is not None else numpy_logits(logits, n)


def checked_positions(logits, k: int, length: int):
    """join(..., positions="all")'s logits [k, L, V], L at least the batch's
    prompt length; BadResult saying what came otherwise."""
    shape = tuple(getattr(logits, "shape", ()))
    if not (len(shape) == 3 and shape[0] == k and shape[1] >= length and shape[2] >= 1):
        got = f"{type(logits).__name__}{list(shape)}"
        raise BadResult(f"join(positions='all'): expected logits [{k}, {length}, V], got {got}")
    return logits if is_torch(logits) else np.asarray(logits)


def concatenated(parts: list):
    if len(parts) == 1:
        return parts[0]
    if any(is_torch(p) for p in parts):
        import torch
        device = next(p.device for p in parts if is_torch(p))
        return torch.cat([torch.as_tensor(p, device=device) for p in parts])
    return np.concatenate(parts)
