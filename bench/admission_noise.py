"""Admission by deadline on a noisy backend: refusals with admission on, beside the same load off.

    python bench/admission_noise.py [--seconds 10] [--callers 8] [--interval-ms 20]
                                    [--timeout-ms 2000] [--tree DIR] [--out FILE.json]

The backend costs 2 ms + 1 ms a row; every seventh call takes ten times that,
and its first calls at each of its first three batch sizes take 0.6 s more (a
model's lazy initialisation). --callers client processes each send one
request every --interval-ms (open loop: a request is sent on time whatever
the answers do), each with a deadline of --timeout-ms. The same load runs
twice, on a fresh engine each time: admission="deadline", then "none". Per
run: requests, refused (Overloaded), answered in time, late or timed out,
the worst latency of an answer, and with admission on what the engine says
of its predictions (stats()["admission"]). --tree runs another source tree
of shmbatch (its engine/_ringc built), e.g. a worktree of an earlier commit.
"""
import argparse
import json
import multiprocessing
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent


def noisy(fixed_ms=2.0, per_row_ms=1.0, every=7, factor=10.0, first_sizes=3, first_extra_s=0.6):
    """The backend: out = 2 x + 1, at the cost described in the module's docstring."""
    calls, sizes = [0], set()

    def fn(x):
        calls[0] += 1
        n = len(x)
        cost_s = (fixed_ms + n * per_row_ms) / 1e3
        if calls[0] % every == 0:
            cost_s *= factor
        if n not in sizes:
            if len(sizes) < first_sizes:
                cost_s += first_extra_s
            sizes.add(n)
        time.sleep(cost_s)
        return x * 2 + 1

    return fn


def caller(name, k, interval_s, timeout_s, seconds, start_at, conn):
    import numpy as np

    import engine
    counts = {"requests": 0, "refused": 0, "in_time": 0, "late": 0, "failed": 0, "worst_ms": 0.0}
    pending = []
    with engine.Client(name) as c:
        while time.monotonic() < start_at:
            time.sleep(0.001)
        n = int(seconds / interval_s)
        for i in range(n):
            due = start_at + i * interval_s + k * interval_s / 8
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            x = np.full(4, float(k * 100000 + i), np.float32)
            counts["requests"] += 1
            try:
                pending.append((x, time.monotonic(), c.submit(x, timeout=timeout_s)))
            except engine.Overloaded:
                counts["refused"] += 1
            pending = [p for p in pending if not settle(p, counts, timeout_s)]
        for p in pending:
            p[2].exception(timeout=timeout_s + 5)
            settle(p, counts, timeout_s)
    conn.send(counts)


def settle(p, counts, timeout_s) -> bool:
    import numpy as np
    x, sent, f = p
    if not f.done():
        return False
    took = time.monotonic() - sent
    if f.exception() is not None:
        counts["failed"] += 1
    else:
        assert np.array_equal(f.result(), x * 2 + 1), "an answer is not its own request's"
        counts["in_time" if took <= timeout_s else "late"] += 1
        counts["worst_ms"] = max(counts["worst_ms"], took * 1e3)
    return True


def run(args, admission: str) -> dict:
    import engine
    name = f"noise-{admission}-{os.getpid()}"
    ctx = multiprocessing.get_context("fork")
    with engine.Engine(name, backend="admission_noise:noisy", input_shape=(4,),
                       output_shape=(4,), max_batch_size=32, queue_capacity=1024,
                       admission=admission) as eng:
        start_at = time.monotonic() + 0.5
        pipes, procs = [], []
        for k in range(args.callers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=caller, args=(name, k, args.interval_ms / 1e3,
                                                    args.timeout_ms / 1e3, args.seconds,
                                                    start_at, child))
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        results = [p.recv() for p in pipes]
        for proc in procs:
            proc.join(10)
        stats = eng.stats()
    total = {key: sum(r[key] for r in results) for key in results[0] if key != "worst_ms"}
    total["worst_ms"] = round(max(r["worst_ms"] for r in results), 1)
    total["refused_pct"] = round(100 * total["refused"] / max(1, total["requests"]), 2)
    total["admission"] = admission
    total["engine"] = stats.get("admission")
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--callers", type=int, default=8)
    p.add_argument("--interval-ms", type=float, default=20.0)
    p.add_argument("--timeout-ms", type=float, default=2000.0)
    p.add_argument("--tree", type=pathlib.Path, default=HERE.parent)
    p.add_argument("--out", type=pathlib.Path)
    args = p.parse_args()
    sys.path.insert(0, str(args.tree))
    rows = [run(args, "deadline"), run(args, "none")]
    print(f"{'admission':>10} {'requests':>9} {'refused':>8} {'refused%':>9} {'in time':>8} "
          f"{'late':>5} {'failed':>7} {'worst ms':>9}")
    for r in rows:
        print(f"{r['admission']:>10} {r['requests']:>9} {r['refused']:>8} {r['refused_pct']:>9} "
              f"{r['in_time']:>8} {r['late']:>5} {r['failed']:>7} {r['worst_ms']:>9}")
    if rows[0]["engine"]:
        print("engine's own account:", json.dumps(rows[0]["engine"]))
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "args": vars(args)}, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
