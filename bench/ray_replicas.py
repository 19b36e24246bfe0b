"""Ray Serve on one node whose replicas share one device: one shmbatch engine for the node's
replicas, beside replicas each batching alone with @serve.batch and its own model copy.

    python bench/ray_replicas.py [--replicas 4,8] [--paths handle,http] [--concurrency 64]
                                 [--seconds 10] [--rounds 3] [--fixed-ms 2] [--per-item-us 50]
                                 [--weights-mib 256] [--out FILE.json]

The model (bench/shared_device.py) holds the node's one device: a batch of n takes it, under
a flock every copy on the node shares, for fixed_ms + n * per_item_us (sleeping: the host's
core is free meanwhile; --device-mode hold holds the flock that long, queue books the device's
timeline under it and sleeps after), and each copy allocates its own weights (weights_mib, every page
written). The engine row is engine.ray.deployment: the replicas are Clients of one node
engine, whose batcher is the one model copy. The baseline row is a deployment whose replicas
each load a copy and batch their own requests with @serve.batch (the same max_batch_size,
batch_wait_timeout_s the engine's max_delay_ms unless --baseline-wait-ms; the model called in
a thread, so that the replica's loop takes requests while its batch waits for the device).

Load: --concurrency callers in one asyncio driver, a closed loop (each sends its next request
once its answer came, every answer checked against its own request), through the
deployment's handle, or over HTTP (the Open Inference Protocol's infer body, one row, to
Serve's proxy on 127.0.0.1, one keep-alive connection a caller). A window is --warmup-s of
load, then --seconds counted. Each round deploys both applications at each replica count and
runs their windows alternately (the order flips every round), then deletes them. Per window:
requests/s, latency p50/p99, the device's busy share and mean batch (its own counters), the
machine's CPU busy share, the load average. Per deployment: the PSS of each process that holds
a model copy, and of the replicas. Medians over rounds at the end.
"""
import argparse
import asyncio
import json
import logging
import os
import pathlib
import statistics
import sys
import tempfile
import time

import numpy as np
import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = pathlib.Path(__file__).resolve().parent
SHAPE = (16,)
LOOPBACK = "127.0.0.1"
ENGINE, BASELINE = "shmbatch engine", "@serve.batch"
MIB = 2**20


def baseline_app(replicas: int, backend_args: dict, max_batch_size: int, wait_s: float,
                 max_ongoing: int):
    from ray import serve

    @serve.deployment(num_replicas=replicas, max_ongoing_requests=max_ongoing,
                      ray_actor_options={"num_cpus": 0})
    class SelfBatching:
        def __init__(self):
            import shared_device
            self.model = shared_device.load(**backend_args)  # this replica's own copy

        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=wait_s)
        async def infer(self, xs):
            batch = np.stack(xs)
            ys = await asyncio.get_running_loop().run_in_executor(None, self.model, batch)
            return list(ys)

        async def __call__(self, request):
            """An Open Inference Protocol infer of one row, answered as the engine's route does."""
            from starlette.responses import JSONResponse
            t = (await request.json())["inputs"][0]
            x = np.asarray(t["data"], np.float32).reshape(t["shape"])
            y = np.stack([await self.infer(row) for row in x])
            return JSONResponse({"model_name": "self", "model_version": "1", "outputs": [
                {"name": "OUTPUT", "datatype": "FP32", "shape": list(y.shape),
                 "data": y.ravel().tolist()}]})

    return SelfBatching.bind()


def engine_app(name: str, replicas: int, backend_args: dict, max_batch_size: int,
               max_delay_ms: float, concurrency: int, max_ongoing: int):
    from engine.ray import deployment
    return deployment(name, engine=dict(
        backend="shared_device:load", backend_args=backend_args, input_shape=SHAPE,
        output_shape=SHAPE, max_batch_size=max_batch_size, max_delay_ms=max_delay_ms,
        queue_capacity=max(1024, 2 * concurrency)),
        num_replicas=replicas, max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": 0})


def cpu_busy(before, after) -> float:
    """The machine's CPU busy share between two psutil.cpu_times()."""
    idle = (after.idle + after.iowait) - (before.idle + before.iowait)
    total = sum(after) - sum(before)
    return 1.0 - idle / total if total > 0 else 0.0


async def closed_loop(send, concurrency: int, seconds: float, warmup_s: float,
                      lock_path: str) -> dict:
    """`concurrency` callers, each awaiting send(x) -> (ok, y) in a loop for warmup_s, then
    `seconds` counted: requests/s, latency percentiles, the device's and CPUs' busy shares."""
    import shared_device
    lat, wrong = [], 0
    t_count = time.perf_counter() + warmup_s
    t_end = t_count + seconds
    marks = {}

    async def caller(i: int) -> None:
        nonlocal wrong
        n = 0
        while True:
            x = np.full(SHAPE, i * 1_000 + n % 1_000, np.float32)
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            ok, y = await send(x)
            t1 = time.perf_counter()
            wrong += not (ok and np.array_equal(y, x * 2 + 1))
            if t0 >= t_count:
                lat.append(t1 - t0)
            n += 1

    async def mark(at: float, key: str) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        marks[key] = (time.perf_counter_ns(), shared_device.read_counters(lock_path),
                      psutil.cpu_times())

    await asyncio.gather(mark(t_count, "start"), mark(t_end, "end"),
                         *(caller(i) for i in range(concurrency)))
    (t0_ns, (busy0, b0, r0), cpu0), (t1_ns, (busy1, b1, r1), cpu1) = marks["start"], marks["end"]
    batches = max(b1 - b0, 1)
    ms = np.array(lat) * 1e3 if lat else np.zeros(1)
    return {"requests": len(lat), "wrong": wrong, "requests_per_s": round(len(lat) / seconds, 1),
            "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "device_busy": round((busy1 - busy0) / (t1_ns - t0_ns), 3),
            "mean_batch": round((r1 - r0) / batches, 2),
            "device_ms_per_batch": round((busy1 - busy0) / batches / 1e6, 3),
            "cpu_busy": round(cpu_busy(cpu0, cpu1), 3)}


def handle_sender(handle):
    async def send(x):
        return True, await handle.infer.remote(x)
    return send


def http_sender(session, url: str):
    async def send(x):
        body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, *SHAPE],
                            "data": x.tolist()}]}
        async with session.post(url, json=body) as r:
            if r.status != 200:
                await r.read()
                return False, None
            answer = await r.json()
        return True, np.asarray(answer["outputs"][0]["data"], np.float32)
    return send


async def window(path: str, app: str, route: str, port: int, args, lock_path: str) -> dict:
    from ray import serve
    if path == "handle":
        send = handle_sender(serve.get_app_handle(app))
        return await closed_loop(send, args.concurrency, args.seconds, args.warmup_s, lock_path)
    import aiohttp
    connector = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        send = http_sender(session, f"http://{LOOPBACK}:{port}{route}")
        return await closed_loop(send, args.concurrency, args.seconds, args.warmup_s, lock_path)


def replica_pids(app: str) -> list:
    """The processes of application `app`'s replicas (Ray titles them by their actor)."""
    pids = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if f"ServeReplica:{app}:" in cmd:
            pids.append(p.pid)
    return pids


def pss_mib(pids) -> list:
    out = []
    for pid in pids:
        try:
            out.append(round(psutil.Process(pid).memory_full_info().pss / MIB, 1))
        except psutil.Error:
            out.append(None)
    return out


def engine_pids(app: str) -> tuple:
    """(supervisor pid, batcher pids) of application `app`'s node engine."""
    import ray
    from engine.ray.owner import NAMESPACE, actor_name
    from engine.ray.replica import engine_name
    name = engine_name(app, app, ray.get_runtime_context().get_node_id())
    owner = ray.get_actor(actor_name(name), namespace=NAMESPACE)
    sup = ray.get(owner.status.remote(), timeout=30)["supervisor_pid"]
    return sup, [c.pid for c in psutil.Process(sup).children(recursive=True)]


def memory(setup: str, app: str) -> dict:
    replicas = pss_mib(replica_pids(app))
    row = {"setup": setup, "replicas_pss_mib": replicas}
    if setup == ENGINE:
        sup, batchers = engine_pids(app)
        row.update(supervisor_pss_mib=pss_mib([sup])[0], batchers_pss_mib=pss_mib(batchers))
        row["model_copies"] = len(batchers)
        row["total_pss_mib"] = round(sum(replicas) + row["supervisor_pss_mib"] +
                                     sum(row["batchers_pss_mib"]), 1)
    else:
        row["model_copies"] = len(replicas)
        row["total_pss_mib"] = round(sum(replicas), 1)
    return row


def summary(rows: list) -> list:
    """Per (replicas, path, setup): the median of each figure over rounds, each round's req/s,
    and the engine's req/s over the baseline's, round by round."""
    keys = sorted({(r["replicas"], r["path"], r["setup"]) for r in rows if "path" in r})
    out = []
    for key in keys:
        mine = [r for r in rows if (r.get("replicas"), r.get("path"), r.get("setup")) == key]
        med = {f: statistics.median(r[f] for r in mine)
               for f in ("requests_per_s", "p50_ms", "p99_ms", "device_busy", "mean_batch",
                         "device_ms_per_batch", "cpu_busy")}
        out.append({"replicas": key[0], "path": key[1], "setup": key[2], "median": med,
                    "rounds_req_per_s": [r["requests_per_s"] for r in mine],
                    "wrong": sum(r["wrong"] for r in mine)})
    for s in out:
        if s["setup"] == ENGINE:
            base = next(b for b in out if b["setup"] == BASELINE
                        and (b["replicas"], b["path"]) == (s["replicas"], s["path"]))
            s["over_baseline"] = [round(e / b, 2) for e, b in
                                  zip(s["rounds_req_per_s"], base["rounds_req_per_s"])]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", default="4,8")
    p.add_argument("--paths", default="handle,http")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fixed-ms", type=float, default=2.0)
    p.add_argument("--per-item-us", type=float, default=50.0)
    p.add_argument("--weights-mib", type=int, default=256)
    p.add_argument("--device-mode", choices=("hold", "queue"), default="hold",
                   help="hold: the flock held for the batch's cost; queue: it guards the "
                        "device's timeline (bench/shared_device.py)")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--max-delay-ms", type=float, default=0.0)
    p.add_argument("--baseline-wait-ms", type=float, default=None,
                   help="@serve.batch's batch_wait_timeout_s, in ms (default: --max-delay-ms); "
                        "Serve forms a batch before the previous one is done, so with 0 a "
                        "backlog waits as batches of one")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count())
    p.add_argument("--out", help="every row, as JSON")
    args = p.parse_args()
    counts = [int(n) for n in args.replicas.split(",")]
    baseline_wait_ms = args.max_delay_ms if args.baseline_wait_ms is None \
        else args.baseline_wait_ms
    paths = args.paths.split(",")

    # Ray's processes listen on loopback only (as tests/conftest.py sets), and its workers
    # import engine from this tree and the model from bench/
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(BENCH)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                   else []))
    sys.path[:0] = [str(ROOT), str(BENCH)]
    import ray
    from ray import serve
    import shared_device
    # a saturated 2-core host answers the router's queue-length probes late: a warning each
    logging.getLogger("ray.serve").setLevel(logging.ERROR)

    tag = f"rb{os.getpid()}"
    scratch = tempfile.mkdtemp(prefix=f"{tag}-")
    port = _free_port()
    rows: list = []
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
             logging_level="ERROR", _node_ip_address=LOOPBACK,
             object_store_memory=128 * MIB)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": LOOPBACK, "port": port})
        for rnd in range(1, args.rounds + 1):
            for n in counts:
                max_ongoing = max(1, -(-args.concurrency // n)) * 2  # no replica turns callers away
                apps = {}
                for setup, short in ((ENGINE, "shm"), (BASELINE, "self")):
                    lock = os.path.join(scratch, f"{short}{n}.device")
                    shared_device.create(lock)
                    backend_args = {"lock_path": lock, "fixed_ms": args.fixed_ms,
                                    "per_item_us": args.per_item_us,
                                    "weights_mib": args.weights_mib,
                                    "mode": args.device_mode}
                    app = f"{tag}-{short}{n}"
                    bound = engine_app(app, n, backend_args, args.max_batch_size,
                                       args.max_delay_ms, args.concurrency, max_ongoing) \
                        if setup == ENGINE else \
                        baseline_app(n, backend_args, args.max_batch_size,
                                     baseline_wait_ms / 1e3, max_ongoing)
                    t0 = time.perf_counter()
                    serve.run(bound, name=app, route_prefix=f"/{app}")
                    apps[setup] = (app, lock)
                    print(json.dumps({"round": rnd, "replicas": n, "setup": setup,
                                      "deployed_s": round(time.perf_counter() - t0, 1)}),
                          flush=True)
                order = [ENGINE, BASELINE] if rnd % 2 else [BASELINE, ENGINE]
                for path in paths:
                    for setup in order:
                        app, lock = apps[setup]
                        load = os.getloadavg()
                        row = asyncio.run(window(path, app, f"/{app}", port, args, lock))
                        row.update(round=rnd, replicas=n, path=path, setup=setup,
                                   concurrency=args.concurrency, device=args.device_mode,
                                   load_1m=round(load[0], 2))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                for setup in order:
                    m = memory(setup, apps[setup][0])
                    m.update(round=rnd, replicas=n)
                    rows.append(m)
                    print(json.dumps(m), flush=True)
                for app, lock in apps.values():
                    serve.delete(app)
                    os.remove(lock)
        result = summary(rows)
        for s in result:
            print(json.dumps(s), flush=True)
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows,
                                                          "summary": result}, indent=1))
    finally:
        serve.shutdown()
        ray.shutdown()
        for f in pathlib.Path(scratch).iterdir():
            f.unlink()
        os.rmdir(scratch)
    return 0 if rows and all(r.get("wrong", 0) == 0 for r in rows) else 1


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
