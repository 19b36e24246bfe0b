"""Whether a request that timed out was held by a batcher that died: read on
the timeout path only, never on the way to an answer.

The segment says it without asking the supervisor. A CLAIMED slot's control
word names its batcher b (ring.h's drawing: the field just under the owner
pid); the header's words name b's process (pid and start time). The
supervisor zeroes b's pid word when it reaps a dead batcher, and b's
successor writes its own once its model is loaded, then retries the dead
one's batch (kept CLAIMED under b) first. So, at the timeout:

- b's pid word is 0: b died holding the request, its successor not ready;
- b's process is gone (pid and start time, engine.shm.liveness): b died and
  the supervisor has not reaped it yet;
- b's process started after the request was enqueued, and the engine has
  restarted a batcher: b was replaced while the request waited.
"""
import os
import time
from typing import Optional

import numpy as np

from engine.shm import codes, liveness

GEN_SHIFT = 32  # the control word's generation: its high half

# a process's start time has the kernel's clock-tick resolution: a start
# within one tick of the enqueue is not called later than it
TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def holder(seg, slot: int, gen: int) -> Optional[int]:
    """The batcher that holds ticket (slot, gen) now, or None when no batcher
    does (queued, answered, or no longer the ticket's)."""
    ctl, owner_start = np.zeros(slot + 1, np.uint64), np.zeros(slot + 1, np.uint64)
    if seg.ring.snapshot(ctl, owner_start) <= slot:
        return None
    word = int(ctl[slot])
    if word >> GEN_SHIFT != gen or word & codes.STATE_MASK not in (codes.CLAIMED,
                                                                   codes.ABANDONED):
        return None
    return (word >> codes.BATCHER_SHIFT) & codes.BATCHER_MASK


def started_ns(ticks: int) -> int:
    """A process's start time (clock ticks since boot, /proc/PID/stat) on
    CLOCK_MONOTONIC, ring.now_ns()'s clock."""
    boot_ns = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.clock_gettime_ns(
        time.CLOCK_MONOTONIC)
    return ticks * TICK_NS - boot_ns


def why_unanswered(seg, slot: int, gen: int, enqueued_ns: Optional[int]) -> Optional[str]:
    """Why ticket (slot, gen), enqueued at enqueued_ns (None: unknown), has no
    answer, when its batcher died; None when nothing says so."""
    b = holder(seg, slot, gen)
    if b is None:
        return None
    words = seg.words
    pid, ticks = int(words[codes.W_BATCHER_PID + b]), int(words[codes.W_BATCHER_START + b])
    if pid == 0:
        return (f"its batcher {b} died while serving it, and no successor was ready before "
                f"the deadline")
    if not liveness.is_alive(pid, ticks):
        return f"its batcher {b} (pid {pid}) died while serving it"
    if (enqueued_ns is not None and words[codes.W_RESTARTS]
            and started_ns(ticks) > enqueued_ns + TICK_NS):
        return (f"its batcher {b} died while it waited; its successor (pid {pid}) had not "
                f"answered it by the deadline")
    return None
