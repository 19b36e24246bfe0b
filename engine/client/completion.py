"""The completion thread: one per client and process, it settles the
requests whose owner waits without asking.

A submit() Future handed over by add_done_callback(), wait() or
as_completed() (engine.client.future), and an infer_async() request
(ticket.Awaited) or an async stream (engine.client.async_streams) whose
loop the engine cannot wake itself (engine.client.wakes) are settled here: the thread sleeps on the ring's done_seq word and, after each
batch (or an iterative engine's step), settles what is answered, wakes the
streams whose chunk word moved, and fails what is past its deadline or
whose engine is gone. The event loops it answers are woken once a pass
(engine.client.loops).

The completer sees its client as a handle.Handle and its requests as
handle.Item (this module imports neither client.py nor their modules).
"""
import collections
import itertools
import logging
import threading
from typing import Deque, Dict, Optional

import numpy as np

from engine.client import loops, ticket
from engine.client.handle import CHUNKS, Handle, Item, deadline_of, overdue
from engine.errors import EngineError
from engine.shm import codes, ring

log = logging.getLogger("shmbatch")

# How long a completer with nothing pending still watches its engine's batches,
# so that a client sending one request after another wakes it once per answer
LINGER_NS = 10_000_000


class Completer(threading.Thread):
    """Settles, in one thread per client and process, the requests whose owner
    waits without asking. It sleeps on done_seq, so it wakes once per finished
    batch, not per request."""

    def __init__(self, client: Handle) -> None:
        super().__init__(name=f"shmbatch-completer-{client.name}", daemon=True)
        self.client = client
        self.cond = threading.Condition()
        self.incoming: Deque[Item] = collections.deque()  # appended by add(), drained by run()
        self.pending: Dict[int, Item] = {}  # the completer's own: id -> item
        self.ids = itertools.count()
        self.idle = False  # asleep on cond: add() wakes it
        self.watching = None  # the segment whose done_seq it reads and waits on, if any
        self.closed = False
        self.checked_ns = ring.now_ns()
        self.lives: Optional[bool] = None  # the engine's liveness this pass (None: not probed)

    def add(self, item: Item) -> None:
        self.incoming.append(item)
        if self.idle:  # else it takes the request on its next pass: waking it per
            with self.cond:  # request would cost a context switch each
                self.cond.notify()
            return
        # it may be about to sleep on a done_seq read after this item's request
        # moved (or on another engine's): then that move must wake it. Read after
        # the append: a completer that starts watching later sees the item first
        seg = self.watching
        if seg is not None and (item.seg is not seg or _moved(item)):
            seg.ring.wake_done()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.join(timeout=5.0)

    def run(self) -> None:
        seg, linger_until = None, 0
        while True:
            self._drain()
            if self.closed:
                self._fail_all(ticket.client_closed(self.client.name))
                return
            if self.pending:
                seg, linger_until = next(iter(self.pending.values())).seg, 0
            elif seg is None or seg.closed or 0 < linger_until <= ring.now_ns():
                self._sleep()
                seg, linger_until = None, 0
                continue
            elif not linger_until:  # idle: its engine watched a while, for the next request
                linger_until = ring.now_ns() + LINGER_NS
            self.watching = seg
            seen = seg.ring.done_seq()  # before polling: a later batch wakes us
            with loops.deferred():  # their loops woken once the pass is done
                next_deadline = self._settle()
            if not self.incoming:
                until = linger_until or ring.now_ns() + ticket.LIVENESS_SLICE_NS
                if next_deadline is not None:
                    until = min(until, next_deadline)
                seg.ring.wait_done_seq(seen, max(0, until - ring.now_ns()))
            self.watching = None

    def _sleep(self) -> None:
        """Until add() or close() (or a second): nothing is pending."""
        with self.cond:
            self.idle = True  # add() reads it after appending: no lost wake-up
            if not self.incoming and not self.closed:
                self.cond.wait(timeout=1.0)
            self.idle = False

    def _drain(self) -> None:
        while self.incoming:
            self.pending[next(self.ids)] = self.incoming.popleft()

    def _settle(self) -> Optional[int]:
        """Settles every request that is over, and wakes the streams whose
        chunk word moved; returns the nearest deadline still pending."""
        by_seg: Dict[int, list] = {}
        streams, next_deadline = [], None
        for key, t in self.pending.items():
            if t.kind == CHUNKS:
                streams.append((key, t))
            else:
                by_seg.setdefault(id(t.seg), []).append((key, t))
        now = ring.now_ns()
        self.lives = None  # probed at most once a pass, and only if needed
        for group in by_seg.values():
            seg = group[0][1].seg
            slots = np.fromiter((t.slot for _, t in group), np.uint32, len(group))
            gens = np.fromiter((t.gen for _, t in group), np.uint32, len(group))
            outcomes = np.empty(len(group), np.int32)
            seg.ring.poll(slots, gens, outcomes)
            for (key, t), code in zip(group, outcomes.tolist()):
                next_deadline = self._settled(key, t, code, now, next_deadline)
        for key, t in streams:  # each woken if its chunk word moved; over once its slot settled
            next_deadline = self._settled(key, t, None, now, next_deadline)
        return next_deadline

    def _settled(self, key: int, t: Item, code: Optional[int], now: int, next_deadline):
        """Settles item t if it is over (forgotten then); returns the nearest
        deadline still pending, t's included. code: its slot's (ANSWER)."""
        try:
            if code is None:
                settled = t.try_settle() or self._expired(t, now)
            elif code != codes.EBUSY:
                settled = t.try_settle()  # answered, failed, or no longer its own
            else:
                settled = self._expired(t, now)
        except Exception as e:  # this request's fault: the others are still settled
            log.error("engine %s: a request's completion raised %s: %s; dropped",
                      self.client.name, type(e).__name__, e)
            ticket.give_up(t.seg, t.slot, t.gen, EngineError(f"{type(e).__name__}: {e}"))
            settled = True
        deadline = deadline_of(t)
        if settled:
            del self.pending[key]
        elif deadline is not None:
            next_deadline = min(next_deadline or deadline, deadline)
        return next_deadline

    def _expired(self, t: Item, now: int) -> bool:
        """Whether pending item t was failed now: at its deadline, or its engine gone."""
        if overdue(t, now):
            return t.try_settle(ticket.expired(t.seg, t.slot, t.gen, t.timeout, t.deadline))
        if self.lives is None:  # a probe costs 2 syscalls: at most one a slice
            self.lives = now - self.checked_ns < ticket.LIVENESS_SLICE_NS
            if not self.lives:
                self.lives, self.checked_ns = ticket.engine_lives(t.seg), now
        return not self.lives and t.try_settle(ticket.engine_gone(self.client.name))

    def _fail_all(self, error) -> None:
        self._drain()
        with loops.deferred():
            for t in self.pending.values():
                t.try_settle(error)
        self.pending.clear()


def _moved(item: Item) -> bool:
    """Whether item's request was answered (or, a stream, wrote a chunk) already."""
    r = item.seg.ring
    if item.kind == CHUNKS:
        return r.wait_chunks(item.slot, item.gen, 0, 0)[0] != codes.ETIMEOUT
    return r.wait_slot(item.slot, item.gen, 0, 0) != codes.ETIMEOUT
