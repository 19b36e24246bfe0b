"""Where the time of one request goes (identity backend, batch of 1).

    python bench/profile_request.py

Times each step in one process over many repetitions: the client's Python
(validation, slot write, output copy), the ring calls, and the batcher's
Python for a one-request batch; then the measured cross-process round trip.
What the steps do not explain is the two wake-ups between processes.
"""
import os
import time

import numpy as np

import engine
from engine import ring
from engine.batcher import Batcher
from engine.backends import identity
from engine.layout import EngineConfig, Segment

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

        def acquire_cancel():
            _, s, g = r.acquire(pid, 0)
            r.cancel(s, g)
        rows["ring: acquire + cancel (2 C calls)"] = per_call_us(acquire_cancel)
        rows["client: write input row (numpy copy)"] = per_call_us(lambda: seg.inputs[5].__setitem__(Ellipsis, x))
        rows["client: copy output row"] = per_call_us(lambda: seg.outputs[5].copy())

        def one_request_in_process():
            _, s, g = r.acquire(pid, 0)
            seg.inputs[s][...] = x
            r.publish(s, g, 0)
            n, claim_ns, _, _ = r.claim(0, 32, 1, ring.MAX_NS, b.batch)
            b.serve(n, claim_ns)
            assert r.wait_slot(s, g, 0) == ring.OK
            seg.outputs[s].copy()
            r.release_slot(s, g)
        rows["whole request in ONE process, no wake-up (client + batcher)"] = per_call_us(one_request_in_process)

        def batcher_serve():
            _, s, g = r.acquire(pid, 0)
            r.publish(s, g, 0)
            n, claim_ns, _, _ = r.claim(0, 32, 1, ring.MAX_NS, b.batch)
            t = time.perf_counter_ns()
            b.serve(n, claim_ns)
            serve_ns.append(time.perf_counter_ns() - t)
            r.release_slot(s, g)
        serve_ns = []
        per_call_us(batcher_serve)
        rows["batcher: serve() of a 1-request batch (Python + backend)"] = np.median(serve_ns) / 1e3
        rows["ring: scan of 1024 slots (sb_scan)"] = per_call_us(r.scan)
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
    rows["MEASURED cross-process round trip p50"] = np.median(lat) / 1e3
    for k, v in rows.items():
        print(f"{v:9.2f} us  {k}")


if __name__ == "__main__":
    main()
