"""gRPC against HTTP binary, side by side in one run: `shmbatch serve --http-port 0
--grpc-port 0` (1 HTTP worker, which runs both servers), synthetic backend (2 ms + 100 µs per
item), float32[F] in and out (F = --floats, 16 by default), max_batch_size 32.

    python bench/grpc_vs_http.py [--concurrency 1,32,64] [--seconds 5] [--rounds 2]
    python bench/grpc_vs_http.py --floats 262144 --concurrency 1,8 --rounds 3   # 1 MiB rows

A row: C callers in one load process (tritonclient.grpc.aio, or tritonclient.http.aio with
binary tensor data both ways; gRPC sends raw_input_contents), each sending its next one-row
infer once answered (a closed loop) for --seconds; the two protocols alternate at each C, round after round. Per row:
requests/s, latency p50/p99 (each call's own clock), and the CPU time per request of the
worker process that carried them (user + system, read before and after). Every answer is
checked against its own request (2x + 1 of a caller's own input): a wrong one is counted.
"""
import argparse
import asyncio
import os
import platform
import re
import subprocess
import sys
import time

import numpy as np
import psutil


def serve(name: str, floats: int):
    # a queue of 64 rows: 1024 (the default) of 1 MiB rows would take 2 GiB of /dev/shm
    queue = ["--queue-capacity", "64"] if floats > 4096 else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--name", name,
         "--backend", "engine.backends:synthetic", "--backend-arg", "fixed_ms=2.0",
         "--backend-arg", "per_item_us=100.0", "--input-shape", str(floats),
         "--output-shape", str(floats), "--max-batch-size", "32", *queue, "--http-port", "0",
         "--grpc-port", "0", "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True,
        cwd="/tmp",
        env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("serve exited before it was ready")
        if "ready" in line:
            found = re.search(r"http://(\S+) and gRPC (\S+)$", line.strip())
            worker = next(p for p in psutil.Process(proc.pid).children()
                          if "engine.http.worker" in " ".join(p.cmdline()))
            return proc, found.group(1), found.group(2), worker
    raise RuntimeError("serve not ready within 120 s")


async def grpc_loop(name, address, callers: int, seconds: float, floats: int):
    import tritonclient.grpc.aio as client_module
    async with client_module.InferenceServerClient(address) as c:
        return await closed_loop(c.infer, client_module, name, callers, seconds, floats, {})


async def http_loop(name, address, callers: int, seconds: float, floats: int):
    import tritonclient.http.aio as client_module
    c = client_module.InferenceServerClient(address, conn_limit=callers)
    try:
        return await closed_loop(c.infer, client_module, name, callers, seconds, floats,
                                 {"binary_data": True})
    finally:
        await c.close()


async def closed_loop(infer, module, name, callers, seconds, floats, binary):
    latencies, wrong = [], [0]
    end = time.monotonic() + seconds

    async def caller(k: int) -> None:
        x = np.full((1, floats), k, np.float32) + np.arange(floats, dtype=np.float32)
        given = module.InferInput("INPUT", [1, floats], "FP32")
        given.set_data_from_numpy(x, **binary)
        asked = ([module.InferRequestedOutput("OUTPUT", **binary)] if binary else None)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            got = await infer(name, [given], outputs=asked)
            latencies.append(time.perf_counter() - t0)
            if not np.array_equal(got.as_numpy("OUTPUT"), x * 2 + 1):
                wrong[0] += 1

    await asyncio.gather(*(caller(k) for k in range(callers)))
    return latencies, wrong[0]


def row(kind, name, address, worker, callers, seconds, floats) -> str:
    loop = grpc_loop if kind == "grpc" else http_loop
    cpu0, t0 = worker.cpu_times(), time.monotonic()
    latencies, wrong = asyncio.run(loop(name, address, callers, seconds, floats))
    wall, cpu1 = time.monotonic() - t0, worker.cpu_times()
    n = len(latencies)
    cpu_us = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / n * 1e6
    ms = np.percentile(np.array(latencies) * 1e3, [50, 99])
    return (f"c={callers:<3d} {kind:>4}: {n / wall:8.1f} req/s | p50 {ms[0]:7.2f} ms p99 "
            f"{ms[1]:7.2f} ms | worker CPU {cpu_us:6.0f} µs/req | {n} requests | wrong {wrong}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,32,64")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--floats", type=int, default=16, help="float32 values a row, in and out")
    args = p.parse_args()
    name = f"grpcbench{os.getpid()}"
    proc, http_at, grpc_at, worker = serve(name, args.floats)
    print(f"{platform.node()}: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
          f"float32[{args.floats}] rows ({args.floats * 4:,} B); HTTP {http_at}, gRPC {grpc_at}",
          flush=True)
    try:
        for kind, at in (("grpc", grpc_at), ("http", http_at)):  # warm both paths
            row(kind, name, at, worker, 4, 1.0, args.floats)
        for r in range(args.rounds):
            for callers in [int(c) for c in args.concurrency.split(",")]:
                for kind, at in (("grpc", grpc_at), ("http", http_at)):
                    print(f"round {r + 1} " + row(kind, name, at, worker, callers,
                                                  args.seconds, args.floats), flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    left = [e for e in os.listdir("/dev/shm") if name in e]
    print(f"left in /dev/shm: {left or 'nothing'}; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
