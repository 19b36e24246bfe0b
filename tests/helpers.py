"""Backends and client-process bodies the tests share (importable by batchers)."""
import os
import time

import numpy as np

from engine.shm import ring


def affine():
    """y = 2x + 1: every answer can be checked against its own request."""
    return lambda batch, lengths=None: batch * 2 + 1


def behind_gate(gate, inner, holds=None):
    """The backend `inner` behind `gate` (conftest.Gate): its first batch, or
    (with `holds`) every batch for which holds(batch) is true, first waits (at
    most 60 s) for the test to open the gate. The one gate wrapper of the tests."""
    import posix_ipc
    sem = posix_ipc.Semaphore(gate)
    opened = []

    def run(batch, *lengths):
        if holds is None:
            if not opened:
                opened.append(True)
                sem.acquire(60)  # BusyError after 60 s: this batch fails, and the test with it
                sem.close()
        elif holds(batch):
            sem.acquire(60)
        return inner(batch, *lengths)
    return run


def negative(batch) -> bool:
    """A batch holding a negative value: the ones a test marks to be held."""
    return bool((batch < 0).any())


def gated(gate, then="affine", **then_args):
    """The backend `then`, whose first batch first waits (at most 60 s) for
    the test to open `gate` (conftest.Gate): the requests sent meanwhile
    queue up, so they batch together on any machine."""
    return behind_gate(gate, globals()[then](**then_args))


def in_place_affine():
    """2x + 1 written over the batch itself, which is returned."""
    def run(batch, lengths=None):
        batch *= 2
        batch += 1
        return batch
    return run


def hangs_on_negative():
    """2x + 1, but a batch holding a negative value never returns (a hung model)."""
    def run(batch, lengths=None):
        while (batch < 0).any():
            ring.spin_ns(10_000_000)
        return batch * 2 + 1
    return run


def slow_affine(fixed_ms=50.0, dtype=None):
    def run(batch, lengths=None):
        ring.spin_ns(int(fixed_ms * 1e6))
        out = batch * 2 + 1
        return out if dtype is None else out.astype(dtype)
    return run


def pid_tagged(fixed_ms=5.0):
    """Answers with the batcher's pid in every element, after fixed_ms."""
    def run(batch, lengths=None):
        ring.spin_ns(int(fixed_ms * 1e6))
        return np.full(batch.shape, os.getpid(), dtype=np.float32)
    return run


def failing():
    """Raises on a batch that holds a negative value; else 2x + 1."""
    def run(batch, lengths=None):
        if (batch < 0).any():
            raise ValueError("negative input")
        return batch * 2 + 1
    return run


def wrong_count():
    return lambda batch, lengths=None: np.zeros((len(batch) + 1, *batch.shape[1:]), np.float32)


def wrong_shape():
    return lambda batch, lengths=None: np.zeros((len(batch), 3), np.float32)


def masked_sum():
    """Sums each request over its real length; fails if the padding is not zero."""
    def run(batch, lengths):
        for row, n in zip(batch, lengths):
            if row[n:].any():
                raise AssertionError("padding is not zero")
        return batch.sum(axis=1)
    return run


def lengths_seen():
    """Each request's answer is the real length its backend call was given."""
    return lambda batch, lengths: np.asarray(lengths, np.float32).reshape(-1, 1)


def exits_on_negative(dtype=None):
    """2x + 1 (as dtype, if given), but a batch holding a negative value kills
    its batcher (a model that segfaults on one input)."""
    def run(batch, lengths=None):
        if (batch < 0).any():
            os._exit(70)
        out = batch * 2 + 1
        return out if dtype is None else out.astype(dtype)
    return run


def holds_on_negative(gate, fixed_ms=100.0):
    """2x + 1 after fixed_ms; a batch holding a negative value first waits (at
    most 60 s) for the test to open `gate`: the batcher busy for as long as
    the test needs."""
    return behind_gate(gate, slow_affine(fixed_ms), holds=negative)


def starts_on_gate(gate, start_s: float = 0.0):
    """affine, whose factory first waits (at most 60 s) for the test to open
    `gate`, then takes start_s: the engine stays in its start for as long as
    the test needs, and its starts take at least start_s."""
    import posix_ipc
    sem = posix_ipc.Semaphore(gate)
    sem.acquire(60)
    sem.close()
    time.sleep(start_s)
    return affine()


def row_sum():
    """One scalar per request: the sum of its row."""
    return lambda batch, lengths=None: batch.sum(axis=1)


def thread_pools():
    """Answers every row with the OMP_NUM_THREADS its batcher started with (0: unset)."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "0"))
    return lambda batch, lengths=None: batch * 0 + threads
