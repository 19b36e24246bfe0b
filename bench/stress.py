"""Stress run of the core engine against the identity backend.

    python bench/stress.py [--clients 8] [--requests 20000]

N client processes each send R blocking requests, every input unique, and
check every answer against its own request; then one client measures its
sequential round trip. Prints wrong / duplicated / lost counts, throughput,
round-trip p50/p99 and the share of zero-copy batches.
"""
import argparse
import multiprocessing
import os
import platform
import time

import numpy as np

import engine


def client(name, cid, n, out):
    wrong = 0
    with engine.Client(name) as c:
        for k in range(n):
            x = np.full(16, cid * 1_000_000 + k, np.float32)
            wrong += not np.array_equal(c.infer(x, timeout=30), x)
    out.put((cid, wrong))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--rtt-requests", type=int, default=5000)
    args = ap.parse_args()
    name = f"stress-{os.getpid()}"
    print(f"# {platform.node()} {platform.machine()} cpus={os.cpu_count()} numpy {np.__version__}")
    with engine.Engine(name, backend="engine.backends:identity", max_batch_size=32) as eng:
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        procs = [ctx.Process(target=client, args=(name, i, args.requests, out))
                 for i in range(args.clients)]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        reports = [out.get(timeout=600) for _ in procs]
        elapsed = time.perf_counter() - t0
        for p in procs:
            p.join(10)
        s = eng.stats()
        total = args.clients * args.requests
        wrong = sum(w for _, w in reports)
        print(f"{args.clients} clients x {args.requests} requests: {total / elapsed:,.0f} req/s; "
              f"wrong {wrong}, duplicated {s['answered_total'] - total}, "
              f"lost {total - s['answered_total']}; avg batch {s['avg_batch_size']:.2f}; "
              f"zero-copy batches {s['zero_copy_batches']} of {s['batches_total']} "
              f"({100 * s['zero_copy_batches'] / max(1, s['batches_total']):.1f} %)")
        with engine.Client(name) as c:
            x = np.arange(16, dtype=np.float32)
            for _ in range(200):
                c.infer(x)
            lat = np.empty(args.rtt_requests)
            for k in range(args.rtt_requests):
                t = time.perf_counter_ns()
                c.infer(x)
                lat[k] = time.perf_counter_ns() - t
        print(f"sequential round trip, one client: p50 {np.percentile(lat, 50) / 1e3:.1f} us, "
              f"p99 {np.percentile(lat, 99) / 1e3:.1f} us")


if __name__ == "__main__":
    main()
