"""Backends for the Open Inference Protocol tests: answers that reveal what each request sent."""
import numpy as np


def mixed():
    """inputs x float32[4], n int64[2]; answers s = sum(x) (float32, a scalar
    per request), t = n * 3 (int64[2]) and flag = sum(x) > 0 (bool)."""
    def run(batch):
        s = batch["x"].sum(axis=1).astype(np.float32)
        return {"s": s, "t": batch["n"] * 3, "flag": s > 0}
    return run
