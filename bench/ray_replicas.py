"""Ray Serve on one node: 4 replicas through one shmbatch engine, beside 4
replicas each batching alone with @serve.batch and its own model copy.

    python bench/ray_replicas.py [--replicas 4] [--concurrency 64] [--seconds 10]

Both serve the synthetic backend (fixed_ms + per_item_us a row, busy-waiting:
the cost model of a model that holds its core) under the same closed-loop
load: --concurrency callers in one asyncio driver, each sending its next
request through the deployment's handle as soon as its answer came, every
answer checked against its own request. The engine row is
engine.ray.deployment (one engine, its --instances batcher(s), shared by the
replicas); the baseline row is a deployment whose replicas each call the
backend in @serve.batch (max_batch_size and batch_wait_timeout_s the
engine's max_batch_size and max_delay_ms). They run one after the other in
one Ray instance, each after --warmup-s of the same load. Prints one JSON
row per setup: requests/s, latency percentiles, mean batch size, model copies.
"""
import argparse
import asyncio
import json
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHAPE = (16,)


def baseline_app(replicas: int, backend_args: dict, max_batch_size: int, wait_s: float,
                 max_ongoing: int):
    from ray import serve

    from engine import backends

    @serve.deployment(num_replicas=replicas, max_ongoing_requests=max_ongoing,
                      ray_actor_options={"num_cpus": 0})
    class SelfBatching:
        def __init__(self):
            self.model = backends.synthetic(**backend_args)  # this replica's own copy
            self.batches = self.rows = 0

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=wait_s)
        async def infer(self, xs):
            self.batches, self.rows = self.batches + 1, self.rows + len(xs)
            return list(self.model(np.stack(xs)))

        def batch_counts(self):
            """(this replica's id, its batches, their rows)."""
            return serve.get_replica_context().replica_id.unique_id, self.batches, self.rows

    return SelfBatching.bind()


async def closed_loop(handle, concurrency: int, seconds: float, warmup_s: float) -> dict:
    """Requests/s and latency percentiles of `concurrency` callers for
    `seconds`, after warmup_s of the same; every answer checked."""
    lat, wrong = [], 0
    t_start = time.perf_counter()
    t_count = t_start + warmup_s
    t_end = t_count + seconds

    async def caller(i: int) -> None:
        nonlocal wrong
        n = 0
        while True:
            x = np.full(SHAPE, i * 1_000 + n % 1_000, np.float32)
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            y = await handle.infer.remote(x)
            t1 = time.perf_counter()
            wrong += not np.array_equal(y, x * 2 + 1)
            if t0 >= t_count:
                lat.append(t1 - t0)
            n += 1

    await asyncio.gather(*(caller(i) for i in range(concurrency)))
    ms = np.array(lat) * 1e3
    return {"requests": len(lat), "wrong": wrong, "requests_per_s": round(len(lat) / seconds, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def engine_batches(app: str) -> tuple:
    """(batches, rows) of every engine of application `app`."""
    from engine.segment import Segment
    from engine.serving import metrics
    batches = rows = 0
    for path in pathlib.Path("/dev/shm").glob(f"shmbatch-{app}-*"):
        seg = Segment.attach(path.name[len("shmbatch-"):])
        try:
            s = metrics.read_stats(seg)
        finally:
            seg.close()
        batches += s["batches_total"]
        rows += sum(n * c for n, c in s["batch_size_counts"].items())
    return batches, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--fixed-ms", type=float, default=2.0)
    p.add_argument("--per-item-us", type=float, default=100.0)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-delay-ms", type=float, default=0.0)
    p.add_argument("--instances", type=int, default=1, help="the engine's batchers")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count())
    args = p.parse_args()

    # Ray's workers import engine from this tree, installed or not
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    sys.path.insert(0, str(ROOT))
    import ray
    from ray import serve

    from engine.ray import deployment

    backend_args = {"fixed_ms": args.fixed_ms, "per_item_us": args.per_item_us}
    max_ongoing = max(1, -(-args.concurrency // args.replicas)) * 2  # no replica turns callers away
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR")
    rows = []
    try:
        serve.start(proxy_location="Disabled")
        setups = {
            "shmbatch engine": deployment(
                "bench-shm", engine=dict(
                    backend="engine.backends:synthetic", backend_args=backend_args,
                    input_shape=SHAPE, output_shape=SHAPE, max_batch_size=args.max_batch_size,
                    max_delay_ms=args.max_delay_ms, instances=args.instances,
                    queue_capacity=max(1024, 2 * args.concurrency)),
                num_replicas=args.replicas, max_ongoing_requests=max_ongoing,
                ray_actor_options={"num_cpus": 0}),
            "@serve.batch": baseline_app(args.replicas, backend_args, args.max_batch_size,
                                         args.max_delay_ms / 1e3, max_ongoing),
        }
        for label, app in setups.items():
            name = "bench-shm" if label == "shmbatch engine" else "bench-self"
            handle = serve.run(app, name=name, route_prefix=None)
            before = engine_batches(name) if name == "bench-shm" else None  # warmup included
            row = asyncio.run(closed_loop(handle, args.concurrency, args.seconds,
                                          args.warmup_s))
            if before is not None:
                batches, items = (a - b for a, b in zip(engine_batches(name), before))
                copies = args.instances
            else:  # warmup included: each replica's own counts, until every one has said
                seen = {}
                for _ in range(100 * args.replicas):
                    replica, b, n = handle.batch_counts.remote().result(timeout_s=30)
                    seen[replica] = (b, n)
                    if len(seen) == args.replicas:
                        break
                batches = sum(b for b, _ in seen.values())
                items = sum(n for _, n in seen.values())
                copies = args.replicas
            row.update(setup=label, replicas=args.replicas, model_copies=copies,
                       concurrency=args.concurrency, mean_batch=round(items / max(batches, 1), 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
            serve.delete(name)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0 if rows and all(r["wrong"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
