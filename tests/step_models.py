"""Step models of tests/test_iterative_*.py (importable by batchers): answers that
can be checked exactly, and knobs that fail, hold or kill on marked inputs.

A request is int64[4]: (tag, length, mark, arg). Its chunk k is
version * VERSION + tag * TAG + k (an int64 scalar), and step says it is
done after `length` chunks. A mark does something to the step that would
write its chunk `arg`, or to its join:

    HOLD       the step first waits (at most 60 s) for the test to open the
               gate, once for each bit k set in arg (before chunk k)
    FAIL_JOIN  its join raises (after recording it)
    FAIL_STEP  the step raises before chunk arg
    KILL       the step kills its own batcher (SIGKILL) before chunk arg
    BAD_OUT    the step returns one chunk too few, before chunk arg
    FAIL_LEAVE its leave raises (after recording it)
    HOLD_LEAVE its leave first waits (at most 60 s) for the test to open the gate:
               its last chunk is out, its slot not yet settled

Every join and leave, and every hold before it waits, is written to the
file `log` (when given), one line each, "join|leave|hold PID ID TAG CHUNKS",
appended with one write (O_APPEND), so several batcher processes share the
file and a test counts the calls (and knows when a step is held).

With `width`, a chunk is a vector: element j of chunk k is (j + 1) times the
scalar chunk above (output_shape (width,)).
"""
import os

import numpy as np

from engine.shm import ring

TAG = 1000                 # chunk k of tag t: t * TAG + k (k < TAG)
VERSION = 1_000_000_000    # the model's `version`, to tell reloaded weights apart
NONE, HOLD, FAIL_JOIN, FAIL_STEP, KILL, BAD_OUT, FAIL_LEAVE, HOLD_LEAVE = range(8)


def request(tag, length, mark=NONE, arg=0) -> np.ndarray:
    return np.array([tag, length, mark, arg], np.int64)


def chunks(tag, n, version=0) -> list:
    """The first n chunks of a request of this tag: its oracle."""
    return [version * VERSION + tag * TAG + k for k in range(n)]


def rows(tag, n, width, version=0) -> np.ndarray:
    """The first n chunks of a request of a `width` model, stacked: (n, width)."""
    return np.outer(np.array(chunks(tag, n, version), np.int64), np.arange(1, width + 1))


def read_log(path) -> list:
    """The log's records: (event, pid, id, tag, chunks)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    return [(e, int(p), int(i), int(t), int(c)) for e, p, i, t, c in (ln.split() for ln in lines)]


class Scripted:
    """The step model: per id, its request and the chunks written so far."""

    def __init__(self, log=None, gate=None, version=0, step_ms=0.0, width=None):
        self.state = {}  # id -> [tag, length, mark, arg, chunks written]
        self.version, self.step_ns = int(version), int(float(step_ms) * 1e6)
        self.width = None if width is None else int(width)
        self.log = None if log is None else os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                                    0o600)
        self.gate = None
        if gate is not None:
            import posix_ipc
            self.gate = posix_ipc.Semaphore(gate)

    def _record(self, event, rid, tag, count) -> None:
        if self.log is not None:
            os.write(self.log, f"{event} {os.getpid()} {rid} {tag} {count}\n".encode())

    def join(self, ids, batch, lengths=None):
        assert batch.shape == (len(ids), 4) and lengths is None
        failing = []
        for rid, row in zip(ids.tolist(), batch.tolist()):
            assert rid not in self.state, f"id {rid} joined twice"
            self.state[rid] = [*row, 0]
            self._record("join", rid, row[0], 0)
            if row[2] == FAIL_JOIN:
                failing.append(row[0])
        if failing:
            raise ValueError(f"join refuses tags {failing}")

    def step(self, ids):
        states = [self.state[rid] for rid in ids.tolist()]
        short = False
        for rid, (tag, length, mark, arg, k, *_) in zip(ids.tolist(), states):
            if mark == HOLD and k < 63 and (arg >> k) & 1:
                if self.gate is None:
                    raise ValueError("HOLD needs a gate (backend arg `gate`)")
                self._record("hold", rid, tag, k)
                self.gate.acquire(60)  # BusyError after 60 s: the step fails, and the test
            elif mark == FAIL_STEP and k == arg:
                raise RuntimeError(f"step fails at chunk {k} of tag {tag}")
            elif mark == KILL and k == arg:
                os.kill(os.getpid(), 9)
            elif mark == BAD_OUT and k == arg:
                short = True
        if self.step_ns:
            ring.spin_ns(self.step_ns)
        out = np.array([self.version * VERSION + s[0] * TAG + s[4] for s in states], np.int64)
        for s in states:
            s[4] += 1
        done = np.array([s[4] >= s[1] for s in states], bool)
        if self.width is not None:
            out = np.outer(out, np.arange(1, self.width + 1))
        return (out[1:] if short else out), done

    def leave(self, ids):
        failing = []
        for rid in ids.tolist():
            s = self.state.pop(rid, None)
            self._record("leave", rid, -1 if s is None else s[0], -1 if s is None else s[4])
            if s is not None and s[2] == FAIL_LEAVE:
                failing.append(s[0])
            if s is not None and s[2] == HOLD_LEAVE:
                self.gate.acquire(60)
        if failing:
            raise KeyError(f"leave refuses tags {failing}")


def scripted(log=None, gate=None, version=0, step_ms=0.0, width=None):
    """The factory (step_models:scripted)."""
    return Scripted(log, gate, version, step_ms, width)


class Named(Scripted):
    """Scripted over named tensors: inputs "request" int64[4] and "weights"
    float64[1..W] (a variable dim); outputs "chunk" int64 (Scripted's chunk)
    and "mass" float64[2]: (the sum of the request's real weights, k). The
    join checks that the padding past each real length is zero."""

    def join(self, ids, batch, lengths=None):
        assert set(batch) == {"request", "weights"} and set(lengths) == {"weights"}
        weights, real = batch["weights"], lengths["weights"]
        assert weights.shape[1] == real.max(), "cut to the longest real length"
        for row, n in zip(weights, real.tolist()):
            assert not row[n:].any(), "padding is not zero"
        super().join(ids, batch["request"])
        for rid, row, n in zip(ids.tolist(), weights, real.tolist()):
            self.state[rid].append(float(row[:n].sum()))

    def step(self, ids):
        ks = [self.state[rid][4] for rid in ids.tolist()]
        masses = [self.state[rid][5] for rid in ids.tolist()]
        out, done = super().step(ids)
        return {"chunk": out, "mass": np.array([[m, k] for m, k in zip(masses, ks)])}, done


def named(log=None, gate=None):
    """The factory of Named (step_models:named)."""
    return Named(log, gate)
