"""How a client waits for its requests: one loop, and one translation of ring
codes into errors, shared by infer(), infer_many(), Futures and the
completion thread.

A wait runs in slices of at most LIVENESS_SLICE_NS, so that an engine that
died meanwhile is noticed; it ends when the ticket is answered, when the
request's deadline passes, when the engine is found gone, or when the
caller's own patience (`until_ns`, a Future's result(timeout)) runs out.
Giving up on a request abandons it with a CAS on its ticket, so that a late
answer can never reach a newer request that reuses the slot.
"""
from typing import Callable, Optional

from engine.client import deaths
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


# -- errors ------------------------------------------------------------------------

def timed_out(timeout, count: int = 1) -> RequestTimeout:
    if count == 1:
        return RequestTimeout(f"expected an answer within {timeout} s, got none (request abandoned)")
    return RequestTimeout(f"expected {count} answers within {timeout} s, got fewer "
                          f"(requests abandoned)")


def ticket_timed_out(seg, slot: int, gen: int, timeout: Optional[float],
                     deadline: Optional[int]) -> RequestTimeout:
    """timed_out(timeout) for ticket (slot, gen), read before it is abandoned:
    it also says so when the batcher that held the request died (deaths)."""
    error = timed_out(timeout)
    if seg.closed:
        return error
    enqueued_ns = None if deadline is None or timeout is None else deadline - int(timeout * 1e9)
    why = deaths.why_unanswered(seg, slot, gen, enqueued_ns)
    return error if why is None else RequestTimeout(f"{error}: {why}")


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
