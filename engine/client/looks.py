"""An asyncio caller's first look at its answer, before its loop awaits it.

An answer already in its slot, or one that comes within a short spin, is
taken in one C call (answered), and the request then costs the loop no
future, Waker item or wake. The look is a hint's bet: how long it spins, and
when it does at all, is this module's rule, read by wakes.answer_of.
"""
import sys
from typing import Any

import numpy as np

from engine.client.handle import Handle
from engine.client.ticket import failed
from engine.client.tracing import TRACE_MODULE
from engine.shm import codes, ring

# An asyncio caller's first look at its answer spins this long at most: a
# batcher that is awake answers within it, and the request then costs the loop
# no future, item or wake (bench/RESULTS.md, async_wake). After a look that
# found nothing the next ones do not spin, until an answer comes within
# ASYNC_SOON_NS of a look again (wakes.answer_of): a slow or sleeping batcher
# costs a loop no look; none on a single CPU (a look that does not spin
# comes before the batcher could answer).
ASYNC_SPIN_NS = min(2_000, ring.SPIN_NS)
ASYNC_SOON_NS = 4 * ASYNC_SPIN_NS
# A lone caller looks up to ASYNC_LONE_SPIN_NS: nothing else of its loop awaits
# an engine, the loop handed out no answer within LOOP_BUSY_NS (a busy loop's
# time is its other tasks', and a caller in a tight loop would never yield it)
# and no batcher of the engine sleeps (lone_look_pays). There a miss costs the
# loop a sleep and a wake, tens of µs of CPU on a VM, more than the spin
# (bench/RESULTS.md, http_worker_cpu); a model slower than the look backs the
# lone looks off (LoneLooks).
ASYNC_LONE_SPIN_NS = min(20_000, ring.SPIN_NS)
LOOP_BUSY_NS = 50_000
LONE_BACKOFF_MAX = 64
NOT_YET = object()  # answered()'s: no outcome in the slot yet


class LoneLooks:
    """A client's lone looks, backed off after misses: a miss skips the next
    `backoff` chances of one and doubles it, up to LONE_BACKOFF_MAX; a find
    resets it. A model slower than the look then costs a lone caller one
    look in LONE_BACKOFF_MAX; one that answers within it, no skip at all."""
    __slots__ = ("skip", "backoff")

    def __init__(self) -> None:
        self.skip, self.backoff = 0, 1

    def due(self) -> bool:
        """Whether this chance looks (else it is one of those skipped)."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def found(self, hit: bool) -> None:
        if hit:
            self.backoff = 1
        else:
            self.skip, self.backoff = self.backoff, min(2 * self.backoff, LONE_BACKOFF_MAX)


def alone(client: Handle, seg, others_pending: bool, last_answer_ns: int) -> bool:
    """Whether this look is a lone caller's (ASYNC_LONE_SPIN_NS): looks spin on
    this machine, nothing else of the loop awaits an engine (others_pending),
    the loop handed out its last answer (at last_answer_ns) over LOOP_BUSY_NS
    ago, no batcher of seg sleeps, and the back-off takes this chance."""
    return bool(ASYNC_LONE_SPIN_NS) and not others_pending and \
        ring.now_ns() - last_answer_ns > LOOP_BUSY_NS and lone_look_pays(seg) and \
        client.lone_looks.due()


def lone_look_pays(seg) -> bool:
    """Whether a lone caller's look may find its answer: no batcher of seg is
    asleep (a hint). A sleeping batcher's wake-up takes longer than the
    spin, and the spinning caller may hold the CPU it needs (bench/RESULTS.md)."""
    return not seg.ring.batchers_sleeping()


def answered(client: Handle, seg, slot: int, gen: int, lone: bool = False) -> Any:
    """The answer in the slot, taken in one C call after a spin of at most
    client.async_spin_ns (ASYNC_LONE_SPIN_NS for a lone caller, its outcome
    told to client.lone_looks), for the engine's one output with no span to
    record; NOT_YET when none came or the request is not of that common kind
    (the looks then stop until an answer comes soon again); a failure raised."""
    if not seg.fused_out or TRACE_MODULE in sys.modules:
        return NOT_YET
    into = np.empty(seg.out_shape, seg.out_dtype)
    spin_ns = ASYNC_LONE_SPIN_NS if lone else client.async_spin_ns
    # the timeout is the spin: it ends there, never sleeping
    code = seg.ring.take(slot, gen, spin_ns, spin_ns, into)
    if lone:
        client.lone_looks.found(code != codes.ETIMEOUT)
    if code == codes.OK:
        return seg.config.answer((into,))
    if code == codes.ETIMEOUT:
        client.async_spin_ns = 0  # a shorter look would have missed as well
        return NOT_YET
    raise failed(seg, slot, gen, code)
