"""Backends of tests/test_reload.py (importable by batchers): answers that tell
which backend args the batcher serving them was started with."""
from helpers import behind_gate, negative

from engine.shm import ring


def offset(bias=0.0, scale=1.0, fixed_ms=0.0):
    """y = scale * x + bias, after fixed_ms: each answer reveals the args."""
    def run(batch, lengths=None):
        if fixed_ms:
            ring.spin_ns(int(fixed_ms * 1e6))
        return batch * scale + bias
    return run


def broken(**kwargs):
    """A factory that fails, as one whose weights are missing would."""
    raise FileNotFoundError("no weights at /nonexistent/model.bin")


def held(gate, bias=0.0):
    """x + bias; a batch holding a negative value first waits (at most 60 s)
    for the test to open `gate` (conftest.Gate): a batcher busy in a batch
    for as long as the test needs."""
    return behind_gate(gate, offset(bias=bias), holds=negative)
