"""An asyncio loop's pass over its pending streams, as a wake of its Waker makes it.

    PYTHONPATH=TREE:bench python bench/waker_pass.py [--streams 100,1000] [--passes 2000]

Each row: one event loop opens S streams on an iterative engine whose step
takes 2 s (the counting model of bench/http_worker_cpu.py), so none of them
moves while it is measured: a few are running, the rest queued, as under
overload (requests wait for a place in the batch). Then the loop's Waker
(engine.client.wakes) makes --passes passes, as the engine's wake of each
step does; the figure is the loop thread's CPU time a pass (thread_time).
"""
import argparse
import asyncio
import os
import time

import numpy as np

import engine
from engine.client import wakes


async def passes(name: str, count: int, n: int) -> float:
    client = engine.Client(name)
    streams = [client.open_stream_async(np.array([k, 5], np.int64), 60.0) for k in range(count)]
    try:
        waker = wakes.for_loop(client.attached)
        if waker is None or len(waker.pending) < count:
            raise RuntimeError("the streams are not all pending on this loop's Waker")
        began = time.thread_time_ns()
        for _ in range(n):
            waker._pass()
        return (time.thread_time_ns() - began) / n / 1e3
    finally:
        for s in streams:
            await s.aclose()
        client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="100,1000")
    p.add_argument("--passes", type=int, default=2000)
    args = p.parse_args()
    counts = [int(c) for c in args.streams.split(",")]
    eng = engine.Engine(f"wakerpass{os.getpid()}", backend="http_worker_cpu:counting",
                        backend_args={"step_ms": 2000.0}, iterative=True, max_steps=65536,
                        input_shape=(2,), input_dtype="int64", output_shape=(),
                        output_dtype="int64", max_batch_size=4,
                        queue_capacity=max(counts) + 16).start()
    try:
        for count in counts:
            per = asyncio.run(passes(eng.name, count, args.passes))
            print(f"{count:5d} pending streams: {per:7.1f} µs of the loop's CPU a pass")
    finally:
        eng.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
