"""A request's tensors written into its slot's rows of shared memory (the
enqueue's copy when the one-call fused submit does not apply)."""
import numpy as np


def write_rows(seg, slot: int, arrays: tuple, lengths: tuple) -> None:
    """A request's tensors into its slot's rows, with their real lengths."""
    for t, (spec, region) in enumerate(zip(seg.config.input_specs, seg.in_regions)):
        _write(region[slot], arrays[t], spec.var_axis, lengths[t])
        if spec.var_axis is not None:
            seg.lengths[slot, t] = lengths[t]


def _write(row: np.ndarray, array: np.ndarray, var_axis, length: int) -> None:
    """One input into its row; with a variable dim, the padding zeroed (so a
    batch needs no per-request fill)."""
    if var_axis is None:
        row[...] = array
    else:
        head = (slice(None),) * var_axis
        row[head + (slice(0, length),)] = array
        row[head + (slice(length, None),)] = 0
