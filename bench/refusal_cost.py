"""What a refusal by admission costs the sender.

    python bench/refusal_cost.py [--refusals 20000] [--gap-us 0]

An engine (synthetic 200 ms + 100 us per item, max_batch_size 1) first serves
a few requests, so the admission fit knows S(n); then requests are queued
(seconds of work), and one client times `infer(x, timeout=0.5)` calls, each
refused at once with Overloaded (the predicted wait is far beyond 500 ms).
Prints the p50 and p99 of one refusal as the sender measures it (validation,
the share check, the C decision, the exception), beside an accepted
`submit()` of the same input for scale.

--gap-us sleeps that long (untimed) before each refusal, as an open-loop
sender does between arrivals: the same code then runs on a core that was
idle or ran other processes, with cold caches, and costs several times more
(on a shared 2-core VM: ~5 us back to back, 20-30 us after 100-500 us asleep).
"""
import argparse
import time

import numpy as np

import engine
from engine.shm import ring

FIXED_MS = 200.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--refusals", type=int, default=20000)
    p.add_argument("--gap-us", type=float, default=0.0)
    args = p.parse_args()
    x = np.ones(16, np.float32)
    # enough queued work to outlast the refusals (each ~gap + 100 us), within the queue
    queued = min(150, 4 + int(args.refusals * (args.gap_us + 100.0) / 1e3 / FIXED_MS))
    with engine.Engine("refusal-cost", backend="engine.backends:synthetic",
                       backend_args={"fixed_ms": FIXED_MS, "per_item_us": 100.0},
                       max_batch_size=1, queue_capacity=256) as eng, \
            engine.Client("refusal-cost") as c:
        for _ in range(3):  # the fit learns S(n) (the first batch is warm-up)
            c.infer(x, timeout=10)
        held = [c.submit(x, timeout=120) for _ in range(queued)]
        times = np.empty(args.refusals, np.int64)
        refused = 0
        for k in range(args.refusals):
            if args.gap_us:
                time.sleep(args.gap_us / 1e6)
            t = ring.now_ns()
            try:
                c.infer(x, timeout=0.5)
            except engine.Overloaded:
                refused += 1
            times[k] = ring.now_ns() - t
        accepted = []
        for _ in range(100):  # an accepted enqueue, for scale (cancelled after)
            t = ring.now_ns()
            held.append(c.submit(x, timeout=120))
            accepted.append(ring.now_ns() - t)
        stats = eng.stats()
        for f in held:
            f.cancel()
    print(f"{refused} of {args.refusals} refused (overloaded_total {stats['overloaded_total']}), "
          f"{args.gap_us:g} us asleep before each: one refusal p50 "
          f"{np.percentile(times, 50) / 1e3:.1f} us, p99 {np.percentile(times, 99) / 1e3:.1f} us "
          f"| one accepted submit(): p50 {np.percentile(accepted, 50) / 1e3:.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
