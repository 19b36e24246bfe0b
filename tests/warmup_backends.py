"""Backends of tests/test_warmup.py and bench/warmup_first_request.py
(importable by batchers): models whose first call in each process is slow,
as a model that initialises lazily is, and that log every call.

Each call is one line of JSON appended to the file `log` with one write
(O_APPEND: batcher processes share the file): the process, the call's start
and end (time.monotonic(), one clock for every process of the host), whether
it was the process's slow first call, what it was called with (rows, each
input's shape, its variable dim's lengths, whether all were zeros).
"""
import json
import os
import time

import numpy as np


def _log(path, **entry) -> None:
    if path:
        line = json.dumps({"pid": os.getpid(), **entry}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def read_log(path) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f]
    except FileNotFoundError:
        return []


class _FirstSlow:
    """Sleeps first_s in this process's first call (of any method)."""

    def __init__(self, log, first_s):
        self.log, self.first_s, self.calls = log, first_s, 0

    def enter(self):
        start = time.monotonic()
        slow = self.calls == 0
        self.calls += 1
        if slow and self.first_s:
            time.sleep(self.first_s)
        return start, slow

    def record(self, start, slow, **entry):
        _log(self.log, start=start, end=time.monotonic(), slow=slow, **entry)


def first_slow(log=None, first_s=1.0, bias=1.0, raise_at=None):
    """y = x + bias (rows of any shape; with lengths, y = sum of each row's
    first `length` elements + length + bias, one float per row). Raises at
    batch size raise_at (a model with no kernel for it), with a message of
    two lines."""
    state = _FirstSlow(log, first_s)

    def run(batch, lengths=None):
        start, slow = state.enter()
        state.record(start, slow, rows=len(batch), shape=list(batch.shape),
                     lengths=None if lengths is None else lengths.tolist(),
                     zeros=not batch.any())
        if raise_at is not None and len(batch) == raise_at:
            raise RuntimeError("no kernel for this batch size\n(compiled for others)")
        if lengths is None:
            return batch + np.float32(bias)
        mask = np.arange(batch.shape[1]) < lengths[:, None]
        return ((batch * mask).sum(axis=1, keepdims=True) + lengths[:, None]
                + bias).astype(np.float32)
    return run


def named_first_slow(log=None, first_s=1.0):
    """Named tensors {"a": float32 (3,), "ids": int64 (None,)} -> {"y": float32
    (3,)}: y = a + the sum of ids' first `length` elements."""
    state = _FirstSlow(log, first_s)

    def run(batch, lengths=None):
        start, slow = state.enter()
        state.record(start, slow, rows=len(batch["a"]),
                     shape={k: list(v.shape) for k, v in batch.items()},
                     lengths=None if lengths is None else {k: v.tolist()
                                                           for k, v in lengths.items()},
                     zeros=not any(v.any() for v in batch.values()))
        ids, n = batch["ids"], lengths["ids"]
        total = (ids * (np.arange(ids.shape[1]) < n[:, None])).sum(axis=1)
        return {"y": (batch["a"] + total[:, None]).astype(np.float32)}
    return run


class Counter:
    """A step model: a prompt x (int64[None]) of length L answers
    sum(x[:L]) + k at step k, done after `steps` steps. Logs every join, step
    and leave (method, ids, shape, lengths, zeros)."""

    def __init__(self, log=None, first_s=1.0, steps=3):
        self.state, self.steps, self.running = _FirstSlow(log, first_s), steps, {}

    def join(self, ids, batch, lengths=None):
        start, slow = self.state.enter()
        n = lengths if lengths is not None else np.full(len(ids), batch.shape[1])
        for i, row, length in zip(ids.tolist(), batch, n):
            self.running[i] = [int(row[:length].sum()), 0]
        self.state.record(start, slow, method="join", ids=ids.tolist(), shape=list(batch.shape),
                          lengths=None if lengths is None else lengths.tolist(),
                          zeros=not batch.any())

    def step(self, ids):
        start, slow = self.state.enter()
        out, done = np.zeros(len(ids), np.int64), np.zeros(len(ids), bool)
        for j, i in enumerate(ids.tolist()):
            base, k = self.running[i]
            out[j], done[j] = base + k, k + 1 >= self.steps
            self.running[i][1] = k + 1
        self.state.record(start, slow, method="step", ids=ids.tolist())
        return out, done

    def leave(self, ids):
        start, slow = self.state.enter()
        for i in ids.tolist():
            del self.running[i]
        self.state.record(start, slow, method="leave", ids=ids.tolist())


def counter(log=None, first_s=1.0, steps=3):
    return Counter(log, first_s, steps)
