"""The running batch of an iterative engine: requests join and leave at every step.

A step model (what the factory returns with iterative=True) keeps each
request's state between steps, by request id:

    join(ids, batch, lengths=None)   new requests enter (prefill)
    step(ids) -> (out, done)         one step of every active request, in order
    leave(ids)                       finished, withdrawn, expired or failed

Each iteration of a Stepper:
1. drops the requests past their deadline (failed as expired, after the
   chunks they had): leave(), then each slot settled;
2. joins the READY requests, most urgent first, up to max_batch_size active
   and the max_batch_tokens budget (a request reserves its input length +
   its max_steps from join to leave); join() is their prefill. One over the
   budget waits, and later ones that fit go ahead of it for at most
   max_steps steps (joining.py);
3. steps every active request once, writes each one's chunk into its own
   slot (row k of its outputs is chunk k) and publishes the counts;
4. answers the requests done (step said so, or at their max_steps) and
   leaves them, with those their client withdrew (seen by this step's
   publish: their slots are freed).

With nothing running it sleeps on the ring's work word, and the flush rule
decides when the first requests start (as in batcher.py). A request stays with
the batcher that joined it. A join or step that raises fails the requests it
named, after the chunks they had; the others go on.

A batcher's successor (it died) starts again the requests that had no chunk
yet, before it claims anything: one at a time, each joining an empty running
batch, so that no stream runs beside one that may be poison. Each runs alone
to its end while retries remain (the next joins an empty batch); the last
runs alone until its first step has passed (its first chunk published), and
then claims resume. One that kills this batcher too fails as poison, and no
stream dies with it.
"""
import logging

import numpy as np

from engine.batching import admission, policy
from engine.batching.joining import Group, claim_ranks, is_due, pick
from engine.batching.loop import RETIRED, STOPPED, await_epoch, await_work, error_text
from engine.batching.model_call import ModelCall
from engine.shm import codes, ring
from engine.tensors import BadResult

log = logging.getLogger("shmbatch")

_NONE = np.zeros(0, np.uint32)  # no slot joined

_STOP_MESSAGE = (b"the engine stopped (drain_timeout_s passed) before this request's answer "
                 b"ended")


def request_ids(slots: np.ndarray, gens: np.ndarray) -> np.ndarray:
    """The step model's id of each request: unique among the active ones."""
    return ((gens.astype(np.int64) & 0x7FFFFFFF) << 32) | slots


class Stepper:
    """The loop of one batcher process of an iterative engine."""

    def __init__(self, segment, instance: int, model, epoch: int = 0):
        cfg = segment.config
        self.seg, self.ring, self.instance, self.model = segment, segment.ring, instance, model
        self.epoch = epoch
        self.cfg = cfg
        self.rule = policy.FlushRule.of(cfg)
        self.max_active = cfg.max_batch_size
        self.budget = cfg.max_batch_tokens  # None: no token budget
        self.words = segment.words
        self.batch_start_word = codes.W_BATCH_START + instance
        # admission's fit of step time, fed by each step but the first of each
        # running batch size (it warms the model up: not a measure)
        self.fit = admission.ServiceFit()
        self.claimed = ring.ClaimBuffers(segment.capacity, cfg.max_batch_size)
        self.active = Group(cfg.max_batch_size)
        self.waiting = Group(cfg.max_batch_size)  # claimed, not joined: over the budget
        self.steps_done = 0  # this batcher's steps: the clock of the budget's bound
        self.pass_bound = cfg.steps  # steps a request over the budget may be passed over
        self.retry: list = []  # a dead predecessor's requests, each to start alone
        self.states = np.zeros(cfg.max_batch_size, np.int32)
        self.ends = np.zeros(cfg.max_batch_size, np.uint32)
        self.last_claim = (0, 0, 0)  # (ready, oldest_ns, cutoff_ns) the last claim saw
        self.seen = self.claimed_seen = -1  # work_seq this turn, and at the last claim
        self.reported = (-1, 0)  # (running batch size, steps to room) as last published
        self.var_inputs = [(t, s.var_axis, s.max_shape[s.var_axis])
                           for t, s in enumerate(cfg.input_specs) if s.var_axis is not None]
        self.call = ModelCall(cfg, cfg.max_batch_size)

    # -- the loop -----------------------------------------------------------------
    def run(self) -> str:
        """Serves until the engine is STOPPED with nothing left, or until a
        reload retires it and its running requests have ended. A reload's
        new batchers (epoch E+2) join new requests from the moment the word
        reaches E+1, while the old ones (E) finish theirs and exit."""
        r, words, active = self.ring, self.words, self.active
        self.seen = -1
        self.retry = list(zip(*r.inherit(self.instance, ring.now_ns(), self.seg.capacity)))
        spin_ns = 0
        while True:
            seen = self.seen = r.work_seq()
            epoch, state = words[codes.W_EPOCH], words[codes.W_ENGINE_STATE]
            joins = self.epoch - 1 <= epoch <= self.epoch
            if state == codes.ENGINE_STOPPED and (active.n or self.waiting.n):
                self.fail_all(codes.STATUS_BATCHER_DIED, _STOP_MESSAGE)
            if epoch < self.epoch - 1:  # a reload's batcher, not let in yet
                await_epoch(r)
                continue
            start_ns = ring.now_ns()
            self.drop_expired(start_ns)
            # the watchdog's stamp covers the join (a prefill may hang too) and the step
            words[self.batch_start_word] = start_ns
            # retiring: no new claims, but what it claimed (or inherited) still joins
            joined = self.join(start_ns, state) if joins or self.retry else self.join_waiting()
            if active.n:
                self.step(joined, start_ns)
                spin_ns = self.rule.idle_spin_ns
                continue
            words[self.batch_start_word] = 0
            self.report(0)
            if epoch > self.epoch and not self.retry and not self.waiting.n:
                return self.gone(RETIRED)  # nothing of its own left: a retry or a claim is no one else's
            if not joins or self.waiting.n or self.retry:
                continue
            ready, oldest_ns, cutoff_ns = self.last_claim
            if ready == 0 and state == codes.ENGINE_STOPPED:
                return self.gone(STOPPED)
            spin_ns = await_work(r, self.rule, seen, ready, oldest_ns, cutoff_ns, start_ns,
                                 spin_ns)

    # -- 1. what is over before the step ------------------------------------------------
    def drop_expired(self, now_ns: int) -> None:
        for group in (self.active, self.waiting):
            n = group.n
            if not n or now_ns < group.soonest_ns:  # the common case: none due
                continue
            deadlines = group.deadlines[:n]
            expired = (deadlines != 0) & (deadlines <= now_ns)
            if expired.any():
                self.settle(group, expired, codes.STATUS_EXPIRED,
                            b"its deadline passed while its answer streamed")

    def settle(self, group: Group, mask: np.ndarray, status: int, message: bytes,
               left: bool = True, in_step: bool = False) -> None:
        """The requests of group where mask is True: answered (status OK) or
        failed, freed if withdrawn; left (if they joined); dropped from group.
        Outside a step (whose end wakes them) their async waiters are woken."""
        n = group.n
        slots, gens = group.slots[:n][mask], group.gens[:n][mask]
        if left and group is self.active:
            self.leave(group.ids[:n][mask])
        if self.ring.complete_some(self.instance, slots, gens, status, message) and not in_step:
            self.ring.wake_done()
        group.keep(~mask)

    def leave(self, ids: np.ndarray) -> None:
        if len(ids):
            try:
                self.model.leave(ids.copy())
            except Exception as e:  # its state may leak; nothing else is at stake
                log.error("engine %s: the step model's leave(%d ids) raised %s", self.seg.name,
                          len(ids), error_text(e).decode())

    def fail_all(self, status: int, message: bytes) -> None:
        for group in (self.active, self.waiting):
            if group.n:
                self.settle(group, np.ones(group.n, bool), status, message)

    # -- 2. join ------------------------------------------------------------------------
    def join(self, now_ns: int, state: int) -> np.ndarray:
        """Claims and joins what the running batch has room for; returns the
        joined slots (for the queue-wait figures)."""
        active, waiting, claimed = self.active, self.waiting, self.claimed
        if self.retry:  # a dead predecessor's requests, each alone (see the docstring)
            return _NONE if active.n else self.join_retry()
        room = self.max_active - active.n - waiting.n  # the waiting ones keep their places
        if room <= 0 or is_due(waiting, self.steps_done, self.pass_bound):
            return self.join_waiting()  # and a due one: nothing new until it has joined
        if active.n and self.last_claim[0] == 0 and self.seen == self.claimed_seen:
            return self.join_waiting()  # nothing READY at the last claim, nothing published since
        self.claimed_seen = self.seen
        if active.n or waiting.n:  # running: anything READY joins at this step
            max_n, flush_n, cutoff_ns = room, 1, ring.MAX_NS
        else:  # idle: the flush rule decides when the first ones start
            max_n, flush_n, cutoff_ns = self.rule.thresholds(
                now_ns, state != codes.ENGINE_RUNNING, room)
        max_n = min(max_n, room)
        n, _, ready, oldest_ns, _ = self.ring.claim(
            self.instance, max_n, flush_n, cutoff_ns, claimed, now_ns + self.fit.estimate()[0])
        self.last_claim = (ready, oldest_ns, cutoff_ns)
        if n:
            # their order matters only where some may wait: under a budget
            slots = claimed.slots[:n].copy()
            ranks = claim_ranks(self.ring, slots) if self.budget is not None else (0, 0)
            self.stage(slots, claimed.gens[:n].copy(), claimed.lengths[:n].copy(), *ranks)
        return self.join_waiting()

    def join_retry(self) -> np.ndarray:
        """The next inherited request, into an empty running batch."""
        slot, gen, length = self.retry.pop(0)
        if self.ring.retry_alone(self.instance, int(slot), int(gen)) != codes.OK:
            self.ring.complete_some(self.instance, np.array([slot], np.uint32),
                                    np.array([gen], np.uint32), codes.STATUS_OK, b"")
            return _NONE
        self.stage(np.array([slot], np.uint32), np.array([gen], np.uint32),
                   np.array([length], np.uint32))
        self.drop_expired(ring.now_ns())  # it may have waited for the retries before it
        return self.join_waiting()

    def stage(self, slots: np.ndarray, gens: np.ndarray, lengths: np.ndarray,
              levels=0, arrivals=0) -> None:
        """Claimed requests into the waiting group, with their bounds."""
        limits, deadlines = np.zeros(len(slots), np.uint32), np.zeros(len(slots), np.uint64)
        self.ring.stream_limits(slots, limits, deadlines)
        top = max((bound for _, _, bound in self.var_inputs), default=0)
        tokens = np.minimum(lengths, top).astype(np.int64) + limits
        ids = request_ids(slots, gens)
        self.waiting.add(slots, gens, ids, limits, deadlines, tokens, levels, arrivals)

    def join_waiting(self) -> np.ndarray:
        """Joins the waiting requests that fit (joining.pick)."""
        waiting, active = self.waiting, self.active
        n, room = waiting.n, self.max_active - active.n
        if not n or room <= 0:
            return _NONE
        if self.budget is None:  # claims are bounded by the room: all of them join
            take = np.arange(min(n, room))
        else:
            free = self.budget - int(active.tokens[:active.n].sum())
            take = np.array(pick(waiting, free, room, self.steps_done, self.pass_bound), np.intp)
            if not len(take):
                return _NONE
        mask = np.zeros(n, bool)
        mask[take] = True
        slots, gens, ids = waiting.slots[take], waiting.gens[take], waiting.ids[take]
        try:
            self.prefill(ids, slots, *self.gather(slots))
        except Exception as e:
            self.leave(ids)  # whatever state the failed join made for them
            self.settle(waiting, mask, codes.STATUS_BACKEND, error_text(e), left=False)
            return _NONE
        active.add(slots, gens, ids, waiting.limits[take], waiting.deadlines[take],
                   waiting.tokens[take])
        self.joined(ids)
        waiting.keep(~mask)
        return slots

    def prefill(self, ids: np.ndarray, slots: np.ndarray, batch: list, lengths) -> None:
        """The model's join of these requests (sampled_steps keeps its logits)."""
        self.model.join(ids.copy(), *self.call.args(batch, lengths))

    def joined(self, ids: np.ndarray) -> None:
        """These requests joined, at the end of the active group (sampled_steps)."""

    def gather(self, slots: np.ndarray):
        """The joining requests' inputs (copies: a model may keep them), each
        variable dim cut to its longest real length; and those lengths."""
        batch = [region[slots] for region in self.seg.in_regions]
        if not self.var_inputs:
            return batch, None
        per_slot = self.seg.lengths[slots]
        lengths = []
        for t, axis, bound in self.var_inputs:
            real = np.minimum(per_slot[:, t], bound).astype(np.int64)  # from the segment
            index = [slice(None)] * batch[t].ndim
            index[axis + 1] = slice(0, max(1, int(real.max())))
            batch[t] = batch[t][tuple(index)]
            lengths.append(real)
        return batch, lengths

    # -- 3. step, and 4. leave ----------------------------------------------------------
    def step(self, joined: np.ndarray, start_ns: int) -> None:
        active = self.active
        n = active.n
        self.report(n)
        slots, steps = active.slots[:n], active.steps[:n]
        try:
            outputs, done = self.checked(self.model.step(active.ids[:n].copy()), n)
            for region, out in zip(self.seg.out_regions, outputs):
                region[slots, steps] = out
        except Exception as e:
            self.settle(active, np.ones(n, bool), codes.STATUS_BACKEND, error_text(e), in_step=True)
            self.finish(joined, n, start_ns)
            return
        self.publish(done)
        self.finish(joined, n, start_ns)

    def publish(self, done: np.ndarray) -> None:
        """After each active request's chunk was written: publishes the
        counts, each ending where done (its model or sampler said so) or at
        its max_steps, and answers those that ended or were withdrawn."""
        active = self.active
        n = active.n
        slots, steps = active.slots[:n], active.steps[:n]
        steps += 1
        states, ends = self.states[:n], self.ends[:n]
        # the requests this step completes: their last count says so, and why
        at_limit = steps >= active.limits[:n]
        ends[:] = 0
        ends[at_limit] = codes.CHUNKS_END | codes.CHUNKS_LIMIT
        ends[done] = codes.CHUNKS_END | codes.CHUNKS_STOP
        self.ring.stream_put(self.instance, slots, active.gens[:n], steps, ends, states)
        over = done | at_limit | (states != codes.CLAIMED)
        if over.any():
            # withdrawn ones are freed by the same completion (ABANDONED -> FREE)
            self.settle(active, over, codes.STATUS_OK, b"", in_step=True)

    def finish(self, joined: np.ndarray, n: int, start_ns: int) -> None:
        """The step's figures (and admission's fit of step time, published by the C)."""
        self.steps_done += 1
        self.ring.finish_step(joined, n, start_ns, ring.now_ns(), self.fit.measuring(n))
        self.report(self.active.n)
        self.words[self.batch_start_word] = 0

    def report(self, n: int) -> None:
        """The running batch's size, for the figures, and for admission the
        steps until a new request can join: 0 with room; with every place
        taken (the claimed ones waiting to join take the first to free), the
        steps until enough running requests reach their max_steps (a C call
        only when either changed)."""
        room_steps = 0
        queued = self.waiting.n
        if n and n + queued >= self.max_active:
            left = self.active.limits[:n].astype(np.int64) - self.active.steps[:n]
            k = min(queued, n - 1)
            room_steps = max(0, int(np.partition(left, k)[k]))
        if (n, room_steps) != self.reported:
            self.reported = (n, room_steps)
            self.ring.set_active(self.instance, n, room_steps)

    def gone(self, outcome: str) -> str:
        """Says, as the loop ends, that this batcher takes no more requests."""
        self.ring.set_word(codes.W_ROOM_STEPS + self.instance, 0)
        return outcome

    def checked(self, result, n: int):
        """step()'s (out, done) as each output's n chunks in spec order and
        done as bool[n]; BadResult saying what came otherwise."""
        if not (isinstance(result, tuple) and len(result) == 2):
            raise BadResult(f"step() returns (out, done), got {type(result).__name__}")
        out, done = result
        outs = self.call.check(self.call.outputs(out), n)
        if type(done) is np.ndarray and done.dtype == bool and done.shape == (n,):
            return outs, done  # the common case, checked cheaply
        done = np.asarray(done)
        if done.shape != (n,):
            raise BadResult(f"done: expected bool[{n}], got {done.dtype}{list(done.shape)}")
        return outs, done.astype(bool, copy=False)
