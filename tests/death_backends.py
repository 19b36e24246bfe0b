"""Backends for the tests of batcher deaths (importable by batchers)."""
import numpy as np


class Fatal(BaseException):
    """Not an Exception: a batcher does not catch it, so its loop ends (as an
    interpreter's own fatal errors end it)."""


def fatal_on_negative():
    """2x + 1, but a batch holding a negative value raises Fatal."""
    def run(batch, lengths=None):
        if (batch < 0).any():
            raise Fatal("the model gave up")
        return batch * 2 + 1
    return run


def gated_starts(start_gate, hold_gate=None):
    """2x + 1 as float64 (not answered in place: a dead batcher's batch is
    kept for its successor). Each batcher's factory first waits (at most 60
    s) for the test to open start_gate, so a successor is ready only when the
    test says; with hold_gate, a batch holding a negative value waits for it
    (at most 60 s): claimed until the test kills its batcher."""
    import posix_ipc
    start = posix_ipc.Semaphore(start_gate)
    start.acquire(60)
    start.close()
    hold = posix_ipc.Semaphore(hold_gate) if hold_gate else None

    def run(batch, lengths=None):
        if hold is not None and (batch < 0).any():
            hold.acquire(60)
        return (batch * 2 + 1).astype(np.float64)
    return run
