"""Where the time of one request goes (identity backend, batch of 1).

    python bench/profile_request.py

Times each step in one process over many repetitions: the client's Python
(validation), its two C calls (submit: acquire + copy in + publish; take:
copy out + release), and the batcher's claim and serve() of a one-request
batch; then the measured cross-process round trip, beside the C futex
ping-pong floor. Both sides spin up to 50 us before they sleep, so a short
round trip pays no kernel wake-up: it costs about the steps above, some of
them overlapped across the two processes.
"""
import os
import time

import numpy as np

import engine
from engine.backends import identity
from engine.batching.batcher import Batcher
from engine.config import EngineConfig
from engine.segment import Segment
from engine.shm import ring
from engine.tools import baselines

N = 20000


def per_call_us(fn, n=N):
    t = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t) / n / 1e3


def main():
    cfg = EngineConfig(name=f"prof-{os.getpid()}", input_shape=(16,), output_shape=(16,),
                       max_batch_size=32)
    seg = Segment.create(cfg)
    try:
        r, x, pid = seg.ring, np.arange(16, dtype=np.float32), os.getpid()
        b = Batcher(seg, 0, identity())
        rows = {}
        rows["client: validate input (check_input)"] = per_call_us(lambda: cfg.check_input(x))
        out = np.empty(16, np.float32)

        def enqueue_and_drop():
            _, s, g = r.submit(pid, 0, x, 0)  # acquire + copy + publish: one C call
            r.abandon(s, g)
        rows["ring: submit (acquire+copy+publish) + abandon, 2 C calls"] = per_call_us(enqueue_and_drop)

        def claim_serve():
            _, s, g = r.submit(pid, 0, x, 0)
            n, claim_ns, *_ = r.claim(0, 32, 1, ring.MAX_NS, b.claimed)
            t = time.perf_counter_ns()
            b.serve(n, claim_ns)
            serve_ns.append(time.perf_counter_ns() - t)
            r.take(s, g, 0, 0, out)
        serve_ns = []
        rows["batcher: claim (ready-bitmap pass) + serve() + client take, 1 request"] = per_call_us(claim_serve)
        rows["  of which serve() (Python + backend + complete)"] = np.median(serve_ns) / 1e3
        rows["ring: claim with nothing ready (ready-bitmap pass)"] = per_call_us(
            lambda: r.claim(0, 32, 32, 0, b.claimed))

        def one_request_in_process():
            _, s, g = r.submit(pid, 0, x, 0)
            n, claim_ns, *_ = r.claim(0, 32, 1, ring.MAX_NS, b.claimed)
            b.serve(n, claim_ns)
            r.take(s, g, 0, 0, out)
        rows["whole request in ONE process, no wake-up (client + batcher)"] = per_call_us(one_request_in_process)
    finally:
        seg.unlink()
        seg.close()

    name = f"prof2-{os.getpid()}"
    with engine.Engine(name, backend="engine.backends:identity"):
        with engine.Client(name) as c:
            for _ in range(500):
                c.infer(x)
            lat = []
            for _ in range(5000):
                t = time.perf_counter_ns()
                c.infer(x)
                lat.append(time.perf_counter_ns() - t)
    rows["MEASURED cross-process round trip p50 (Client.infer, identity batcher)"] = np.median(lat) / 1e3
    floor = baselines.pingpong_floor_ns(5000)
    rows["C futex ping-pong between 2 processes p50 (the floor, sleeping)"] = np.median(floor) / 1e3
    for k, v in rows.items():
        print(f"{v:9.2f} us  {k}")


if __name__ == "__main__":
    main()
