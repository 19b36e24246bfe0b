"""The seed's scenario across processes, until `shmbatch bench` lands.

    python bench/seed.py

Synthetic backend (2 ms + 100 us per item), 4 client PROCESSES sending
open-loop Poisson arrivals (1500 req/s in all, 1600 requests), for the rows
(max_batch_size, max_delay_ms) = (1, 0), (32, 0), (8, 1), (32, 2), (32, 5).
Latency is measured from each request's scheduled arrival to its answer.
"""
import multiprocessing
import os
import time

import numpy as np

import engine

ROWS = [(1, 0.0), (32, 0.0), (8, 1.0), (32, 2.0), (32, 5.0)]
CLIENTS, RATE, REQUESTS = 4, 1500.0, 1600


def client(name, cid, n, rate, out):
    rng = np.random.default_rng(1000 + cid)
    with engine.Client(name) as c:
        t0 = time.monotonic()
        due = t0 + np.cumsum(rng.exponential(1.0 / rate, n))
        pending, answered_at = [], np.zeros(n)
        for k in range(n):
            wait = due[k] - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # open loop: the schedule never waits for answers
            x = np.full(16, cid * 100000 + k, np.float32)
            f = c.submit(x, timeout=60)
            f.add_done_callback(lambda _, k=k: answered_at.__setitem__(k, time.monotonic()))
            pending.append((x, f))
        wrong = sum(not np.array_equal(f.result(timeout=120), x * 2 + 1) for x, f in pending)
    out.put((answered_at - due, wrong, t0, answered_at.max()))


def run_row(max_batch, max_delay_ms):
    name = f"seed-{os.getpid()}-{max_batch}-{int(max_delay_ms * 10)}"
    with engine.Engine(name, backend="engine.backends:synthetic",
                       backend_args={"fixed_ms": 2.0, "per_item_us": 100.0},
                       max_batch_size=max_batch, max_delay_ms=max_delay_ms,
                       queue_capacity=2048) as eng:
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        procs = [ctx.Process(target=client, args=(name, c, REQUESTS // CLIENTS, RATE / CLIENTS, out))
                 for c in range(CLIENTS)]
        for p in procs:
            p.start()
        reports = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(10)
        s = eng.stats()
    lat = np.sort(np.concatenate([r[0] for r in reports])) * 1e3
    span = max(r[3] for r in reports) - min(r[2] for r in reports)
    print(f"max_batch {max_batch:>2} delay {max_delay_ms:>3.0f} ms | {REQUESTS / span:>6.0f} req/s | "
          f"avg batch {s['avg_batch_size']:>5.1f} | p50 {np.percentile(lat, 50):>7.2f} ms "
          f"p99 {np.percentile(lat, 99):>7.2f} ms | max queue wait "
          f"{s['queue_wait_ms']['max']:>7.2f} ms | wrong {sum(r[1] for r in reports)}")


if __name__ == "__main__":
    print("synthetic cost model 2 ms + 100 us x n per batch; 4 client processes, "
          "1500 req/s Poisson in all, 1600 requests")
    for b, d in ROWS:
        run_row(b, d)
