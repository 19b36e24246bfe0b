"""A ticket's answer: wait for it, take it, or give it up.

A request is a ticket (slot, generation) in the engine's ring, and every way
a client gets its answer goes through here: infer() waits in the calling
thread (await_answer), a submit() Future waits when asked (wait_over) and
takes its answer (settle), infer_async() awaits it through the completion
thread (answer_of, Awaited), streams and infer_many() use the same waits,
errors and give-ups. A caller enters this module once per visit: each entry
point does the whole of its part (wait, take, translate a code into an
error, give up) inside it.

Waiting: a wait runs in slices of at most LIVENESS_SLICE_NS, so that an
engine that died meanwhile is noticed; it ends when the ticket is answered,
when the request's deadline passes, when the engine is found gone, or when
the caller's own patience (`until`, a Future's result(timeout)) runs out.

Taking: an engine of one output takes an answer in one C call (sb_take: copy
the row out, stamp the request's times, free the slot); one of several
outputs waits for the answer, copies each output's row, then frees the
slot. Inside the engine an answer is its outputs in spec order; the caller
gets the engine's form (config.answer): one array, or a dict of named arrays.

Giving up abandons the request with a CAS on its ticket, so that a late
answer can never reach a newer request that reuses the slot.
"""
import asyncio
import concurrent.futures
import functools
import sys
from typing import Any, Callable, Optional

import numpy as np

from engine.client import deaths, loops, tracing
from engine.client.handle import ANSWER, Completion, Handle
from engine.client.tracing import TRACE_MODULE
from engine.errors import (
    BackendError,
    EngineCorrupt,
    EngineError,
    EngineUnavailable,
    RequestTimeout,
)
from engine.shm import codes, ring

# How often a waiting client checks that the engine still lives (its lock).
LIVENESS_SLICE_NS = 100_000_000

# why a wait ended
ANSWERED, EXPIRED, GONE, WAITED = "answered", "expired", "gone", "waited"


def deadline_ns(timeout: Optional[float]) -> Optional[int]:
    """The request's deadline on ring.now_ns()'s clock (None: none)."""
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0 or None, got {timeout}")
    return ring.now_ns() + int(timeout * 1e9)


def engine_lives(seg) -> bool:
    return seg.engine_state() != codes.ENGINE_STOPPED and seg.holder_alive()


def wait(wait_slice: Callable[[int], int], lives: Callable[[], bool],
         deadline: Optional[int], until: Optional[int] = None):
    """Calls wait_slice(slice_ns) -- a C wait returning a ring code -- until it
    returns anything but ETIMEOUT; returns (why, code)."""
    while True:
        now = ring.now_ns()
        if deadline is not None and now >= deadline:
            return EXPIRED, codes.ETIMEOUT
        if until is not None and now >= until:
            return WAITED, codes.ETIMEOUT
        slice_ns = LIVENESS_SLICE_NS
        for t in (deadline, until):
            if t is not None and t - now < slice_ns:
                slice_ns = t - now
        code = wait_slice(slice_ns)
        if code != codes.ETIMEOUT:
            return ANSWERED, code
        if slice_ns == LIVENESS_SLICE_NS and not lives():
            return GONE, code


# -- waiting in the caller's thread -------------------------------------------------

def await_answer(client: Handle, seg, slot: int, gen: int, deadline: Optional[int],
                 timeout: Optional[float], outs: Optional[tuple] = None,
                 take: bool = True, leave_failed: bool = False) -> Any:
    """Waits for the ticket's answer and, with take, copies it out (into
    outs' arrays or new ones), frees the slot and returns it in the caller's
    form; without, leaves it in the slot and returns None (with
    leave_failed, a failed request's error too: settle() takes either).
    Errors free the slot and raise."""
    r = seg.ring
    into = None  # an array: the fused take copies the answer there and frees the slot
    if take and seg.fused_out:
        into = np.empty(seg.out_shape, seg.out_dtype) if outs is None else outs[0]
    # the common case, answered within the first slice, without the wait loop
    # (and without a closure made per request: partials on the slow path only)
    slice_ns = LIVENESS_SLICE_NS
    if deadline is not None:
        left_ns = deadline - ring.now_ns()
        if left_ns < slice_ns:
            slice_ns = left_ns
    code = _wait_slice(client, r, slot, gen, into, slice_ns) if slice_ns > 0 else codes.ETIMEOUT
    if code == codes.ETIMEOUT:
        wait_slice = functools.partial(_wait_slice, client, r, slot, gen, into)
        why, code = wait(wait_slice, functools.partial(engine_lives, seg), deadline)
        if why != ANSWERED:
            error = expired(seg, slot, gen, timeout, deadline) if why == EXPIRED \
                else engine_gone(client.name)
            if give_up(seg, slot, gen, error) is not None:
                raise error
            code = wait_slice(0)  # answered at the last instant: take it
    if code != codes.OK and not (leave_failed and code == codes.EFAILED):
        raise failed(seg, slot, gen, code)
    if not take:
        return None
    # answered: the wait above saw it (several outputs: copied one by one)
    return seg.config.answer((into,) if into is not None else read(seg, slot, gen, outs))


def _wait_slice(client: Handle, r, slot: int, gen: int, into, slice_ns: int) -> int:
    """One C wait of at most slice_ns for the ticket; with into (an array),
    on OK its answer is copied there and the slot freed in the same call.
    Spins first only if the last wait ended within ring.SPIN_NS: a fast
    backend's answer then costs no kernel wake-up, and after a longer wait
    the next one sleeps at once, so a slow backend's clients burn no CPU."""
    started_ns = ring.now_ns()
    if into is not None:
        code = r.take(slot, gen, slice_ns, client.spin_ns, into)
    else:
        code = r.wait_slot(slot, gen, slice_ns, client.spin_ns)
    spin_ns = ring.SPIN_NS
    client.spin_ns = spin_ns if ring.now_ns() - started_ns <= spin_ns else 0
    return code


def wait_over(client: Handle, seg, slot: int, gen: int, deadline: Optional[int],
              timeout: Optional[float], until: Optional[int]):
    """Waits, until `until` at most (None: as long as the request lives), for
    the ticket to be over, its answer left in the slot: (True, None) answered
    (or no longer ours), (True, error) past its deadline or its engine or
    client gone; (False, None) when `until` came first."""
    why, _ = wait(lambda slice_ns: seg.ring.wait_slot(slot, gen, slice_ns, client.spin_ns),
                  lambda: client.attached is not None and engine_lives(seg), deadline, until)
    if why == ANSWERED:
        return True, None
    if why == EXPIRED:
        return True, expired(seg, slot, gen, timeout, deadline)
    if why == GONE:
        return True, (client_closed(client.name) if client.attached is None
                      else engine_gone(client.name))
    return False, None


# -- taking ---------------------------------------------------------------------------

def take(seg, slot: int, gen: int, outs: Optional[tuple], stamped: bool = False):
    """(code, stamps, outputs) of one take that does not wait: answered, its
    outputs (into outs' arrays, or new ones) and the request's stamps
    (arrival_ns, claim_ns, done_ns, batch_size: ring.take_timed's) with one
    output, or with several when stamped (one more C call); else the code
    (ETIMEOUT: not yet; EFAILED: the slot is left to failed())."""
    if seg.fused_out:
        into = outs[0] if outs is not None else np.empty(seg.out_shape, seg.out_dtype)
        code, stamps = seg.ring.take_timed(slot, gen, into)
        return code, stamps, (into,)
    code = seg.ring.wait_slot(slot, gen, 0, 0)
    if code != codes.OK:
        return code, None, None
    stamps = seg.ring.slot_times(slot, gen) if stamped else None  # before read() frees it
    return code, stamps, read(seg, slot, gen, outs)


def read(seg, slot: int, gen: int, outs: Optional[tuple]) -> tuple:
    """An answered ticket's outputs, copied into outs' arrays (or new ones);
    the slot freed."""
    if seg.iterative:  # an iterative engine's: the chunks its batcher wrote
        steps = chunk_count(seg, slot, gen)
        outs = tuple(region[slot, :steps].copy() for region in seg.out_regions)
    elif outs is None:
        outs = tuple(region[slot].copy() for region in seg.out_regions)
    else:
        for out, region in zip(outs, seg.out_regions):
            np.copyto(out, region[slot])
    seg.ring.release_slot(slot, gen)
    return outs


def chunk_count(seg, slot: int, gen: int) -> int:
    """How many chunks a settled iterative request's batcher wrote (checked
    in C against the engine's max_steps; EngineCorrupt beyond it)."""
    code, word = seg.ring.wait_chunks(slot, gen, codes.CHUNKS_COUNT, 0)
    if code != codes.OK:
        seg.ring.release_slot(slot, gen)  # settled (the caller saw it): ours to free
        raise EngineCorrupt(f"engine {seg.name!r}: expected the request's chunk count within "
                            f"max_steps {seg.steps}, got one beyond it (code {code})")
    return word & codes.CHUNKS_COUNT


def settle(seg, slot: int, gen: int, outs: Optional[tuple],
           error: Optional[EngineError] = None, stamped: bool = False):
    """A ticket's outcome without waiting: (settled, answer, error, stamps).
    Answered: its answer, in the caller's form, with the request's stamps
    (take's); failed in the engine: its error, with its stamps when stamped.
    Not answered: with error, the request abandoned and error returned
    (unless it was answered that instant); without, (False, None, None,
    None)."""
    code, stamps, outputs = take(seg, slot, gen, outs, stamped)
    if code == codes.ETIMEOUT:
        if error is None:
            return False, None, None, None
        if give_up(seg, slot, gen, error) is not None:
            return True, None, error, None
        code, stamps, outputs = take(seg, slot, gen, outs, stamped)
    if code == codes.OK:
        return True, seg.config.answer(outputs), None, stamps
    if stamped and code == codes.EFAILED:  # read before failed() frees the slot
        stamps = seg.ring.slot_times(slot, gen)
    return True, None, failed(seg, slot, gen, code), stamps


# -- awaiting in asyncio, through the completion thread --------------------------------

class Awaited:
    """An infer_async() request, settled into an asyncio future through its
    loop's Inbox: to the completer, an item of kind ANSWER."""
    __slots__ = ("seg", "slot", "gen", "deadline", "timeout", "future", "inbox", "began")
    kind = ANSWER

    def __init__(self, seg, slot: int, gen: int, deadline: Optional[int],
                 timeout: Optional[float], future, inbox: Any,
                 began: Optional[tracing.Began]) -> None:
        self.seg, self.slot, self.gen = seg, slot, gen
        self.deadline, self.timeout = deadline, timeout
        self.future, self.inbox = future, inbox
        self.began = began  # made in the caller's task: its context

    def try_settle(self, error: Optional[EngineError] = None) -> bool:
        settled, value, failure, stamps = settle(self.seg, self.slot, self.gen, None, error,
                                                 self.began is not None)
        if settled:  # a closed loop wants nothing
            self.inbox.post(loops.resolve, (self.future, value, failure))
            if self.began is not None:
                # withdrawn by its cancelled task: no answer (or an unwanted one) came
                why = concurrent.futures.CancelledError() if self.future.cancelled() else failure
                tracing.record(self.began, self.seg.name, stamps, why)
        return settled


async def answer_of(completer: Completion, seg, slot: int, gen: int, deadline: Optional[int],
                    timeout: Optional[float], inbox: Any = None) -> Any:
    """The answer of an enqueued request, awaited: at once if its engine
    answered already (publishing woke its batcher), else through an Awaited
    that completer settles (the completion thread, posting to the loop's
    Inbox, or the loop's own wakes.Waker with its inbox). Cancelled, the
    request is withdrawn."""
    # its span's context: the caller's task's, here
    began = tracing.begin() if TRACE_MODULE in sys.modules else None
    settled, value, error, stamps = settle(seg, slot, gen, None, None, began is not None)
    if settled:
        if began is not None:
            tracing.record(began, seg.name, stamps, error)
        if error is not None:
            raise error
        return value
    loop = asyncio.get_running_loop()
    future: "asyncio.Future[Any]" = loop.create_future()
    completer.add(Awaited(seg, slot, gen, deadline, timeout, future, inbox or loops.inbox(loop),
                          began))
    try:
        return await future
    except asyncio.CancelledError:
        withdraw(seg, slot, gen)  # answered meanwhile: its slot freed
        raise


# -- giving up --------------------------------------------------------------------------

def withdraw(seg, slot: int, gen: int, release: bool = True) -> int:
    """Withdraws a sent request its caller no longer wants (not a timeout:
    give_up's); with release, an answer that came meanwhile is released.
    Returns abandon's code: OK when withdrawn (and counted), EBUSY when it
    was answered."""
    r = seg.ring
    code = r.abandon(slot, gen)
    if code == codes.OK:
        r.add_word(codes.W_WITHDRAWN)
    elif code == codes.EBUSY and release:
        r.release_slot(slot, gen)
    return code


def give_up(seg, slot: int, gen: int, error: EngineError) -> Optional[EngineError]:
    """Abandons the ticket; returns error, or None when it was answered that
    instant (then its answer is the caller's to take). A timeout is counted."""
    if seg.ring.abandon(slot, gen) == codes.EBUSY:
        return None
    if isinstance(error, RequestTimeout):
        seg.ring.add_word(codes.W_TIMEOUTS)
    return error


# -- the errors of a ticket that has no answer ---------------------------------------

def timed_out(timeout, count: int = 1) -> RequestTimeout:
    if count == 1:
        return RequestTimeout(f"expected an answer within {timeout} s, got none (request abandoned)")
    return RequestTimeout(f"expected {count} answers within {timeout} s, got fewer "
                          f"(requests abandoned)")


def expired(seg, slot: int, gen: int, timeout: Optional[float],
            deadline: Optional[int]) -> RequestTimeout:
    """timed_out(timeout) for ticket (slot, gen), read before it is abandoned:
    it also says so when the batcher that held the request died (deaths)."""
    error = timed_out(timeout)
    if seg.closed:
        return error
    enqueued_ns = None if deadline is None or timeout is None else deadline - int(timeout * 1e9)
    why = deaths.why_unanswered(seg, slot, gen, enqueued_ns)
    return error if why is None else RequestTimeout(f"{error}: {why}")


def refuse_unserved(seg, deadline: Optional[int]) -> None:
    """EngineUnavailable when no batcher serves (the supervisor restarts one)
    and none is expected to before deadline (None: none): a request sent now
    would wait out its timeout. Once that time has passed, the request is
    queued: the supervisor moves the time on while the start goes on."""
    until_ns, now_ns = seg.unserved_until_ns(), ring.now_ns()
    if not until_ns or deadline is None or deadline >= until_ns or now_ns >= until_ns:
        return
    raise EngineUnavailable(
        f"engine {seg.name!r} has no live batcher: its successor is expected to serve in "
        f"{(until_ns - now_ns) / 1e9:.2f} s, after this request's deadline "
        f"({max(0, deadline - now_ns) / 1e9:.2f} s); retry later")


def engine_gone(name: str) -> EngineUnavailable:
    return EngineUnavailable(f"engine {name!r} stopped or died while the request waited")


def client_closed(name: str) -> EngineUnavailable:
    return EngineUnavailable(f"client of {name!r} is closed")


def backend_error(status: int, text: str) -> EngineError:
    if status == codes.STATUS_BATCHER_DIED:
        return BackendError("BatcherDied", text)
    if status == codes.STATUS_BACKEND:
        exc_type, _, message = text.partition(": ")
        return BackendError(exc_type, message)
    if status == codes.STATUS_CORRUPT:
        return EngineCorrupt(f"the request failed unstarted: {text}")
    return EngineCorrupt(f"expected a failed request's status in 1..{codes.STATUS_CORRUPT}, "
                         f"got {status} (its slot was written by another process)")


def failed(seg, slot: int, gen: int, code: int) -> EngineError:
    """The error of a ticket whose wait ended with code (neither OK nor
    ETIMEOUT); a FAILED slot's error is read and the slot released."""
    if code == codes.EFAILED:
        status, text = seg.ring.slot_error(slot)
        seg.ring.release_slot(slot, gen)
        if status == codes.STATUS_EXPIRED:
            error = RequestTimeout(f"expected an answer before the request's deadline, got "
                                   f"none: {text}")
            # not computed (a stream's: past its deadline): Client(retries=N) may
            # send it again while its deadline allows
            error.unstarted = True  # type: ignore[attr-defined]
            return error
        return backend_error(status, text)
    if code == codes.ECORRUPT:
        return EngineCorrupt(f"engine {seg.name!r}: expected the request's slot in a state of "
                             f"the ring, got a control word no engine process writes")
    return EngineUnavailable(f"engine {seg.name!r} reclaimed the request (code {code})")
