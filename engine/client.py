"""The client handle: validate, write the input once into a slot, wait for its answer.

A request is a ticket (slot, generation) in the engine's ring. The caller's
thread validates the input (InvalidInput before anything is enqueued), then
one C call takes a free slot (QueueFull at once when there is none), copies
the input into the slot's row of the shared input region and publishes it.
Then:

- infer() waits in the calling thread (the GIL is released in C): it spins
  briefly if the last answer came that fast, else sleeps on the slot's futex,
  in slices, to notice an engine that died meanwhile; one C call copies the
  answer out and frees the slot;
- submit() returns a Future that whoever asks settles in their own thread;
  callbacks, concurrent.futures waiters and infer_async() use one completion
  thread per client and process, which sleeps on the ring's done_seq word and
  settles what is answered after each batch: no thread per request;
- request() lends a slot: its row is written and its answer read in place.

Capacity: queue_capacity bounds the requests queued or being computed;
answers waiting to be read do not count. A client that finds every slot
taken first makes room: it settles its own process's answered Futures (copy
out, free), reclaims the slots of dead owners, and asks every other client
process (through its evictor thread) to do the same, waiting up to
EVICT_WAIT_NS for a freed slot. Only then is the request refused (QueueFull).

A timed-out request is abandoned with a CAS on its ticket, so a late answer
can never reach a newer request that reuses the slot. A Client is shared by
threads freely; after os.fork() the child rebinds its process identity and
drops the parent's pending tickets, which stay the parent's.
"""
import asyncio
import collections
import concurrent.futures
import itertools
import os
import threading
import weakref
from typing import Optional

import numpy as np

from engine import liveness, reaper, ring
from engine.errors import (BackendError, EngineError, EngineUnavailable, InvalidInput,
                           QueueFull, RequestTimeout)
from engine.layout import Segment

# a submit() Future's states (see _Request)
_PENDING, _FINISHED = concurrent.futures._base.PENDING, concurrent.futures._base.FINISHED

# How often a waiting client checks that the engine still lives (its lock).
LIVENESS_SLICE_NS = 100_000_000

# A blocking wait first spins this long if the client's previous wait ended
# within it: a fast backend's answer then costs no kernel wake-up (about half
# of a short round trip). After a longer wait the next one sleeps at once, so
# a slow backend's clients burn no CPU. Never on one CPU, where a spinning
# client would only delay the batcher it waits for.
SPIN_NS = 50_000 if len(os.sched_getaffinity(0)) > 1 else 0

# How long a client that found the ring full of answers waits for other
# processes' evictors to move them out, before it raises QueueFull.
EVICT_WAIT_NS = 100_000_000
# How often an idle evictor checks that its client still exists.
EVICTOR_SLICE_NS = 1_000_000_000

_clients = weakref.WeakSet()


def _deadline_ns(timeout: Optional[float]) -> Optional[int]:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
    return ring.now_ns() + int(timeout * 1e9)


def _queue_full(seg, census: "reaper.Census") -> QueueFull:
    """The refusal, counted, with what holds the slots (after making room)."""
    seg.ring.add_word(ring.W_REJECTED)
    busy = census.count(ring.READY, ring.CLAIMED, ring.ABANDONED)
    held = census.answered_by_pid()
    text = (f"queue_capacity {seg.capacity} reached: expected a free slot, got {busy} requests "
            f"queued or being computed, {census.count(ring.WRITING)} being written or lent")
    if held:
        text += (f", {sum(held.values())} answers unread in live processes "
                 f"{sorted(held)} that did not let them go within {EVICT_WAIT_NS // 1_000_000} ms")
    return QueueFull(text)


def _sweep_process(seg) -> int:
    """Settles the answered Futures of every client of this process on the
    engine of seg (copy out, free the slot); returns how many."""
    freed = 0
    for client in list(_clients):
        other = client._seg
        if (other is not None and client._pid == os.getpid() and other.name == seg.name
                and other.incarnation == seg.incarnation):
            freed += client._sweep_answered()
    return freed


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
        self._futures_lock = threading.RLock()  # see _Request
        self._futures_cond = threading.Condition(self._futures_lock)
        self._held = {}  # slot -> weakref of the pending submit() Future holding it
        self._evictor: Optional[_Evictor] = None

    # -- public API ---------------------------------------------------------
    def infer(self, x, timeout: Optional[float] = 1.0, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Blocks until the answer to x comes; returns it as a new array, or
        in out (a writable C-contiguous array of the output's dtype and shape,
        reused by the caller: a large answer then lands in warm memory)."""
        deadline = _deadline_ns(timeout)
        seg, slot, gen = self._enqueue(x, deadline, out)
        return self._await(seg, slot, gen, deadline, timeout, out)

    def submit(self, x, timeout: Optional[float] = 1.0,
               out: Optional[np.ndarray] = None) -> concurrent.futures.Future:
        """Enqueues x now; the Future resolves to its answer (or error), in
        out if given (as for infer). cancel() withdraws the request while no
        batch has answered it."""
        deadline = _deadline_ns(timeout)
        seg, slot, gen = self._enqueue(x, deadline, out)
        if self._evictor is None:
            self._start_evictor()
        return _Request(self, seg, slot, gen, deadline, timeout, out)

    async def infer_async(self, x, timeout: Optional[float] = 1.0) -> np.ndarray:
        """infer() for asyncio: awaits the answer without blocking the loop."""
        deadline = _deadline_ns(timeout)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        seg, slot, gen = self._enqueue(x, deadline)

        def settle(value, error):
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)

        self._completer_for().add(_Ticket(
            self, seg, slot, gen, deadline, timeout,
            lambda v: loop.call_soon_threadsafe(settle, v, None),
            lambda e: loop.call_soon_threadsafe(settle, None, e)))
        return await future

    def request(self) -> "SlotRequest":
        """Takes a slot now (QueueFull at once if none) and lends its rows, so
        a large input is written once, in place, and its answer read there:

            with client.request() as r:
                r.input[...] = x                # the one copy, or produce x there
                y = r.infer(timeout=1.0)        # read-only view of the answer
                use(y)                          # valid until the with ends

        Leaving the with frees the slot (an unsent request is dropped, a pending
        one abandoned). One request per SlotRequest; fixed input shapes only."""
        seg = self._segment()
        if not seg.fixed_shape:
            raise InvalidInput(f"request() lends a row of a fixed input shape, got an engine "
                               f"of input {seg.config.input_spec()}")
        code, slot, gen = seg.ring.acquire(self._pid, self._start_ticks)
        if code == ring.EFULL:
            code, slot, gen = self._make_room(seg, None)
        if code != ring.OK:
            raise EngineUnavailable(f"cannot enqueue on engine {self.name!r} (code {code})")
        return SlotRequest(self, seg, slot, gen)

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
            want = min(chunk, n - done)
            k = r.acquire_many(self._pid, self._start_ticks, want, slots, gens)
            if k == 0:
                code, slots[0], gens[0] = self._make_room(seg, deadline)
                if code != ring.OK:
                    raise EngineUnavailable(f"cannot enqueue on engine {self.name!r} (code {code})")
                k = 1 + r.acquire_many(self._pid, self._start_ticks, want - 1, slots[1:], gens[1:])
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
            abandoned = 0
            for slot, gen in zip(slots.tolist(), gens.tolist()):
                code_k = r.abandon(slot, gen)
                abandoned += code_k == ring.OK
                if code_k == ring.EBUSY:
                    r.release_slot(slot, gen)
            if code == ring.ETIMEOUT and expired:
                r.add_word(ring.W_TIMEOUTS, abandoned)
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
    def _validated(self, x, many=False, out=None):
        """(segment, array, real length): the running engine's segment, and x
        (and out) checked against its spec before anything is enqueued."""
        seg = self._segment()  # a forked child was rebound at the fork (register_at_fork)
        try:
            array, length = (seg.config.check_many if many else seg.config.check_input)(x)
            if out is not None:
                seg.config.check_out(out)
        except EngineError:
            seg.ring.add_word(ring.W_INVALID)
            raise
        return seg, array, length

    def _enqueue(self, x, deadline, out=None):
        seg, array, length = self._validated(x, out=out)
        r = seg.ring
        fused = seg.fixed_shape and array.flags.c_contiguous
        if fused:  # one C call: take, copy, publish
            code, slot, gen = r.submit(self._pid, self._start_ticks, array, length)
        else:
            code, slot, gen = r.acquire(self._pid, self._start_ticks)
        if code == ring.EFULL:
            code, slot, gen = self._make_room(seg, deadline)
            fused = False
        if code == ring.OK and not fused:
            try:
                self._write_row(seg, slot, array, length)
            except BaseException:
                r.cancel(slot, gen)
                raise
            code = r.publish(slot, gen, length)
        if code != ring.OK:
            raise EngineUnavailable(f"cannot enqueue on engine {self.name!r} (code {code}: the "
                                    f"engine reclaimed the request or refused it)")
        return seg, slot, gen

    def _make_room(self, seg, deadline):
        """(code, slot, generation) of a slot taken after the ring was found
        full: this process's answered Futures are settled, dead owners' slots
        reclaimed, other processes asked to let their answers go (waiting up
        to EVICT_WAIT_NS, within the deadline); QueueFull if still none."""
        r = seg.ring
        if _sweep_process(seg):
            code, slot, gen = r.acquire(self._pid, self._start_ticks)
            if code != ring.EFULL:
                return code, slot, gen
        census = reaper.Census(r, seg.capacity)
        if reaper.reap_dead_clients(r, census):
            code, slot, gen = r.acquire(self._pid, self._start_ticks)
            if code != ring.EFULL:
                return code, slot, gen
            census = reaper.Census(r, seg.capacity)
        if census.answered_by_pid():  # answers another process has not read yet
            r.request_evict()
            wait_ns = EVICT_WAIT_NS
            if deadline is not None:
                wait_ns = max(0, min(wait_ns, deadline - ring.now_ns()))
            code, slot, gen = r.acquire_wait(self._pid, self._start_ticks, wait_ns)
            if code != ring.EFULL:
                return code, slot, gen
            census = reaper.Census(r, seg.capacity)
        raise _queue_full(seg, census)

    def _sweep_answered(self) -> int:
        """Settles this client's pending Futures that are answered, so that
        their slots are free; returns how many."""
        settled = 0
        for slot, ref in list(self._held.items()):
            future = ref()
            if future is None:
                if self._held.get(slot) is ref:
                    del self._held[slot]
            elif future._state == _PENDING and future.try_settle():
                settled += 1
        return settled

    def _start_evictor(self) -> None:
        with self._lock:
            if self._evictor is None:
                self._evictor = _Evictor(self)
                self._evictor.start()

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

    def _await(self, seg, slot, gen, deadline, timeout, out=None, take=True):
        """Waits for the ticket's answer and, with take, copies it out (into
        out or a new array) and frees the slot; without, leaves it in the slot
        and returns None. Errors free the slot and raise."""
        r = seg.ring
        if out is None and take:
            out = np.empty(seg.output_shape, seg.output_dtype)
        while True:
            slice_ns = LIVENESS_SLICE_NS
            if deadline is not None:
                slice_ns = max(0, min(slice_ns, deadline - ring.now_ns()))
            started_ns = ring.now_ns()
            if take:
                code = r.take(slot, gen, slice_ns, self._spin_ns, out)
            else:
                code = r.wait_slot(slot, gen, slice_ns, self._spin_ns)
            self._spin_ns = SPIN_NS if ring.now_ns() - started_ns <= SPIN_NS else 0
            if code == ring.OK:  # with take: copied out and released in the same call
                return out
            if code != ring.ETIMEOUT:
                return self._collect(seg, slot, gen, code)
            if deadline is not None and ring.now_ns() >= deadline:
                if r.abandon(slot, gen) == ring.EBUSY:
                    continue  # answered meanwhile: take it
                r.add_word(ring.W_TIMEOUTS)
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


class SlotRequest:
    """A slot lent by Client.request(): its input row to fill, then its answer
    to read in place. Use it as a context manager, in the process that made it."""

    def __init__(self, client: Client, seg, slot: int, gen: int):
        self.client, self.seg, self.slot, self.gen = client, seg, slot, gen
        self.input = seg.inputs[slot]  # writable: the request's row in shared memory
        self._sent = False
        self._pid = client._pid

    def infer(self, timeout: Optional[float] = 1.0) -> np.ndarray:
        """Sends the row as it is now; blocks until its answer; returns it as a
        read-only view of the slot's output row (valid until the slot is freed)."""
        if self._sent:
            raise RuntimeError("a SlotRequest sends once: use client.request() again")
        deadline = _deadline_ns(timeout)
        self._sent = True
        if self.seg.ring.publish(self.slot, self.gen, 0) != ring.OK:
            raise EngineUnavailable(f"engine {self.client.name!r} reclaimed the request "
                                    f"before it was queued")
        self.client._await(self.seg, self.slot, self.gen, deadline, timeout, take=False)
        answer = self.seg.outputs[self.slot].view()
        answer.flags.writeable = False
        return answer

    def close(self) -> None:
        """Frees the slot: drops an unsent request, abandons a pending one,
        releases an answered one (each a no-op once the slot is no longer ours)."""
        if self.input is None:
            return
        self.input = None
        r = self.seg.ring
        if not self._sent:
            r.cancel(self.slot, self.gen)
        elif r.abandon(self.slot, self.gen) == ring.EBUSY:  # answered: ours to release
            r.release_slot(self.slot, self.gen)

    def __enter__(self) -> "SlotRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if os.getpid() == self._pid and not self.seg.closed:
                self.close()
        except Exception:  # at interpreter exit, modules may be gone already
            pass


def _settle_ticket(client, seg, slot, gen, give_up, out=None):
    """(settled, value, error, stamps) of a ticket: its answer taken if it is
    there, with the request's (arrival_ns, claim_ns, done_ns); else, with
    give_up (an error), the request abandoned and give_up its error -- unless
    it was answered that instant; else (False, None, None, None)."""
    r = seg.ring
    if out is None:
        out = np.empty(seg.output_shape, seg.output_dtype)
    code, stamps = r.take_timed(slot, gen, out)
    if code == ring.ETIMEOUT:  # not answered yet
        if give_up is None:
            return False, None, None, None
        if r.abandon(slot, gen) != ring.EBUSY:
            if isinstance(give_up, RequestTimeout):
                r.add_word(ring.W_TIMEOUTS)
            return True, None, give_up, None
        code, stamps = r.take_timed(slot, gen, out)
    if code == ring.OK:
        return True, out, None, stamps
    try:
        client._collect(seg, slot, gen, code)  # raises what code means
    except EngineError as e:
        return True, None, e, None
    return True, None, EngineUnavailable(f"unexpected ring code {code}"), None


class _Request(concurrent.futures.Future):
    """The Future of submit().

    Its answer waits in its slot until someone asks for it: result(),
    exception() and done() take it in the asking thread, so a caller that
    keeps many requests in flight costs no thread switch per request. Whoever
    waits without asking -- add_done_callback(), concurrent.futures.wait(),
    as_completed() -- hands it to the client's completer thread, which settles
    it once its batch is done or its deadline passes. A Future dropped while
    its request is still pending gives its slot back.
    """

    def __init__(self, client, seg, slot, gen, deadline, timeout, out=None):
        # Future.__init__'s state, set here so that all futures of a client share
        # one condition: Future.__init__ makes one per request (~2 us, as much as
        # the rest of submit()). The stdlib only ever locks it around short
        # updates, never waits on it here (result() and exception() are ours).
        self._condition = client._futures_cond
        self._state, self._result, self._exception = _PENDING, None, None
        self._waiter_list, self._done_callbacks = None, []
        self.client, self.seg, self.slot, self.gen = client, seg, slot, gen
        self.deadline, self.timeout, self.out = deadline, timeout, out
        self._pid = client._pid
        self._watched = False
        self._ref = weakref.ref(self)
        client._held[slot] = self._ref  # for Client._sweep_answered
        # once answered: the engine's (arrival_ns, claim_ns, done_ns) of the request
        # (CLOCK_MONOTONIC): its queue wait is claim - arrival, its batch done - claim
        self.stamps_ns = None

    def result(self, timeout=None):
        if self._state == _PENDING:
            self._settle(timeout)
        if self._state == _FINISHED and self._exception is None:
            return self._result  # what super().result() returns, without its lock
        return super().result(timeout=0)

    def exception(self, timeout=None):
        if self._state == _PENDING:
            self._settle(timeout)
        return super().exception(timeout=0)

    def done(self) -> bool:
        if self._state == _PENDING:
            self._settle(0)
        return self._state != _PENDING

    def cancel(self) -> bool:
        with self._condition:
            if self._state != _PENDING or self.seg.ring.abandon(self.slot, self.gen) != ring.OK:
                return False  # settled, or answered already: too late to withdraw
            return super().cancel()

    def add_done_callback(self, fn) -> None:
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
            self.client._completer_for().add(self)

    def try_settle(self, give_up=None) -> bool:
        """Settles the future if its request is over (see _settle_ticket)."""
        # one settler at a time, the asker or the completer: the lock under
        # self._condition, taken without the Condition's Python-level wrapper
        with self.client._futures_lock:
            if self._state != _PENDING:
                return True
            settled, value, error, self.stamps_ns = _settle_ticket(
                self.client, self.seg, self.slot, self.gen, give_up, self.out)
            if settled and self.client._held.get(self.slot) is self._ref:
                del self.client._held[self.slot]
            if settled and error is None and not self._waiter_list and not self._done_callbacks:
                self._result, self._state = value, _FINISHED  # set_result, when nobody waits
            elif error is not None:
                self.set_exception(error)
            elif settled:
                self.set_result(value)
            return settled

    def _settle(self, wait_s) -> None:
        """Settles the future, waiting up to wait_s for its answer (None: as
        long as the request lives); a wait that ends first leaves it pending."""
        if self.try_settle():
            return
        until = None if wait_s is None else ring.now_ns() + max(0, int(wait_s * 1e9))
        r, client = self.seg.ring, self.client
        while True:
            now = ring.now_ns()
            if self.deadline is not None and now >= self.deadline:
                self.try_settle(RequestTimeout(f"expected an answer within {self.timeout} s, "
                                               f"got none (request abandoned)"))
                return
            if client._seg is None:
                self.try_settle(EngineUnavailable(f"client of {client.name!r} closed"))
                return
            if until is not None and now >= until:
                return
            slice_ns = min(LIVENESS_SLICE_NS, *(t - now for t in (self.deadline, until)
                                                if t is not None))
            if r.wait_slot(self.slot, self.gen, slice_ns, client._spin_ns) != ring.ETIMEOUT:
                self.try_settle()  # answered (or no longer ours): settles for sure
                return
            if slice_ns == LIVENESS_SLICE_NS and not Client._lives(self.seg):
                self.try_settle(EngineUnavailable(f"engine {client.name!r} stopped or died "
                                                  f"while the request waited"))
                return

    def __del__(self):
        # only in the process that sent it: a forked child's copy is not the owner
        try:
            if (self._state == _PENDING and os.getpid() == self._pid and not self.seg.closed
                    and self.seg.ring.abandon(self.slot, self.gen) == ring.EBUSY):
                self.seg.ring.release_slot(self.slot, self.gen)
        except Exception:  # at interpreter exit, modules may be gone already
            pass


class _Evictor(threading.Thread):
    """Moves this client's answered Futures out of the ring when a client of
    any process finds it full (it bumps evict_seq): one sleeping thread per
    client that has used submit(), woken only then."""

    def __init__(self, client: Client):
        super().__init__(name=f"shmbatch-evictor-{client.name}", daemon=True)
        self.client = weakref.ref(client)  # the thread must not keep its client alive

    def run(self) -> None:
        while True:
            client = self.client()
            if client is None or client._seg is None or client._pid != os.getpid():
                return
            seg, client = client._seg, None
            seen = seg.ring.evict_seq()
            seg.ring.wait_evict(seen, EVICTOR_SLICE_NS)
            if seg.ring.evict_seq() != seen:
                client = self.client()
                if client is not None:
                    client._sweep_answered()
                    client = None


class _WatchOnAppend(list):
    """A future's waiter list that hands the future to the completer when
    concurrent.futures.wait() or as_completed() appends a waiter."""

    def __init__(self, future):
        super().__init__()
        self.future = future

    def append(self, waiter) -> None:
        super().append(waiter)
        self.future._watch()


class _Ticket:
    """An infer_async() request: settled through the callbacks it was given."""
    __slots__ = ("client", "seg", "slot", "gen", "deadline", "timeout", "on_value", "on_error")

    def __init__(self, client, seg, slot, gen, deadline, timeout, on_value, on_error):
        self.client, self.seg, self.slot, self.gen = client, seg, slot, gen
        self.deadline, self.timeout = deadline, timeout
        self.on_value, self.on_error = on_value, on_error

    def try_settle(self, give_up=None) -> bool:
        settled, value, error, _ = _settle_ticket(self.client, self.seg, self.slot, self.gen,
                                                  give_up)
        if error is not None:
            self.on_error(error)
        elif settled:
            self.on_value(value)
        return settled


class _Completer(threading.Thread):
    """Settles, in one thread per client and process, the requests whose owner
    waits without asking: infer_async() tickets, and submit() futures with a
    callback or a concurrent.futures waiter. It sleeps on done_seq, so it
    wakes once per finished batch, not per request."""

    def __init__(self, client: Client):
        super().__init__(name=f"shmbatch-completer-{client.name}", daemon=True)
        self.client = client
        self.cond = threading.Condition()
        self.incoming = collections.deque()  # appended by add(), drained by run()
        self.pending = {}  # the completer's own: id -> request
        self.ids = itertools.count()
        self.idle = False
        self.closed = False
        self.checked_ns = ring.now_ns()

    def add(self, request) -> None:
        self.incoming.append(request)
        if self.idle:  # else it takes the request on its next pass: waking it per
            with self.cond:  # request would cost a context switch each
                self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.join(timeout=5.0)

    def run(self) -> None:
        while True:
            self._drain()
            if not self.pending:
                with self.cond:
                    self.idle = True  # add() reads it after appending: no lost wake-up
                    if not self.incoming and not self.closed:
                        self.cond.wait(timeout=1.0)
                    self.idle = False
                self._drain()
            if self.closed:
                self._fail_all(EngineUnavailable(f"client of {self.client.name!r} closed"))
                return
            if not self.pending:
                continue
            seg = next(iter(self.pending.values())).seg
            seen = seg.ring.done_seq()  # before polling: a later batch wakes us
            next_deadline = self._settle()
            if self.pending and not self.incoming:
                wait_ns = LIVENESS_SLICE_NS
                if next_deadline is not None:
                    wait_ns = max(0, min(wait_ns, next_deadline - ring.now_ns()))
                seg.ring.wait_done_seq(seen, wait_ns)

    def _drain(self) -> None:
        while self.incoming:
            self.pending[next(self.ids)] = self.incoming.popleft()

    def _settle(self):
        """Settles every request that is over; returns the nearest deadline still pending."""
        by_seg, next_deadline = {}, None
        for key, t in self.pending.items():
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
                if code != ring.EBUSY:
                    settled = t.try_settle()
                elif t.deadline is not None and now >= t.deadline:
                    settled = t.try_settle(RequestTimeout(
                        f"expected an answer within {t.timeout} s, got none (request abandoned)"))
                else:
                    if lives is None:  # probe at most once a slice: it costs 2 syscalls
                        lives = now - self.checked_ns < LIVENESS_SLICE_NS
                        if not lives:
                            lives, self.checked_ns = Client._lives(seg), now
                    settled = not lives and t.try_settle(EngineUnavailable(
                        f"engine {self.client.name!r} stopped or died while the request waited"))
                if settled:
                    del self.pending[key]
                elif t.deadline is not None:
                    next_deadline = min(next_deadline or t.deadline, t.deadline)
        return next_deadline

    def _fail_all(self, error: EngineError) -> None:
        self._drain()
        for t in self.pending.values():
            t.try_settle(error)
        self.pending.clear()


def _after_fork_in_child() -> None:
    # the parent's threads and locks do not exist here; its tickets stay its own
    for client in list(_clients):
        client._bind_process()


os.register_at_fork(after_in_child=_after_fork_in_child)
