"""The client handle: validate, write the input once into a slot, wait for its answer.

A request is a ticket (slot, generation) in the engine's ring. The caller's
thread validates the input (InvalidInput before anything is enqueued), then
one C call takes a free slot, copies the input into the slot's row of the
shared input region and publishes it. Then:

- infer() waits in the calling thread (the GIL is released in C): it spins
  briefly if the last answer came that fast, else sleeps on the slot's futex,
  in slices, to notice an engine that died meanwhile; one C call copies the
  answer out and frees the slot (engine.client.ticket: a ticket's answer);
- submit() returns a Future whose answer waits in its slot until asked
  (engine.client.future); infer_async() awaits its ticket woken by the
  engine itself (engine.client.wakes; else the completion thread's);
- request() lends a slot: its row is written and its answer read in place
  (lent.py).

Capacity: queue_capacity bounds the requests queued or being computed;
answers waiting to be read do not count. A client that finds every slot
taken first makes room: it settles its own process's answered Futures (copy
out, free), reclaims the slots of dead owners, and asks every other client
process (through its evictor thread) to do the same, waiting a bounded time
for a freed slot (engine.client.room). Only then is the request refused (QueueFull).

Finding the engine (at once, after a wait, or lazily at each request, and
again after the engine restarts) is engine.client.attach's.

A Client is shared by threads freely; after os.fork() the child rebinds its
process identity and drops the parent's pending tickets, which stay the
parent's.
"""
import concurrent.futures
import os
import sys
import threading
import weakref
from typing import Any, AsyncIterator, Dict, Iterator, Optional, Tuple, TypeVar

import numpy as np

from engine.client import (async_streams, bulk, completion, looks, retrying, room, sampled,
                           shares, streams, ticket, tracing, wakes)
from engine.client.attach import attach
from engine.client.future import Request
from engine.client.lent import SlotRequest
from engine.errors import EngineError, EngineUnavailable, InvalidInput, Overloaded
from engine.sampling import Sampling
from engine.segment import UNSERVED_WORD, Segment
from engine.shm import codes, liveness, ring

# the step of the priority shares (engine.client.shares)
SHARE_STEPS = shares.SHARE_STEPS

_clients = room.clients

# A request and its answer: one array, or with named tensors a dict of arrays.
Tensors = TypeVar("Tensors", np.ndarray, Dict[str, np.ndarray])


class Client:
    """A handle on the running engine called ``name``.

    By default the engine must be running: EngineUnavailable otherwise.
    ``wait_s`` waits up to that long for it (a sidecar that is still
    starting). With ``lazy=True`` the constructor never fails for want of an
    engine: each request attaches if it can and raises EngineUnavailable at
    once ("not started yet", "starting") while it cannot, so a web app may be
    started before its sidecar. Any Client re-attaches by itself when its
    engine is restarted under the same name. With ``retries=N`` a request
    refused (QueueFull, Overloaded) or failed unstarted is sent again up to N
    times, backed off, within its deadline and a retry budget, one per
    process and engine (engine.client.retrying); ``retries_total`` counts them.

    Every request method takes ``(x, timeout=1.0, *, priority=0,
    max_steps=None, out=None)``, or those of them it has, in that order; on
    an iterative engine also ``sampling=`` (an engine.Sampling, for an engine
    with sampling=True: engine.client.sampled).

    The attributes name, pid, start_ticks, spin_ns, async_spin_ns, lone_looks, attached,
    held, futures_lock and futures_cond, and the methods completer() and
    validated(), are handle.Handle: what the client's helpers use of it.
    Callers need none of them."""

    def __init__(self, name: str, *, wait_s: float = 0.0, lazy: bool = False,
                 retries: int = 0) -> None:
        self.name = name
        self._retry = retrying.policy(retries, name)
        self._closed = False
        self.attached: Optional[Segment] = None
        self._checked_ns = 0
        try:
            self.attached = attach(name, wait_s)
        except EngineUnavailable:
            if not lazy:
                raise
        self._checked_ns = ring.now_ns()
        self._bind_process()
        _clients.add(self)

    def _bind_process(self) -> None:
        # the handle.Handle fields, documented there
        self.pid = os.getpid()
        self.start_ticks = liveness.start_ticks(self.pid) or 0
        self.spin_ns, self.async_spin_ns = ring.SPIN_NS, looks.ASYNC_SPIN_NS  # see looks
        self.lone_looks = looks.LoneLooks()
        self.futures_lock = threading.RLock()
        self.futures_cond = threading.Condition(self.futures_lock)
        self.held: Dict[int, "weakref.ref[Any]"] = {}
        self._lock = threading.Lock()
        self._completer: Optional[completion.Completer] = None
        self._evictor: Optional[room.Evictor] = None

    # -- public API ---------------------------------------------------------
    def infer(self, x: Tensors, timeout: Optional[float] = 1.0, *, priority: int = 0,
              max_steps: Optional[int] = None, out: Optional[Tensors] = None,
              sampling: Optional[Sampling] = None) -> Tensors:
        """Blocks until the answer to x comes; returns it as a new array, or
        in out (a writable C-contiguous array of the output's dtype and shape,
        reused by the caller: a large answer then lands in warm memory). The
        timeout is also the request's deadline inside the engine; priority 0
        is the most urgent. An iterative engine's answer is its chunks
        stacked, (steps, *chunk_shape), at most max_steps of them (asked
        prompt_logprobs: a dict with them too, engine.client.sampled.scored)."""
        if sampled.asks_prompt(sampling):
            return sampled.scored(self, x, timeout, priority, max_steps, sampling)
        if tracing.TRACE_MODULE in sys.modules and (parent := tracing.context()) is not None:
            return self._traced_infer(parent, x, timeout, priority, max_steps, out, sampling)
        if self._retry is not None:
            return self._retry.infer(self, x, timeout, priority, max_steps, out, sampling)
        deadline = ticket.deadline_ns(timeout)
        seg, slot, gen, outs = self._enqueue(x, deadline, priority, max_steps, out, sampling)
        answer = ticket.await_answer(self, seg, slot, gen, deadline, timeout, outs)
        return sampled.cut(answer, sampled.k_of(seg, sampling))

    def submit(self, x: Tensors, timeout: Optional[float] = 1.0, *, priority: int = 0,
               max_steps: Optional[int] = None, out: Optional[Tensors] = None,
               sampling: Optional[Sampling] = None) -> "concurrent.futures.Future[Tensors]":
        """Enqueues x now; the Future resolves to its answer (or error), in
        out if given (as for infer). cancel() withdraws the request while no
        batch has answered it."""
        sampled.refuse_prompt("submit()", sampling)
        deadline = ticket.deadline_ns(timeout)
        seg, slot, gen, outs = (
            self._enqueue(x, deadline, priority, max_steps, out, sampling) if self._retry is None
            else self._retry.enqueue(self, x, deadline, priority, max_steps, out, sampling))
        if self._evictor is None:
            self._start_evictor()
        return Request(self, seg, slot, gen, deadline, timeout, outs,
                       sampled.k_of(seg, sampling))

    async def infer_async(self, x: Tensors, timeout: Optional[float] = 1.0, *,
                          priority: int = 0, max_steps: Optional[int] = None,
                          sampling: Optional[Sampling] = None) -> Tensors:
        """infer() for asyncio: awaits the answer without blocking the loop.
        Cancelled, it withdraws the request."""
        if sampled.asks_prompt(sampling):
            return await sampled.scored_async(self, x, timeout, priority, max_steps, sampling)
        if self._retry is not None:
            return await self._retry.infer_async(self, x, timeout, priority, max_steps, sampling)
        deadline = ticket.deadline_ns(timeout)
        seg, slot, gen, _ = self._enqueue(x, deadline, priority, max_steps, None, sampling)
        answer = await wakes.answer_of(self, seg, slot, gen, deadline, timeout)
        return sampled.cut(answer, sampled.k_of(seg, sampling))

    def stream(self, x: Tensors, timeout: Optional[float] = 1.0, *, priority: int = 0,
               max_steps: Optional[int] = None, sampling: Optional[Sampling] = None
               ) -> Iterator[Tensors]:
        """The answer to x chunk by chunk as the engine writes them, each a new
        array (iterative engines: one per step, at most max_steps; a one-shot
        engine's answer comes once). timeout bounds the whole answer. Leaving
        the loop early (break, close(), or dropping it) withdraws the request."""
        deadline = ticket.deadline_ns(timeout)
        seg = self._segment()
        if not seg.iterative:
            return streams.Answered(self.submit(x, timeout, priority=priority, sampling=sampling))
        seg, slot, gen, _ = self._enqueue(x, deadline, priority, max_steps, None, sampling)
        return streams.Stream(self, seg, slot, gen, deadline, timeout,
                              sampled.k_of(seg, sampling), sampled.prompt_ask(seg, sampling, x))

    async def stream_async(self, x: Tensors, timeout: Optional[float] = 1.0, *,
                           priority: int = 0, max_steps: Optional[int] = None,
                           sampling: Optional[Sampling] = None) -> AsyncIterator[Tensors]:
        """stream() for asyncio: ``async for chunk in client.stream_async(x)``;
        the loop is never blocked."""
        chunks = self.open_stream_async(x, timeout, priority=priority, max_steps=max_steps,
                                        sampling=sampling)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()

    def open_stream_async(self, x: Tensors, timeout: Optional[float] = 1.0, *,
                          priority: int = 0, max_steps: Optional[int] = None,
                          sampling: Optional[Sampling] = None
                          ) -> "async_streams.AsyncStream | async_streams.AsyncAnswered":
        """stream_async()'s stream as an object, enqueued now (in a running
        event loop): iterate it, read its finish_reason after its last chunk,
        and aclose() it when done with it (that withdraws it if unfinished)."""
        deadline = ticket.deadline_ns(timeout)
        seg = self._segment()
        if not seg.iterative:
            return async_streams.AsyncAnswered(self.infer_async(x, timeout, priority=priority,
                                                                sampling=sampling))
        seg, slot, gen, _ = self._enqueue(x, deadline, priority, max_steps, None, sampling)
        stream = streams.Stream(self, seg, slot, gen, deadline, timeout,
                                sampled.k_of(seg, sampling), sampled.prompt_ask(seg, sampling, x))
        return wakes.follow(self, stream)  # the loop's own wakes, or the completion thread's

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
        if not seg.config.lends_rows:
            raise InvalidInput(f"request() lends a row of a fixed input shape, got an engine "
                               f"of input {seg.config.input_spec()}")
        code, slot, gen = seg.ring.acquire(self.pid, self.start_ticks)
        if code == codes.EFULL:
            code, slot, gen = room.make_room(seg, self.pid, self.start_ticks, None)
        if code != codes.OK:
            raise EngineUnavailable(f"cannot enqueue on engine {self.name!r} (code {code})")
        return SlotRequest(self, seg, slot, gen)

    def infer_many(self, xs: np.ndarray, timeout: Optional[float] = 1.0, *, priority: int = 0,
                   max_steps: Optional[int] = None, sampling: Any = None) -> Any:
        """Sends xs[0], xs[1], ... as len(xs) requests at once and blocks until all
        are answered; returns the answers stacked, shape (n, *output_shape) (an iterative
        engine's listed, each as infer()'s; sampling=: one, or one per row: sampled.records).

        The requests are enqueued, waited for and released in bulk (one C call
        each), in chunks of at most half the queue_capacity, so one bulk call
        leaves room for other clients. QueueFull if not one slot is free when a
        chunk starts; on any error no answer of the call is returned.
        """
        return bulk.infer_many(self, xs, timeout, priority, max_steps, sampling)

    @property
    def retries_total(self) -> int:
        """How many retries this client sent (Client(retries=N))."""
        return 0 if self._retry is None else self._retry.retries_total

    def predicted_wait_s(self, priority: int = 0) -> float:
        """How long a request of this priority sent now would wait for its
        answer, as admission by deadline predicts it (the engine's fit of its
        batches' service time and the queue ahead; 0.0 before any batch was
        measured): a caller may send elsewhere rather than be refused."""
        seg = self._segment()
        return seg.ring.predicted_wait_ns(priority, ring.now_ns()) / 1e9

    def close(self) -> None:
        """Fails what is pending here with EngineUnavailable and detaches."""
        self._closed = True
        completer, self._completer = self._completer, None
        if completer is not None:
            completer.close()
        wakes.close_client(self)  # what its event loops await
        self.attached = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the request path ---------------------------------------------------
    def validated(self, x: Any, many: bool = False, priority: int = 0,
                  max_steps: Optional[int] = None, out: Any = None,
                  deadline: Optional[int] = None
                  ) -> Tuple[Segment, tuple, tuple, Optional[tuple]]:
        """(segment, arrays, real lengths, outs): the running engine's segment,
        and x (and priority, max_steps, out) checked against its spec before
        anything is enqueued; arrays and outs in spec order (outs None without out).
        EngineUnavailable at once while no batcher serves and none is expected
        to before the deadline (ticket.unserved): what is queued keeps its chance."""
        seg = self._segment()  # a forked child was rebound at the fork (register_at_fork)
        if seg.words2[UNSERVED_WORD]:  # a word read: no batcher serves, one restarts
            ticket.refuse_unserved(seg, deadline)
        try:
            arrays, lengths = (seg.config.check_many if many else seg.config.check_input)(x)
            if seg.iterative and (out is not None or max_steps is not None):
                _check_steps(seg.config, out, max_steps)
            outs = None if out is None else seg.config.check_out(out)
            if priority and not (type(priority) is int and 0 <= priority < seg.config.priority_levels):
                raise InvalidInput(f"priority: expected an int in [0, "
                                   f"{seg.config.priority_levels}), got {priority!r}")
        except EngineError:
            seg.ring.add_word(codes.W_INVALID)
            raise
        return seg, arrays, lengths, outs

    def _enqueue(self, x, deadline, priority=0, max_steps=None, out=None, sampling=None):
        """(segment, slot, generation, outs) of x enqueued."""
        seg, arrays, lengths, outs = self.validated(x, False, priority, max_steps, out, deadline)
        try:
            record, _ = sampled.record(seg, sampling, max_steps)
        except EngineError:
            seg.ring.add_word(codes.W_INVALID)
            raise
        r = seg.ring
        if priority:
            self._check_share(seg, priority)
        admit = deadline is not None and seg.admit_by_deadline
        # an iterative request's stream is opened between its write and its publish
        fused = seg.fused_in and arrays[0].flags.c_contiguous and not seg.iterative
        if fused:  # one C call: admit, take, copy, publish
            code, slot, gen = r.submit(self.pid, self.start_ticks, arrays[0], 0,
                                       deadline or 0, priority, admit)
            if code == codes.OK:  # the common case: enqueued
                return seg, slot, gen, outs
        else:
            code, slot = r.admit(priority, deadline) if admit else (codes.OK, 0)
            if code == codes.OK:
                code, slot, gen = r.acquire(self.pid, self.start_ticks)
        if code == codes.EOVERLOADED:  # then `slot` holds the predicted wait, in ms
            raise self._overloaded(deadline, slot)
        if code == codes.EFULL:
            code, slot, gen = room.make_room(seg, self.pid, self.start_ticks, deadline)
            fused = False
        if code == codes.OK and not fused:
            try:
                _write_rows(seg, slot, arrays, lengths)
                if record is not None:  # beside the inputs, read by the batcher at join
                    seg.records[slot] = record
                if seg.iterative:
                    r.stream_open(slot, gen, max_steps or 0)
            except BaseException:
                r.cancel(slot, gen)
                raise
            # the request's length, for length buckets: its longest input's
            code = r.publish(slot, gen, max(lengths), deadline or 0, priority)
        if code != codes.OK:
            raise EngineUnavailable(f"cannot enqueue on engine {self.name!r} (code {code}: the "
                                    f"engine reclaimed the request or refused it)")
        return seg, slot, gen, outs

    @staticmethod
    def _check_share(seg, priority: int) -> None:
        """QueueFull when the requests queued at `priority` or less urgent
        already fill its share (engine.client.shares)."""
        if not shares.room(seg, priority):
            raise shares.refused(seg, priority)

    @staticmethod
    def _overloaded(deadline: int, wait_ms: int) -> Overloaded:
        """The admission's refusal (already counted in overloaded_total), kept
        cheap: it is what an overloaded engine answers most."""
        return Overloaded.predicted(wait_ms, (deadline - ring.now_ns()) / 1e6)

    def _traced_infer(self, parent: Any, x: Any, timeout: Optional[float], priority: int,
                      max_steps: Optional[int], out: Any, sampling: Any = None) -> Any:
        """infer(x, ...) recorded under parent (tracing.context()'s), when a
        tracer provider is set: the wait leaves the answer (or the engine's
        error) in its slot, and settle then takes it with the engine's stamps.
        With retries=N the span covers every attempt, without stamps."""
        began = (parent, ring.now_ns())
        stamps, error = None, None
        try:
            if self._retry is not None:
                return self._retry.infer(self, x, timeout, priority, max_steps, out, sampling)
            deadline = ticket.deadline_ns(timeout)
            seg, slot, gen, outs = self._enqueue(x, deadline, priority, max_steps, out, sampling)
            ticket.await_answer(self, seg, slot, gen, deadline, timeout, outs, take=False,
                                leave_failed=True)
            _, answer, failure, stamps = ticket.settle(seg, slot, gen, outs, None, True)
            if failure is not None:
                raise failure
            return sampled.cut(answer, sampled.k_of(seg, sampling))
        except BaseException as e:
            error = e
            raise
        finally:
            tracing.record(began, self.name, stamps, error)

    def _start_evictor(self) -> None:
        with self._lock:
            if self._evictor is None:
                self._evictor = room.Evictor(self)
                self._evictor.start()

    def _segment(self) -> Segment:
        """The running engine's segment; attaches (lazy) or re-attaches (after
        a restart of the engine) when it can, EngineUnavailable while not."""
        seg = self.attached
        if seg is not None and seg.engine_state() == codes.ENGINE_RUNNING:
            now = ring.now_ns()
            if now - self._checked_ns < ticket.LIVENESS_SLICE_NS:
                return seg
            if seg.holder_alive():
                self._checked_ns = now
                return seg
        with self._lock:
            if self._closed:
                raise EngineUnavailable(f"client of {self.name!r} is closed")
            if self.attached is seg:  # no other thread attached meanwhile
                self.attached = attach(self.name, old=seg)
                self._checked_ns = ring.now_ns()
            return self.attached

    def completer(self) -> completion.Completer:
        """The completion thread, started on first use."""
        with self._lock:
            if self._completer is None:
                self._completer = completion.Completer(self)
                self._completer.start()
            return self._completer


def _write_rows(seg, slot: int, arrays: tuple, lengths: tuple) -> None:
    """A request's tensors into its slot's rows (the enqueue's copy when the
    one-call fused submit does not apply), with their real lengths; with a
    variable dim, the padding zeroed (so a batch needs no per-request fill)."""
    for t, (spec, region) in enumerate(zip(seg.config.input_specs, seg.in_regions)):
        row, array, var_axis = region[slot], arrays[t], spec.var_axis
        if var_axis is None:
            row[...] = array
        else:
            head = (slice(None),) * var_axis
            row[head + (slice(0, lengths[t]),)] = array
            row[head + (slice(lengths[t], None),)] = 0
            seg.lengths[slot, t] = lengths[t]


def _check_steps(cfg, outs, max_steps) -> None:
    """An iterative request's own max_steps, in [1, the engine's]; and no
    out (its answer's length is known only at its end)."""
    if outs is not None:
        raise InvalidInput("out: an iterative engine's answer has as many chunks as it takes; "
                           "expected out=None")
    if not (type(max_steps) is int and 1 <= max_steps <= cfg.max_steps):
        raise InvalidInput(f"max_steps: expected an int in [1, {cfg.max_steps}] (the engine's "
                           f"max_steps), got {max_steps!r}")


def _after_fork_in_child() -> None:
    # the parent's threads and locks do not exist here; its tickets stay its own
    for client in list(_clients):
        if isinstance(client, Client):
            client._bind_process()


os.register_at_fork(after_in_child=_after_fork_in_child)
