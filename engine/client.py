"""The client handle: validate, write the input once into a slot, wait for its answer.

A request is a ticket (slot, generation) in the engine's ring. The caller's
thread validates the input (InvalidInput before anything is enqueued), takes
a free slot (QueueFull at once when there is none), copies the input into the
slot's row of the shared input region and publishes it. Then:

- infer() sleeps on the slot's futex in the calling thread (the GIL is
  released in C), in slices, to notice an engine that died meanwhile;
- submit() and infer_async() hand the ticket to one completion thread per
  client and process, which sleeps on the ring's done_seq word and settles
  every finished ticket after each batch: no thread per request.

A timed-out request is abandoned with a CAS on its ticket, so a late answer
can never reach a newer request that reuses the slot. A Client is shared by
threads freely; after os.fork() the child rebinds its process identity and
drops the parent's pending tickets, which stay the parent's.
"""
import asyncio
import concurrent.futures
import itertools
import os
import threading
import weakref
from typing import Optional

import numpy as np

from engine import liveness, ring
from engine.errors import (BackendError, EngineError, EngineUnavailable, QueueFull,
                           RequestTimeout)
from engine.layout import Segment

# How often a waiting client checks that the engine still lives (its lock).
LIVENESS_SLICE_NS = 100_000_000

# A blocking wait first spins this long if the client's previous wait ended
# within it: a fast backend's answer then costs no kernel wake-up (about half
# of a short round trip). After a longer wait the next one sleeps at once, so
# a slow backend's clients burn no CPU. Never on one CPU, where a spinning
# client would only delay the batcher it waits for.
SPIN_NS = 50_000 if len(os.sched_getaffinity(0)) > 1 else 0

_clients = weakref.WeakSet()


def _deadline_ns(timeout: Optional[float]) -> Optional[int]:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
    return ring.now_ns() + int(timeout * 1e9)


def _queue_full(seg) -> QueueFull:
    return QueueFull(f"queue_capacity {seg.capacity} reached: expected a free slot, "
                     f"got {seg.capacity} requests queued or in flight")


def _backend_error(status: int, text: str) -> BackendError:
    if status == ring.STATUS_BATCHER_DIED:
        return BackendError("BatcherDied", text)
    exc_type, _, message = text.partition(": ")
    return BackendError(exc_type, message)


class Client:
    """A handle on the running engine called ``name`` (contract section 2)."""

    def __init__(self, name: str):
        self.name = name
        self._seg: Optional[Segment] = Segment.attach(name)
        if self._seg.engine_state() != ring.ENGINE_RUNNING or not self._seg.holder_alive():
            self._seg = None
            raise EngineUnavailable(f"engine {name!r} is not running")
        self._checked_ns = ring.now_ns()
        self._bind_process()
        _clients.add(self)

    def _bind_process(self) -> None:
        self._pid = os.getpid()
        self._start_ticks = liveness.start_ticks(self._pid) or 0
        self._lock = threading.Lock()
        self._completer: Optional[_Completer] = None
        self._spin_ns = SPIN_NS  # see SPIN_NS; shared by threads, a hint only

    # -- public API ---------------------------------------------------------
    def infer(self, x, timeout: Optional[float] = 1.0) -> np.ndarray:
        """Blocks until the answer to x comes; returns it as a new array."""
        deadline = _deadline_ns(timeout)
        seg, slot, gen = self._enqueue(x)
        return self._await(seg, slot, gen, deadline, timeout)

    def submit(self, x, timeout: Optional[float] = 1.0) -> concurrent.futures.Future:
        """Enqueues x now; the Future resolves to its answer (or error)."""
        deadline = _deadline_ns(timeout)
        seg, slot, gen = self._enqueue(x)
        future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        self._completer_for().add(seg, slot, gen, deadline, timeout,
                                  future.set_result, future.set_exception)
        return future

    async def infer_async(self, x, timeout: Optional[float] = 1.0) -> np.ndarray:
        """infer() for asyncio: awaits the answer without blocking the loop."""
        deadline = _deadline_ns(timeout)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        seg, slot, gen = self._enqueue(x)

        def settle(value, error):
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)

        self._completer_for().add(
            seg, slot, gen, deadline, timeout,
            lambda v: loop.call_soon_threadsafe(settle, v, None),
            lambda e: loop.call_soon_threadsafe(settle, None, e))
        return await future

    def infer_many(self, xs: np.ndarray, timeout: Optional[float] = 1.0) -> np.ndarray:
        """Sends xs[0], xs[1], ... as len(xs) requests at once and blocks until all
        are answered; returns the answers stacked, shape (n, *output_shape).

        The requests are enqueued, waited for and released in bulk (one C call
        each), in chunks of at most half the queue_capacity, so one bulk call
        leaves room for other clients. QueueFull if not one slot is free when a
        chunk starts; on any error no answer of the call is returned.
        """
        deadline = _deadline_ns(timeout)
        seg, xs, length = self._validated(xs, many=True)
        cfg, n, r = seg.config, len(xs), seg.ring
        out = np.empty((n, *cfg.output_shape), cfg.output_dtype)
        chunk = min(n, max(1, seg.capacity // 2))
        slots, gens = np.empty(chunk, np.uint32), np.empty(chunk, np.uint32)
        codes = np.empty(chunk, np.int32)
        done = 0
        while done < n:
            k = r.acquire_many(self._pid, self._start_ticks, min(chunk, n - done), slots, gens)
            if k == 0:
                raise _queue_full(seg)
            s, g = slots[:k], gens[:k]
            rows = xs[done:done + k]
            if cfg.var_axis is not None:  # equal lengths, zero-padded to the bound
                padded = np.zeros((k, *cfg.padded_shape), cfg.input_dtype)
                padded[(slice(None),) * (cfg.var_axis + 1) + (slice(0, length),)] = rows
                rows = padded
            seg.inputs[s] = rows
            r.publish_many(s, g, k, length)
            self._await_all(seg, s, g, k, deadline, timeout)
            r.poll(s, g, codes[:k])
            failed = np.nonzero(codes[:k] == ring.EFAILED)[0]
            if len(failed):
                status, text = r.slot_error(int(s[failed[0]]))
                r.release_many(s, g, k)
                raise _backend_error(status, text)
            out[done:done + k] = seg.outputs[s]
            r.release_many(s, g, k)
            done += k
        return out

    def _await_all(self, seg, slots, gens, k, deadline, timeout) -> None:
        r = seg.ring
        while True:
            slice_ns = LIVENESS_SLICE_NS
            if deadline is not None:
                slice_ns = max(0, min(slice_ns, deadline - ring.now_ns()))
            code = r.wait_all(slots, gens, k, slice_ns, self._spin_ns)
            if code == ring.OK:
                return
            expired = deadline is not None and ring.now_ns() >= deadline
            if code == ring.ETIMEOUT and not expired and self._lives(seg):
                continue
            for slot, gen in zip(slots.tolist(), gens.tolist()):
                if r.abandon(slot, gen) == ring.EBUSY:
                    r.release_slot(slot, gen)
            if code == ring.ETIMEOUT and expired:
                raise RequestTimeout(f"expected {k} answers within {timeout} s, got fewer "
                                     f"(requests abandoned)")
            raise EngineUnavailable(f"engine {self.name!r} stopped or died while the requests waited")

    def close(self) -> None:
        """Fails what is pending here with EngineUnavailable and detaches."""
        completer, self._completer = self._completer, None
        if completer is not None:
            completer.close()
        self._seg = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the request path ---------------------------------------------------
    def _validated(self, x, many=False):
        """(segment, array, real length): the running engine's segment, and x
        checked against its input spec before anything is enqueued."""
        seg = self._segment()  # a forked child was rebound at the fork (register_at_fork)
        try:
            array, length = (seg.config.check_many if many else seg.config.check_input)(x)
        except EngineError:
            seg.ring.add_word(ring.W_INVALID)
            raise
        return seg, array, length

    def _enqueue(self, x):
        seg, array, length = self._validated(x)
        r = seg.ring
        if seg.fixed_shape and array.flags.c_contiguous:  # one C call: take, copy, publish
            code, slot, gen = r.submit(self._pid, self._start_ticks, array, length)
        else:
            code, slot, gen = r.acquire(self._pid, self._start_ticks)
            if code == ring.OK:
                try:
                    self._write_row(seg, slot, array, length)
                except BaseException:
                    r.cancel(slot, gen)
                    raise
                code = r.publish(slot, gen, length)
        if code == ring.EFULL:
            raise _queue_full(seg)
        if code != ring.OK:
            raise EngineUnavailable(f"cannot enqueue on engine {self.name!r} (code {code}: the "
                                    f"engine reclaimed the request or refused it)")
        return seg, slot, gen

    @staticmethod
    def _write_row(seg, slot, array, length) -> None:
        row = seg.inputs[slot]
        var_axis = seg.config.var_axis
        if var_axis is None:
            row[...] = array
        else:  # zero the padding, so the batch needs no per-request fill
            head = (slice(None),) * var_axis
            row[head + (slice(0, length),)] = array
            row[head + (slice(length, None),)] = 0

    def _segment(self) -> Segment:
        """The running engine's segment; re-attaches after a restart of the engine."""
        seg = self._seg
        if seg is None:
            raise EngineUnavailable(f"client of {self.name!r} is closed")
        if seg.engine_state() == ring.ENGINE_RUNNING:
            now = ring.now_ns()
            if now - self._checked_ns < LIVENESS_SLICE_NS:
                return seg
            if seg.holder_alive():
                self._checked_ns = now
                return seg
        with self._lock:
            if self._seg is seg:
                self._seg = self._reattach(seg)
            return self._seg

    def _reattach(self, old: Segment) -> Segment:
        try:
            new = Segment.attach(self.name)
        except EngineUnavailable:
            raise EngineUnavailable(f"engine {self.name!r} is not running") from None
        if (new.incarnation == old.incarnation or new.engine_state() != ring.ENGINE_RUNNING
                or not new.holder_alive()):
            new.close()
            raise EngineUnavailable(f"engine {self.name!r} is stopping or not running")
        self._checked_ns = ring.now_ns()
        return new

    @staticmethod
    def _lives(seg: Segment) -> bool:
        return seg.engine_state() != ring.ENGINE_STOPPED and seg.holder_alive()

    def _await(self, seg, slot, gen, deadline, timeout):
        r = seg.ring
        out = np.empty(seg.output_shape, seg.output_dtype)
        while True:
            slice_ns = LIVENESS_SLICE_NS
            if deadline is not None:
                slice_ns = max(0, min(slice_ns, deadline - ring.now_ns()))
            started_ns = ring.now_ns()
            code = r.take(slot, gen, slice_ns, self._spin_ns, out)
            self._spin_ns = SPIN_NS if ring.now_ns() - started_ns <= SPIN_NS else 0
            if code == ring.OK:  # copied out and released in the same call
                return out
            if code != ring.ETIMEOUT:
                return self._collect(seg, slot, gen, code)
            if deadline is not None and ring.now_ns() >= deadline:
                if r.abandon(slot, gen) == ring.EBUSY:
                    continue  # answered meanwhile: take it
                raise RequestTimeout(f"expected an answer within {timeout} s, got none "
                                     f"(request abandoned)")
            if not self._lives(seg):
                if r.abandon(slot, gen) == ring.EBUSY:
                    continue
                raise EngineUnavailable(f"engine {self.name!r} stopped or died while the request waited")

    def _collect(self, seg, slot, gen, code) -> np.ndarray:
        """The answer of a ticket whose wait ended with code (not ETIMEOUT)."""
        r = seg.ring
        if code == ring.OK:
            out = np.empty(seg.output_shape, seg.output_dtype)
            code = r.take(slot, gen, 0, 0, out)
            if code == ring.OK:
                return out
        if code == ring.EFAILED:
            status, text = r.slot_error(slot)
            r.release_slot(slot, gen)
            raise _backend_error(status, text)
        raise EngineUnavailable(f"engine {self.name!r} reclaimed the request (code {code})")

    def _completer_for(self) -> "_Completer":
        with self._lock:
            if self._completer is None:
                self._completer = _Completer(self)
                self._completer.start()
            return self._completer


class _Ticket:
    __slots__ = ("seg", "slot", "gen", "deadline", "timeout", "on_value", "on_error")

    def __init__(self, seg, slot, gen, deadline, timeout, on_value, on_error):
        self.seg, self.slot, self.gen = seg, slot, gen
        self.deadline, self.timeout = deadline, timeout
        self.on_value, self.on_error = on_value, on_error


class _Completer(threading.Thread):
    """Settles the submit()/infer_async() tickets of one client in one process."""

    def __init__(self, client: Client):
        super().__init__(name=f"shmbatch-completer-{client.name}", daemon=True)
        self.client = client
        self.cond = threading.Condition()
        self.pending = {}
        self.ids = itertools.count()
        self.closed = False
        self.checked_ns = ring.now_ns()

    def add(self, seg, slot, gen, deadline, timeout, on_value, on_error) -> None:
        with self.cond:
            idle = not self.pending
            self.pending[next(self.ids)] = _Ticket(seg, slot, gen, deadline, timeout,
                                                   on_value, on_error)
            if idle:  # else it sleeps on done_seq and takes this ticket on its next pass:
                self.cond.notify()  # waking it per request would cost a context switch each

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.join(timeout=5.0)

    def run(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.closed:
                    self.cond.wait(timeout=1.0)
                if self.closed:
                    self._fail_all(EngineUnavailable(f"client of {self.client.name!r} closed"))
                    return
                tickets = dict(self.pending)
            seg = next(iter(tickets.values())).seg
            seen = seg.ring.done_seq()  # before polling: a later batch wakes us
            settled, next_deadline = self._settle(tickets)
            with self.cond:
                for key in settled:
                    del self.pending[key]
                if len(settled) < len(tickets):
                    wait_ns = LIVENESS_SLICE_NS
                    if next_deadline is not None:
                        wait_ns = max(0, min(wait_ns, next_deadline - ring.now_ns()))
                else:
                    continue
            seg.ring.wait_done_seq(seen, wait_ns)

    def _settle(self, tickets):
        settled, next_deadline = [], None
        by_seg = {}
        for key, t in tickets.items():
            by_seg.setdefault(id(t.seg), []).append((key, t))
        now = ring.now_ns()
        for group in by_seg.values():
            seg = group[0][1].seg
            slots = np.fromiter((t.slot for _, t in group), np.uint32, len(group))
            gens = np.fromiter((t.gen for _, t in group), np.uint32, len(group))
            codes = np.empty(len(group), np.int32)
            seg.ring.poll(slots, gens, codes)
            lives = None
            for (key, t), code in zip(group, codes.tolist()):
                if code == ring.EBUSY:
                    if t.deadline is not None and now >= t.deadline:
                        if seg.ring.abandon(t.slot, t.gen) == ring.EBUSY:
                            continue  # answered meanwhile: next pass takes it
                        t.on_error(RequestTimeout(f"expected an answer within {t.timeout} s, "
                                                  f"got none (request abandoned)"))
                        settled.append(key)
                        continue
                    if lives is None:  # probe at most once a slice: it costs 2 syscalls
                        lives = now - self.checked_ns < LIVENESS_SLICE_NS
                        if not lives:
                            lives, self.checked_ns = Client._lives(seg), now
                    if not lives and seg.ring.abandon(t.slot, t.gen) != ring.EBUSY:
                        t.on_error(EngineUnavailable(f"engine {self.client.name!r} stopped or "
                                                     f"died while the request waited"))
                        settled.append(key)
                    elif t.deadline is not None:
                        next_deadline = min(next_deadline or t.deadline, t.deadline)
                    continue
                try:
                    t.on_value(self.client._collect(seg, t.slot, t.gen, code))
                except EngineError as e:
                    t.on_error(e)
                settled.append(key)
        return settled, next_deadline

    def _fail_all(self, error: EngineError) -> None:
        for t in self.pending.values():
            if t.seg.ring.abandon(t.slot, t.gen) == ring.EBUSY:
                t.seg.ring.release_slot(t.slot, t.gen)
            t.on_error(error)
        self.pending.clear()


def _after_fork_in_child() -> None:
    # the parent's threads and locks do not exist here; its tickets stay its own
    for client in list(_clients):
        client._bind_process()


os.register_at_fork(after_in_child=_after_fork_in_child)
