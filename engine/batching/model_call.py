"""A model's call, as both batchers make it: the form of its arguments, and the
checks its results pass.

Inside the engine a batch is a list of arrays, one per tensor in spec order.
A model takes the single-array form's one array, or named tensors as a dict
by name (and the variable dims' real lengths the same way), and returns
likewise; this is the one place that converts between the two on the model's
side (EngineConfig.check_input and answer() are the caller's side). A
one-shot backend's results and an iterative step's chunks pass the same
check: n rows of each output's spec, or BadResult saying what came.
"""
from typing import Callable, Optional

import numpy as np

from engine.tensors import BadResult, checked_result


class ModelCall:
    """The call form and result checks of one engine's tensors, for batches of
    up to `rows` requests."""

    def __init__(self, cfg, rows: int):
        self.named = cfg.named
        self.in_names = [s.name for s in cfg.input_specs]
        self.var_names = [s.name for s in cfg.input_specs if s.var_axis is not None]
        self.out_names = [s.name for s in cfg.output_specs]
        # each output's check: (dtype, shape, name, its shape per batch size: no
        # tuple built per batch)
        self.out_checks = [(np.dtype(s.dtype), s.shape, s.name,
                            [(k, *s.shape) for k in range(rows + 1)]) for s in cfg.output_specs]
        # the first output's check, and whether it is the only one: most engines'
        # results are checked without a loop
        self.first_dtype, _, _, self.first_shapes = self.out_checks[0]
        self.one_output = len(self.out_checks) == 1

    def args(self, batch: list, lengths: Optional[list]) -> tuple:
        """(x, lengths) as a model takes them: one array each, or dicts by name."""
        if not self.named:
            return batch[0], (None if lengths is None else lengths[0])
        return (dict(zip(self.in_names, batch)),
                None if lengths is None else dict(zip(self.var_names, lengths)))

    def outputs(self, result) -> tuple:
        """A model's result as its outputs in spec order (their rows unchecked)."""
        if not self.named:
            return (result,)
        if not isinstance(result, dict):
            raise BadResult(f"expected a dict of outputs {self.out_names}, "
                            f"got {type(result).__name__}")
        missing = [name for name in self.out_names if name not in result]
        if missing:
            raise BadResult(f"expected outputs {self.out_names}, got {sorted(result, key=str)} "
                            f"(missing {missing})")
        return tuple(result[name] for name in self.out_names)

    def bind(self, fn: Callable) -> Callable[[list, Optional[list]], tuple]:
        """fn as a one-shot batcher calls it: on the batch's tensors in spec
        order (and, with variable dims, their real lengths), returning its
        outputs in spec order. fn(x) without variable dims, fn(x, lengths)
        with them."""
        if not self.named:
            def call_one(batch: list, lengths: Optional[list]) -> tuple:
                return (fn(batch[0]) if lengths is None else fn(batch[0], lengths[0]),)
            return call_one
        args, outputs = self.args, self.outputs

        def call_named(batch: list, lengths: Optional[list]) -> tuple:
            x, named_lengths = args(batch, lengths)
            return outputs(fn(x) if lengths is None else fn(x, named_lengths))
        return call_named

    def check(self, results: tuple, n: int) -> tuple:
        """The outputs as n rows of each output's spec, or BadResult saying what came."""
        first, dtype, shapes = results[0], self.first_dtype, self.first_shapes
        if (type(first) is np.ndarray and (first.dtype is dtype or first.dtype == dtype)
                and first.shape == shapes[n] and self.one_output):
            return results  # the common case, checked cheaply: one output as it came
        for result, (dtype, _, _, shapes) in zip(results, self.out_checks):
            if not (type(result) is np.ndarray and (result.dtype is dtype or result.dtype == dtype)
                    and result.shape == shapes[n]):
                break
        else:
            return results  # every one as it came
        return tuple(checked_result(result, n, dtype, shape, name)
                     for result, (dtype, shape, name, _) in zip(results, self.out_checks))
