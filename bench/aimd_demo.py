"""The adaptive batch limit (slo_ms) following a model that slows down mid-run.

    python bench/aimd_demo.py [--slo-ms 20] [--seconds 9]

A synthetic backend (2 ms + 100 us per item) whose per-item cost is read from
a file; one open-loop client process sends 1,000 req/s (Poisson). A third of
the way in, the per-item cost becomes 400 us; two thirds in, it returns to
100 us. Every 0.25 s the script prints the batch limit (stats()["batch_limit"])
and the p99 latency of the requests answered in that window, against the
objective. Without slo_ms the batch would stay at max_batch_size (32): 2 ms +
32 x 400 us = 14.8 ms per batch, up to twice that for a request's latency.
"""
import argparse
import os
import tempfile
import time

import numpy as np

import engine
from engine.shm import ring
from engine.tools import load


def client(name, rate, seconds, timeout_s, conn):
    offsets = load.poisson_offsets_ns(rate, int(rate * seconds), 1)
    scheduled = np.zeros(len(offsets), np.int64)
    x = np.ones(16, np.float32)
    done, pending = [], []
    with engine.Client(name) as c:
        start = ring.now_ns()
        for k in load.paced(offsets, start, scheduled):
            due = int(scheduled[k])
            try:
                f = c.submit(x, timeout=timeout_s)
            except engine.QueueFull:  # refused at once (Overloaded is one)
                continue
            # answered ones only: a request that timed out has no latency to count
            f.add_done_callback(lambda f, due=due: f.exception() is None
                                and done.append((due, ring.now_ns())))
            pending.append(f)
        for f in pending:
            f.exception(timeout=10)
    conn.send(np.array(done, np.int64) - start)
    conn.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--slo-ms", type=float, default=20.0)
    p.add_argument("--seconds", type=float, default=9.0)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--timeout-ms", type=float, default=1000.0,
                   help="each request's timeout (its deadline: admission refuses what cannot "
                        "make it)")
    args = p.parse_args()
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    cost = tempfile.NamedTemporaryFile("w", suffix=".cost", delete=False)
    cost.write("2.0 100.0")
    cost.close()
    name = f"aimd-{os.getpid()}"
    try:
        with engine.Engine(name, backend="engine.backends:synthetic",
                           backend_args={"fixed_ms": 2.0, "per_item_us": 100.0,
                                         "cost_file": cost.name},
                           max_batch_size=32, queue_capacity=4096, slo_ms=args.slo_ms) as eng:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client, args=(name, args.rate, args.seconds,
                                                          args.timeout_ms / 1000, child))
            proc.start()
            start, limits, phase = time.monotonic(), [], 0
            while time.monotonic() - start < args.seconds:
                t = time.monotonic() - start
                if phase == 0 and t > args.seconds / 3:
                    with open(cost.name, "w") as f:
                        f.write("2.0 400.0")
                    phase = 1
                elif phase == 1 and t > 2 * args.seconds / 3:
                    with open(cost.name, "w") as f:
                        f.write("2.0 100.0")
                    phase = 2
                limits.append((t, eng.stats()["batch_limit"], phase))
                time.sleep(0.25)  # the sampling interval itself
            done = parent.recv() if parent.poll(args.seconds + 60) else np.zeros((0, 2), np.int64)
            proc.join(30)
    finally:
        os.unlink(cost.name)
    print(f"slo_ms {args.slo_ms:g}; per-item cost 100 us, then 400 us from "
          f"{args.seconds / 3:.1f} s, then 100 us from {2 * args.seconds / 3:.1f} s")
    print("   t (s)  per-item  batch_limit  answered  p99 latency (ms)")
    for t, limit, phase in limits:
        sel = done[(done[:, 0] >= (t - 0.25) * 1e9) & (done[:, 0] < t * 1e9)] if len(done) else done
        lat = (sel[:, 1] - sel[:, 0]) / 1e6 if len(sel) else np.zeros(0)
        p99 = f"{np.percentile(lat, 99):8.1f}" if len(lat) else "       -"
        print(f"{t:8.2f}  {(100, 400, 100)[phase]:5d} us  {limit:11d}  {len(sel):8d}  {p99}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
