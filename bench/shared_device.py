"""A model that holds one device: the cost model of an accelerator every copy on the node shares.

    load(lock_path, fixed_ms=2.0, per_item_us=50.0, weights_mib=256, mode="hold")

Each copy (each process that calls load) allocates its own weights (weights_mib of float64,
every page written, so that they count in its resident and proportional set). A batch of n rows
costs the node's one device fixed_ms + n * per_item_us, one copy at a time, under an exclusive
flock on lock_path that every copy shares:
- mode "hold": the copy holds the flock for the batch's whole cost, sleeping. The device is idle
  from the moment the cost has passed until the holder's thread wakes and the next one's has
  woken: on a saturated host that handoff is charged to the device (hold_ms above the cost).
- mode "queue": the flock guards the device's timeline (when it is next free, in the file): a
  batch starts when the device is free, the copy books it, lets go, and sleeps until its end,
  as an accelerator runs the next process's queued work while the host is still waking.
Both sleep rather than busy-wait: a host thread waiting on its accelerator leaves its core to
other work, and on a 2-core machine a spin would turn the device's time into CPU time the
serving stack competes for (what the earlier busy-wait model measured). The answer is
batch * 2 + 1.

The lock file counts what the device did (busy ns, batches, rows; and the timeline's end),
written under the lock: read_counters() gives the first three to whoever measures.
"""
import fcntl
import os
import struct
import time
from typing import Tuple

import numpy as np

COUNTERS = struct.Struct("<QQQQ")  # busy_ns, batches, rows, free_at_ns (time.monotonic_ns)
MODES = ("hold", "queue")
SLEEP_SLACK_NS = 100_000  # a sleep ends up to this late: the rest of a hold is slept in steps


def create(lock_path: str) -> None:
    """The device's lock file, its counters at zero."""
    with open(lock_path, "wb") as f:
        f.write(COUNTERS.pack(0, 0, 0, 0))


def read_counters(lock_path: str) -> Tuple[int, int, int]:
    """(busy ns, batches, rows) so far, read under the lock."""
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return COUNTERS.unpack(os.pread(fd, COUNTERS.size, 0))[:3]
    finally:
        os.close(fd)  # releases the lock


def _hold_until(deadline_ns: int) -> None:
    while True:
        left_ns = deadline_ns - time.monotonic_ns()
        if left_ns <= 0:
            return
        time.sleep(max(left_ns - SLEEP_SLACK_NS, left_ns // 2, 20_000) / 1e9)


def load(lock_path: str, fixed_ms: float = 2.0, per_item_us: float = 50.0,
         weights_mib: int = 256, mode: str = "hold"):
    if mode not in MODES:
        raise ValueError(f"expected mode in {MODES}, got {mode!r}")
    fixed_ns, per_item_ns = int(fixed_ms * 1e6), int(per_item_us * 1e3)
    weights = np.ones(weights_mib * 2**20 // 8, np.float64)  # ones: every page written
    fd = os.open(lock_path, os.O_RDWR)  # this copy's own open file: flock excludes the others

    def run(batch, lengths=None):
        n = len(batch)
        cost_ns = fixed_ns + n * per_item_ns
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            busy, batches, rows, free_at = COUNTERS.unpack(os.pread(fd, COUNTERS.size, 0))
            if mode == "hold":
                t0 = time.monotonic_ns()
                _hold_until(t0 + cost_ns)
                end, busy = time.monotonic_ns(), busy + time.monotonic_ns() - t0
            else:
                end, busy = max(time.monotonic_ns(), free_at) + cost_ns, busy + cost_ns
            os.pwrite(fd, COUNTERS.pack(busy, batches + 1, rows + n, end), 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        _hold_until(end)  # at once in mode hold
        return batch * 2 + 1

    run.weights = weights  # held as long as the model is
    return run
