"""The first request after `ready`, with and without warmup, when the model's
first call is slow.

    python bench/warmup_first_request.py [--runs 5] [--first-s 1.0] [--json out.json]

The backend (slow_first, below) sleeps --first-s in its process's first call,
as a model that initialises lazily does (an allocator, a JIT, cuDNN's
autotuning, ONNX Runtime's first run), and answers x * 2 + 1 at once after.
Each run starts a fresh engine (input (16,) float32, max_batch_size 8, one
batcher), with warmup=True or False, alternated run by run; once start()
returns (the engine is ready) a client attaches, and the latencies of its
first and second request are taken (each answer checked against its own
request). Printed: each run, then each mode's medians of the first request,
the second, start() (to ready) and stats()["warmup_ms"].
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

SHAPE = (16,)


def slow_first(first_s=1.0):
    """A model whose first call (per process) takes first_s: y = x * 2 + 1."""
    calls = [0]

    def run(batch):
        if calls[0] == 0:
            time.sleep(first_s)
        calls[0] += 1
        return batch * 2 + 1
    return run


def one_run(k: int, warm: bool, first_s: float) -> dict:
    import engine
    name = f"warmbench-{os.getpid()}-{k}"
    eng = engine.Engine(name, backend="warmup_first_request:slow_first",
                        backend_args={"first_s": first_s}, input_shape=SHAPE,
                        output_shape=SHAPE, max_batch_size=8, warmup=warm)
    t0 = time.perf_counter()
    eng.start()
    start_s = time.perf_counter() - t0
    try:
        latencies = []
        with engine.Client(name) as c:
            for i in range(2):
                x = np.full(SHAPE, 10 * k + i + 1, np.float32)
                t = time.perf_counter()
                y = c.infer(x, timeout=60)
                latencies.append((time.perf_counter() - t) * 1e3)
                if not np.array_equal(y, x * 2 + 1):
                    raise SystemExit(f"run {k}: wrong answer {y} to {x}")
        warmup_ms = eng.stats()["warmup_ms"]
    finally:
        eng.stop()
    return {"warmup": warm, "first_ms": latencies[0], "second_ms": latencies[1],
            "start_s": start_s, "warmup_ms": warmup_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5, help="runs per mode, alternated")
    p.add_argument("--first-s", type=float, default=1.0, help="the model's slow first call")
    p.add_argument("--json", help="write the runs and medians here")
    args = p.parse_args()
    # batchers import this module by name: its folder on their path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    runs = []
    for k in range(2 * args.runs):
        r = one_run(k, warm=k % 2 == 0, first_s=args.first_s)
        runs.append(r)
        print(f"run {k}: warmup={r['warmup']!s:5}  first {r['first_ms']:8.2f} ms  second "
              f"{r['second_ms']:6.2f} ms  start {r['start_s']:5.2f} s  warmup_ms "
              f"{r['warmup_ms']}", flush=True)
    medians = {}
    for warm in (True, False):
        rows = [r for r in runs if r["warmup"] == warm]
        medians["with" if warm else "without"] = {
            key: statistics.median(r[key] for r in rows) if rows[0][key] is not None else None
            for key in ("first_ms", "second_ms", "start_s", "warmup_ms")}
    print(f"\nmedians of {args.runs} runs each (model's first call {args.first_s:g} s):")
    print(f"{'':8} {'first request':>14} {'second':>10} {'start()':>9} {'warmup_ms':>10}")
    for mode, m in medians.items():
        warm = "-" if m["warmup_ms"] is None else f"{m['warmup_ms']:.1f}"
        print(f"{mode:8} {m['first_ms']:11.2f} ms {m['second_ms']:7.2f} ms "
              f"{m['start_s']:7.2f} s {warm:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "medians": medians, "first_s": args.first_s}, f, indent=1)


if __name__ == "__main__":
    main()
