"""What a backend is, and how its spec becomes a factory.

A spec is a "module:factory" string, imported inside each batcher process, or
a picklable callable. A factory runs once in each batcher process with
**backend_args and returns the backend: ``fn(batch)``, or ``fn(batch,
lengths)`` when an input has a variable dim (an iterative engine's factory
returns a step model instead). Checking a spec imports nothing, so a
supervisor can refuse a malformed one without loading a model.
"""
import importlib
from typing import Any, Callable, Dict, Union

import numpy as np

# What a backend is called with and returns: an array whose first dim counts
# the batch's requests, or with named tensors a dict of such arrays.
Batch = Union[np.ndarray, Dict[str, np.ndarray]]
# A backend: fn(batch) -> Batch, or fn(batch, lengths) when an input has a
# variable dim (lengths: the requests' real lengths, per tensor with names).
Backend = Callable[..., Any]
# A factory: called once in each batcher process with **backend_args.
Factory = Callable[..., Backend]


def check_spec(spec: Union[str, Factory]) -> None:
    """ValueError unless spec is a "module:factory" string or a callable (nothing imported)."""
    if callable(spec):
        return
    module, sep, attr = str(spec).partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"backend must be 'module:factory' or a callable, got {spec!r}")


def resolve(spec: Union[str, Factory]) -> Factory:
    """A "module:factory" string or a zero-argument callable -> the factory."""
    check_spec(spec)
    if callable(spec):
        return spec
    module, _, attr = str(spec).partition(":")
    factory = getattr(importlib.import_module(module), attr)
    if not callable(factory):
        raise ValueError(f"backend {spec!r} is not callable")
    return factory
