"""Built-in backends, and how a backend spec becomes a callable.

A backend factory runs once inside each batcher process and returns
``fn(batch)`` (or ``fn(batch, lengths)`` for a variable dim). The batch is
valid only during the call: it may be a view of the shared segment.
"""
import importlib
from typing import Callable, Union

from engine import ring


def synthetic(fixed_ms: float = 2.0, per_item_us: float = 100.0):
    """The seed's cost model: busy-waits fixed_ms + n * per_item_us per batch
    (in C, with the GIL released, as a real model's kernels run), then
    returns input * 2 + 1."""
    fixed_ns = int(float(fixed_ms) * 1e6)
    per_item_ns = int(float(per_item_us) * 1e3)

    def run(batch, lengths=None):
        ring.spin_ns(fixed_ns + len(batch) * per_item_ns)
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
