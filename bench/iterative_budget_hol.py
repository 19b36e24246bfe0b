"""Head-of-line blocking under an iterative engine's token budget.

    python bench/iterative_budget_hol.py [--step-ms 10] [--max-steps 64] [--runs 5]

An iterative engine (the test suite's step_models:scripted, each step
spinning step_ms) with max_batch_tokens = 1.5 * max_steps: one request of
the engine's max_steps reserves max_steps tokens, so one such stream leaves
room for small requests but not for a second big one. Each run: a big stream
is running (its first chunk seen), a second big request arrives (it does not
fit: it waits for the first to end), then a small one (4 steps, 4 tokens,
which fits). Prints the small one's latency (send to last chunk) and the
second big one's (send to last chunk), median and max over the runs.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

import engine

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def request(tag: int, length: int) -> np.ndarray:
    return np.array([tag, length, 0, 0], np.int64)  # step_models.request, no mark


def drain(stream) -> float:
    """Reads the stream to its end; returns when it ended (perf_counter)."""
    for _ in stream:
        pass
    return time.perf_counter()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--max-steps", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    sys.path.insert(0, TESTS)  # batchers get this process's sys.path: they find step_models
    steps = args.max_steps
    name = f"hol-{os.getpid()}"
    small_ms, big_ms = [], []
    with engine.Engine(name, backend="step_models:scripted", iterative=True,
                       backend_args={"step_ms": args.step_ms}, input_shape=(4,),
                       input_dtype="int64", output_shape=(), output_dtype="int64",
                       max_steps=steps, max_batch_tokens=steps * 3 // 2,
                       max_batch_size=8) as eng, engine.Client(name) as c:
        for run in range(args.runs):
            first = c.stream(request(1, steps), timeout=120)
            next(first)  # running
            sent_big = time.perf_counter()
            big = c.stream(request(2, steps), timeout=120)  # over the budget: waits
            sent_small = time.perf_counter()
            small = c.stream(request(3, 4), timeout=120, max_steps=4)  # fits
            small_ms.append((drain(small) - sent_small) * 1e3)
            drain(first)
            big_ms.append((drain(big) - sent_big) * 1e3)
        s = eng.stats()
    print(f"step {args.step_ms} ms, max_steps {steps}, max_batch_tokens {steps * 3 // 2}, "
          f"{args.runs} runs, {s['requests_total']} requests")
    print(f"small (4 steps, fits):      median {statistics.median(small_ms):7.1f} ms, "
          f"max {max(small_ms):7.1f} ms")
    print(f"second big (over budget):   median {statistics.median(big_ms):7.1f} ms, "
          f"max {max(big_ms):7.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
