"""Requests whose answers wait in their slots: submit() Futures, the one
completion thread that settles those nobody asks for, and the evictor that
moves answered ones out of a full ring.

A submit() Future's answer stays in its slot until someone asks: result(),
exception() and done() take it in the asking thread, so a caller keeping many
requests in flight costs no thread switch per request. Whoever waits without
asking -- add_done_callback(), concurrent.futures.wait(), as_completed(),
infer_async() -- hands the request to the client's completion thread, which
sleeps on the ring's done_seq word and settles what is answered after each
batch. The evictor sleeps on evict_seq and, when a client of any process
finds the ring full, settles this client's answered Futures so their slots
are free.

Each class here sees its client as a handle.Handle, and the completer
sees its requests as handle.Item (this module does not import client.py,
which imports it).
"""
import asyncio
import collections
import concurrent.futures
import itertools
import logging
import os
import sys
import threading
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from engine.client import answers, loops, tracing, waiting
from engine.client.handle import ANSWER, CHUNKS, Handle, Item
from engine.client.tracing import TRACE_MODULE
from engine.errors import EngineError
from engine.shm import codes, ring

# a Future's states, as concurrent.futures names them
_PENDING, _FINISHED = concurrent.futures._base.PENDING, concurrent.futures._base.FINISHED

log = logging.getLogger("shmbatch")

# How often an idle evictor checks that its client still exists.
EVICTOR_SLICE_NS = 1_000_000_000
# How long a completer with nothing pending still watches its engine's batches,
# so that a client sending one request after another wakes it once per answer
LINGER_NS = 10_000_000


class Request(concurrent.futures.Future):
    """The Future of submit(): settled by whoever asks first (see the module
    docstring). A Future dropped while its request is pending gives its slot
    back. To the completer, an item of kind ANSWER."""
    kind = ANSWER
    _began: Optional[tracing.Began] = None  # the caller's context, for the request's span
    _waiter_list: Optional["_WatchOnAppend"]
    _done_callbacks: List[Callable[..., object]]

    def __init__(self, client: Handle, seg, slot: int, gen: int, deadline: Optional[int],
                 timeout: Optional[float], outs: Optional[tuple] = None) -> None:
        # Future.__init__'s state, set here so that all futures of a client share
        # one condition: Future.__init__ makes one per request (~2 us, as much as
        # the rest of submit()). The stdlib only ever locks it around short
        # updates, never waits on it here (result() and exception() are ours).
        self._condition = client.futures_cond
        self._state, self._result, self._exception = _PENDING, None, None
        self._waiter_list, self._done_callbacks = None, []
        self.client, self.seg, self.slot, self.gen = client, seg, slot, gen
        self.deadline, self.timeout, self.outs = deadline, timeout, outs  # outs: in spec order
        self._pid = client.pid
        self._watched = False
        self._ref = weakref.ref(self)
        client.held[slot] = self._ref  # for sweep(), when the ring is full
        # once answered: the engine's (arrival_ns, claim_ns, done_ns) of the request
        # (CLOCK_MONOTONIC): its queue wait is claim - arrival, its batch done - claim
        self.stamps_ns: Optional[Tuple[int, int, int]] = None
        if TRACE_MODULE in sys.modules:  # a tracer provider may be set (engine.client.tracing)
            self._began = tracing.begin()

    def result(self, timeout: Optional[float] = None) -> Any:
        if self._state == _PENDING:
            self._settle(timeout)
        if self._state == _FINISHED and self._exception is None:
            return self._result  # what super().result() returns, without its lock
        return super().result(timeout=0)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if self._state == _PENDING:
            self._settle(timeout)
        return super().exception(timeout=0)

    def done(self) -> bool:
        if self._state == _PENDING:
            self._settle(0)
        return self._state != _PENDING

    def cancel(self) -> bool:
        with self._condition:
            if (self._state != _PENDING
                    or waiting.withdraw(self.seg, self.slot, self.gen, release=False) != codes.OK):
                return False  # settled, or answered already (its answer is result()'s)
            cancelled = super().cancel()
        if self._began is not None:
            tracing.record(self._began, self.seg.name, None, concurrent.futures.CancelledError())
        return cancelled

    def add_done_callback(self, fn: Callable[["concurrent.futures.Future[Any]"], object]) -> None:
        super().add_done_callback(fn)
        self._watch()

    # concurrent.futures.wait() and as_completed() wait on a future by appending
    # to its _waiters list: that is the moment it needs the completer
    @property
    def _waiters(self):
        if self._waiter_list is None:
            self._waiter_list = _WatchOnAppend(self)
        return self._waiter_list

    def _watch(self) -> None:
        if not self._watched and self._state == _PENDING:
            self._watched = True
            self.client.completer().add(self)

    def try_settle(self, error: Optional[EngineError] = None) -> bool:
        """Settles the future if its request is over (answers.settle)."""
        # one settler at a time, the asker or the completer: the lock under
        # self._condition, taken without the Condition's Python-level wrapper
        with self.client.futures_lock:
            if self._state != _PENDING:
                return True
            settled, value, failure, self.stamps_ns = answers.settle(
                self.seg, self.slot, self.gen, self.outs, error)
            if settled and self.client.held.get(self.slot) is self._ref:
                del self.client.held[self.slot]
            if settled and failure is None and not self._waiter_list and not self._done_callbacks:
                self._result, self._state = value, _FINISHED  # set_result, when nobody waits
            elif failure is not None:
                self.set_exception(failure)
            elif settled:
                self.set_result(value)
        if settled and self._began is not None:  # outside the lock: an export may be slow
            tracing.record(self._began, self.seg.name, self.stamps_ns, failure)
        return settled

    def _settle(self, wait_s) -> None:
        """Settles the future, waiting up to wait_s for its answer (None: as
        long as the request lives); a wait that ends first leaves it pending."""
        if self.try_settle():
            return
        client, seg = self.client, self.seg
        until = None if wait_s is None else ring.now_ns() + max(0, int(wait_s * 1e9))
        why, _ = waiting.wait(
            lambda slice_ns: seg.ring.wait_slot(self.slot, self.gen, slice_ns, client.spin_ns),
            lambda: client.attached is not None and waiting.engine_lives(seg), self.deadline, until)
        if why == waiting.ANSWERED:
            self.try_settle()  # answered (or no longer ours): settles for sure
        elif why == waiting.EXPIRED:
            self.try_settle(waiting.ticket_timed_out(self.seg, self.slot, self.gen, self.timeout,
                                                     self.deadline))
        elif why == waiting.GONE:
            self.try_settle(waiting.client_closed(client.name) if client.attached is None
                            else waiting.engine_gone(client.name))

    def __del__(self):
        # only in the process that sent it: a forked child's copy is not the owner
        try:
            if self._state == _PENDING and os.getpid() == self._pid and not self.seg.closed:
                waiting.withdraw(self.seg, self.slot, self.gen)
        except Exception:  # at interpreter exit, modules may be gone already
            pass


class _WatchOnAppend(list):
    """A future's waiter list that hands the future to the completer when
    concurrent.futures.wait() or as_completed() appends a waiter."""

    def __init__(self, future):
        super().__init__()
        self.future = future

    def append(self, waiter) -> None:
        super().append(waiter)
        self.future._watch()


class Ticket:
    """An infer_async() request, settled into an asyncio future through its
    loop's Inbox: to the completer, an item of kind ANSWER."""
    __slots__ = ("seg", "slot", "gen", "deadline", "timeout", "future", "inbox", "began")
    kind = ANSWER

    def __init__(self, seg, slot: int, gen: int, deadline: Optional[int],
                 timeout: Optional[float], future, inbox: loops.Inbox) -> None:
        self.seg, self.slot, self.gen = seg, slot, gen
        self.deadline, self.timeout = deadline, timeout
        self.future, self.inbox = future, inbox
        # made in the caller's task: its context
        self.began = tracing.begin() if TRACE_MODULE in sys.modules else None

    def try_settle(self, error: Optional[EngineError] = None) -> bool:
        settled, value, failure, stamps = answers.settle(self.seg, self.slot, self.gen, None,
                                                         error)
        if settled:  # a closed loop wants nothing
            self.inbox.post(loops.resolve, (self.future, value, failure))
            if self.began is not None:
                # withdrawn by its cancelled task: no answer (or an unwanted one) came
                why = concurrent.futures.CancelledError() if self.future.cancelled() else failure
                tracing.record(self.began, self.seg.name, stamps, why)
        return settled


async def answer_of(completer: "Completer", seg, slot: int, gen: int, deadline: Optional[int],
                    timeout: Optional[float]) -> Any:
    """The answer of an enqueued request, awaited: at once if its engine
    answered already (publishing woke its batcher), else through a Ticket the
    completion thread settles. Cancelled, the request is withdrawn."""
    settled, value, error, _ = answers.settle_now(seg, slot, gen, None)
    if settled:
        if error is not None:
            raise error
        return value
    loop = asyncio.get_running_loop()
    future: "asyncio.Future[Any]" = loop.create_future()
    completer.add(Ticket(seg, slot, gen, deadline, timeout, future, loops.inbox(loop)))
    try:
        return await future
    except asyncio.CancelledError:
        waiting.withdraw(seg, slot, gen)  # answered meanwhile: its slot freed
        raise


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
                self._fail_all(waiting.client_closed(self.client.name))
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
                until = linger_until if linger_until else ring.now_ns() + waiting.LIVENESS_SLICE_NS
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

    def _settle(self):
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
        for key, t in streams:  # each woken if its chunk word moved; over once it is final
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
            waiting.give_up(t.seg, t.slot, t.gen, EngineError(f"{type(e).__name__}: {e}"))
            settled = True
        if settled:
            del self.pending[key]
        elif t.deadline is not None:
            next_deadline = min(next_deadline or t.deadline, t.deadline)
        return next_deadline

    def _expired(self, t: Item, now: int) -> bool:
        """Whether pending item t was failed now: at its deadline, or its engine gone."""
        if t.deadline is not None and now >= t.deadline:
            return t.try_settle(waiting.ticket_timed_out(t.seg, t.slot, t.gen, t.timeout,
                                                         t.deadline))
        if self.lives is None:  # a probe costs 2 syscalls: at most one a slice
            self.lives = now - self.checked_ns < waiting.LIVENESS_SLICE_NS
            if not self.lives:
                self.lives, self.checked_ns = waiting.engine_lives(t.seg), now
        return not self.lives and t.try_settle(waiting.engine_gone(self.client.name))

    def _fail_all(self, error) -> None:
        self._drain()
        with loops.deferred():
            for t in self.pending.values():
                t.try_settle(error)
        self.pending.clear()


class Evictor(threading.Thread):
    """Moves its client's answered Futures out of the ring when a client of
    any process finds it full (it bumps evict_seq): one sleeping thread per
    client that has used submit(), woken only then."""

    def __init__(self, client: Handle) -> None:
        super().__init__(name=f"shmbatch-evictor-{client.name}", daemon=True)
        self.client = weakref.ref(client)  # the thread must not keep its client alive

    def run(self) -> None:
        while True:
            client = self.client()
            if client is None or client.attached is None or client.pid != os.getpid():
                return
            seg, client = client.attached, None
            seen = seg.ring.evict_seq()
            seg.ring.wait_evict(seen, EVICTOR_SLICE_NS)
            if seg.ring.evict_seq() != seen:
                client = self.client()
                if client is not None:
                    sweep(client.held)
                    client = None


def _moved(item: Item) -> bool:
    """Whether item's request was answered (or, a stream, wrote a chunk) already."""
    r = item.seg.ring
    if item.kind == CHUNKS:
        return r.wait_chunks(item.slot, item.gen, 0, 0)[0] != codes.ETIMEOUT
    return r.wait_slot(item.slot, item.gen, 0, 0) != codes.ETIMEOUT


def sweep(held: dict) -> int:
    """Settles the answered Futures among held (slot -> weakref of a pending
    Future), dropping the entries of Futures gone; returns how many it settled."""
    settled = 0
    for slot, ref in list(held.items()):
        future = ref()
        if future is None:
            if held.get(slot) is ref:
                del held[slot]
        elif future._state == _PENDING and future.try_settle():
            settled += 1
    return settled
