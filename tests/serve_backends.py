"""Backends for the tests of several engines and of the Open Inference Protocol: answers
that reveal what each request sent."""
import numpy as np


def mixed():
    """inputs x float32[4], n int64[2]; answers s = sum(x) (float32, a scalar
    per request), t = n * 3 (int64[2]) and flag = sum(x) > 0 (bool)."""
    def run(batch):
        s = batch["x"].sum(axis=1).astype(np.float32)
        return {"s": s, "t": batch["n"] * 3, "flag": s > 0}
    return run


def echo():
    """Each input x answered as output x_out, unchanged."""
    return lambda batch: {f"{name}_out": a for name, a in batch.items()}



def pid_file(path):
    """affine, whose factory first writes its batcher's pid to `path`."""
    import os

    from helpers import affine
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    return affine()


class Counting:
    """A step model: request (start, steps), int64[2], answers start, start + 1,
    ... one chunk per step, `steps` chunks (steps 0: until it is stopped),
    each step taking step_ms."""

    def __init__(self, step_ms: float = 0.0):
        self.step_ms = step_ms
        self.state = {}  # id -> [next value, steps left or None]

    def join(self, ids, batch, lengths=None):
        for i, (start, steps) in zip(ids.tolist(), batch.tolist()):
            self.state[i] = [start, steps or None]

    def step(self, ids):
        from engine.shm import ring
        if self.step_ms:
            ring.spin_ns(int(self.step_ms * 1e6))
        out, done = np.empty(len(ids), np.int64), np.zeros(len(ids), bool)
        for k, i in enumerate(ids.tolist()):
            s = self.state[i]
            out[k] = s[0]
            s[0] += 1
            if s[1] is not None:
                s[1] -= 1
                done[k] = s[1] == 0
        return out, done

    def leave(self, ids):
        for i in ids.tolist():
            self.state.pop(i, None)


def counting(step_ms: float = 0.0):
    return Counting(step_ms)


class Wide(Counting):
    """Counting, each chunk `width` float64 values (start + k + 0.123456789):
    large events, for callers that stop reading."""

    def __init__(self, width: int, step_ms: float = 0.0):
        super().__init__(step_ms)
        self.width = width

    def step(self, ids):
        out, done = super().step(ids)
        return np.repeat(out[:, None] + 0.123456789, self.width, axis=1), done


def wide(width: int = 1024, step_ms: float = 0.0):
    return Wide(width, step_ms)
