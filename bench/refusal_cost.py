"""What a refusal by admission costs the sender, alone on a quiet machine.

    python bench/refusal_cost.py [--refusals 20000]

An engine (synthetic 20 ms + 100 us per item, max_batch_size 1) first serves
a few requests, so the admission fit knows S(n); then 40 requests are queued
(about 0.8 s of work), and one client times `infer(x, timeout=0.05)` calls,
each refused at once with Overloaded (the predicted wait is far beyond 50 ms).
Prints the p50 and p99 of one refusal as the sender measures it (validation,
the share check, the C decision, the exception), beside an accepted
`submit()` of the same input for scale.
"""
import argparse

import numpy as np

import engine
from engine import ring


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--refusals", type=int, default=20000)
    args = p.parse_args()
    x = np.ones(16, np.float32)
    with engine.Engine("refusal-cost", backend="engine.backends:synthetic",
                       backend_args={"fixed_ms": 20.0, "per_item_us": 100.0},
                       max_batch_size=1, queue_capacity=256) as eng, \
            engine.Client("refusal-cost") as c:
        for _ in range(4):  # the fit learns S(n) (the first batch is warm-up)
            c.infer(x, timeout=10)
        held = [c.submit(x, timeout=30) for _ in range(40)]
        times = np.empty(args.refusals, np.int64)
        refused = 0
        for k in range(args.refusals):
            t = ring.now_ns()
            try:
                c.infer(x, timeout=0.05)
            except engine.Overloaded:
                refused += 1
            times[k] = ring.now_ns() - t
        accepted = []
        for _ in range(200):  # an accepted enqueue, for scale (answered later)
            t = ring.now_ns()
            held.append(c.submit(x, timeout=60))
            accepted.append(ring.now_ns() - t)
        for f in held:
            f.result(timeout=60)
        stats = eng.stats()
    print(f"{refused} of {args.refusals} refused (overloaded_total {stats['overloaded_total']}); "
          f"one refusal: p50 {np.percentile(times, 50) / 1e3:.1f} us, "
          f"p99 {np.percentile(times, 99) / 1e3:.1f} us | one accepted submit(): p50 "
          f"{np.percentile(accepted, 50) / 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
