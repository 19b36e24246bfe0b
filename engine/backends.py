"""Built-in backends, and how a backend spec becomes a callable.

A backend factory runs once inside each batcher process and returns
``fn(batch)`` (or ``fn(batch, lengths)`` for a variable dim). The batch is
valid only during the call: it may be a view of the shared segment.
"""
import importlib
import os
from typing import Callable, Union

from engine import ring


def synthetic(fixed_ms: float = 2.0, per_item_us: float = 100.0, cost_file: str = None):
    """The seed's cost model: busy-waits fixed_ms + n * per_item_us per batch
    (in C, with the GIL released, as a real model's kernels run), then
    returns input * 2 + 1. With cost_file, the cost is re-read from that file
    ("FIXED_MS PER_ITEM_US") whenever it changes: a model that slows down, or
    speeds up, while it serves."""
    cost = [int(float(fixed_ms) * 1e6), int(float(per_item_us) * 1e3)]
    seen = [None]

    def reread() -> None:
        try:
            stamp = os.stat(cost_file).st_mtime_ns
            if stamp != seen[0]:
                with open(cost_file) as f:
                    fixed, per_item = f.read().split()[:2]
                cost[:] = int(float(fixed) * 1e6), int(float(per_item) * 1e3)
                seen[0] = stamp
        except (OSError, ValueError):
            pass  # missing or half-written: keep the last cost

    def run(batch, lengths=None):
        if cost_file:
            reread()
        ring.spin_ns(cost[0] + len(batch) * cost[1])
        return batch * 2 + 1

    return run


def identity():
    """Returns the input at once: the null backend, to measure the engine."""

    def run(batch, lengths=None):
        return batch

    return run


def check_spec(spec: Union[str, Callable]) -> None:
    """ValueError unless spec is a "module:factory" string or a callable (nothing imported)."""
    if callable(spec):
        return
    module, sep, attr = str(spec).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"backend must be 'module:factory' or a callable, got {spec!r}")


def resolve(spec: Union[str, Callable]) -> Callable:
    """A "module:factory" string or a zero-argument callable -> the factory."""
    check_spec(spec)
    if callable(spec):
        return spec
    module, _, attr = str(spec).partition(":")
    factory = getattr(importlib.import_module(module), attr)
    if not callable(factory):
        raise ValueError(f"backend {spec!r} is not callable")
    return factory
