"""A lone asyncio caller: one request at a time from a loop that does work of its own between them.

    PYTHONPATH=TREE python bench/lone_look.py [--model-us 5,30] [--work-us 60]
                                              [--idle-spin-us 200] [--requests 4000]

For each model (the synthetic backend busy-waiting US µs a batch, answering
2x + 1; its batcher's idle spin --idle-spin-us, long enough to stay awake
between the requests), one task on one event loop busy-works --work-us, then
awaits infer_async(), --requests times (after 300 to warm up), each answer
checked. It prints the caller process's CPU a request less that work, and the
p50 of the awaits. Run it with each tree on PYTHONPATH to compare them. The
loop is alone (nothing else awaits an engine) and idle by the look's rule (its
last answer came longer ago than engine.client.looks.LOOP_BUSY_NS), the case
the lone look serves; with a model slower than the look, the case its back-off
serves.
"""
import argparse
import asyncio
import os
import time

import numpy as np

import engine


def run(model_us: float, work_us: float, idle_spin_us: float, n: int) -> str:
    name = f"lonelook-{os.getpid()}"
    with engine.Engine(name, backend="engine.backends:synthetic",
                       backend_args={"fixed_ms": model_us / 1000, "per_item_us": 0.0},
                       input_shape=(16,), output_shape=(16,), idle_spin_us=idle_spin_us):
        with engine.Client(name, wait_s=30) as c:
            xs = np.random.default_rng(0).random((64, 16), dtype=np.float32)

            async def main():
                for k in range(300):
                    await c.infer_async(xs[k % 64])
                t0, lat = time.process_time(), []
                for k in range(n):
                    end = time.perf_counter_ns() + int(work_us * 1000)
                    while time.perf_counter_ns() < end:
                        pass
                    s = time.perf_counter_ns()
                    y = await c.infer_async(xs[k % 64])
                    lat.append(time.perf_counter_ns() - s)
                    assert (y == xs[k % 64] * 2 + 1).all()
                return (time.process_time() - t0) / n * 1e6 - work_us, sorted(lat)[n // 2] / 1e3
            cpu_us, p50_us = asyncio.run(main())
    return f"model {model_us:g} µs: caller CPU a request {cpu_us:.1f} µs (less its work), p50 {p50_us:.1f} µs"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-us", default="5,30", help="models' µs a batch, comma-separated")
    p.add_argument("--work-us", type=float, default=60.0, help="the loop's own work a request")
    p.add_argument("--idle-spin-us", type=float, default=200.0)
    p.add_argument("--requests", type=int, default=4000)
    args = p.parse_args()
    for us in (float(u) for u in args.model_us.split(",")):
        print(run(us, args.work_us, args.idle_spin_us, args.requests), flush=True)


if __name__ == "__main__":
    main()
