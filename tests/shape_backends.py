"""Backends for the named-tensor and batch-shape tests: answers that reveal
what each request sent, and a log of every batch the backend saw."""
import json

import numpy as np
from helpers import behind_gate


def token_stats():
    """inputs ids int64[*] (padded with zeros) and scale float32[2]; answers
    total = sum(ids) * scale[0] (float32[1]) and echo = (len, scale[1]) (float32[2])."""
    def run(batch, lengths):
        ids, scale = batch["ids"], batch["scale"]
        for row, n in zip(ids, lengths["ids"]):
            if row[n:].any():
                raise AssertionError("padding is not zero")
        total = (ids.sum(axis=1) * scale[:, 0]).astype(np.float32)[:, None]
        echo = np.stack([lengths["ids"].astype(np.float32), scale[:, 1]], axis=1)
        return {"total": total, "echo": echo}
    return run


def logged_lengths(log_path):
    """Single-array, variable dim: appends each batch's (rows, padded length, real
    lengths) to log_path (one JSON line a batch); answers the row sums."""
    def run(batch, lengths):
        with open(log_path, "a") as f:
            f.write(json.dumps([len(batch), batch.shape[1], [int(n) for n in lengths]]) + "\n")
        return batch.sum(axis=1)
    return run


def logged_rows(log_path):
    """Fixed shape: appends each batch's row count to log_path; answers x * 2 + 1."""
    def run(batch):
        with open(log_path, "a") as f:
            f.write(f"{len(batch)}\n")
        return batch * 2 + 1
    return run


def gated_log(gate, log_path, fixed=False):
    """logged_rows (fixed) or logged_lengths, whose first batch first waits (at
    most 60 s) for the test to open `gate`, as helpers.gated does."""
    return behind_gate(gate, logged_rows(log_path) if fixed else logged_lengths(log_path))


def gated_named(gate):
    """token_stats, whose first batch first waits (at most 60 s) for `gate`."""
    return behind_gate(gate, token_stats())
