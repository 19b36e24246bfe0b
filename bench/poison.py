"""What a request that kills its batcher costs its batch mates.

    python bench/poison.py [--sizes 8,32]

For each size n: an engine (float64 answers, so not in place: a dead
batcher's batch is retried) whose backend (the test suite's
helpers:exits_on_negative) exits the process on a negative input; n requests
are sent back to back (they form one batch or a few), the middle one
negative. Prints how many were answered right, how many failed (and why),
how long until every request was settled, and the restarts it took.
"""
import argparse
import os
import sys
import time

import numpy as np

import engine

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="8,32")
    args = p.parse_args()
    sys.path.insert(0, TESTS)  # batchers get this process's sys.path: they find helpers there
    x = np.arange(16, dtype=np.float32)
    for n in (int(v) for v in args.sizes.split(",")):
        name = f"poison-{os.getpid()}-{n}"
        with engine.Engine(name, backend="helpers:exits_on_negative",
                           backend_args={"dtype": "float64"}, output_dtype="float64",
                           max_batch_size=n) as eng, engine.Client(name) as c:
            c.infer(x, timeout=30)  # started and warm
            sent = [x + k if k != n // 2 else -x - 1 for k in range(n)]
            start = time.perf_counter()
            futures = [c.submit(v, timeout=60) for v in sent]
            right, failed, settled_s = 0, [], 0.0
            for v, f in zip(sent, futures):
                try:
                    right += np.array_equal(f.result(timeout=60), v * 2 + 1)
                except engine.BackendError as e:
                    failed.append(e.message)
                settled_s = time.perf_counter() - start
            s = eng.stats()
        print(f"{n} requests, one of them poison: {right} answered right, {len(failed)} failed "
              f"({'; '.join(m[:90] for m in failed)}); all settled {settled_s:.2f} s after "
              f"the send; {s['batcher_restarts_total']} restarts, {s['retried_alone_total']} "
              f"retried alone, {s['batches_total']} batches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
