"""The Open Inference Protocol's HTTP layer, measured: `hey` against `shmbatch serve
--http-port` with 4 HTTP workers and, in the same run, the same closed-loop load through
`Client` in 4 worker processes; synthetic backend (2 ms + 100 µs per item), max_batch_size 32.

    python bench/http_load.py [--concurrency 4,16,64] [--requests 4000] [--workers 4]
                              [--out FILE.json] [--tree DIR] [--no-client]

A row at concurrency C: `hey -c C` (C keep-alive connections, each sending its next JSON
infer once answered), then C threads spread over the worker processes, each calling
Client.infer in a loop (the same closed loop, without HTTP). Per row: requests/s, latency
p50/p99 (from hey's per-request CSV, and each Client call's own clock), the batch sizes the
engine formed (its counters, read before and after), and the CPU time per request of the
processes that carried the requests: the HTTP workers, or the Client processes. The HTTP
layer's own cost per request is the difference of the two mean latencies, and of the two
CPU times. --tree: serve from another source tree of shmbatch (its engine/_ringc built, the
same segment layout), e.g. a worktree of an earlier commit; --no-client: the hey rows alone.
"""
import argparse
import csv
import io
import json
import multiprocessing
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil

from engine.segment import Segment
from engine.serving import metrics

ROOT = pathlib.Path(__file__).resolve().parent.parent
X = np.arange(16, dtype=np.float32)


def serve(name: str, workers: int, tree: pathlib.Path):
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--name", name,
         "--backend", "engine.backends:synthetic", "--backend-arg", "fixed_ms=2.0",
         "--backend-arg", "per_item_us=100.0", "--input-shape", "16", "--output-shape", "16",
         "--max-batch-size", "32", "--http-port", "0", "--http-workers", str(workers),
         "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("serve exited before it was ready")
        if "ready" in line:
            url = re.search(r"http://(\S+)$", line.strip()).group(1)
            workers_now = [p for p in psutil.Process(proc.pid).children()
                           if "engine.http.worker" in " ".join(p.cmdline())]
            return proc, url, workers_now
    raise TimeoutError("serve not ready within 120 s")


def engine_counts(name: str):
    seg = Segment.attach(name)
    try:
        s = metrics.read_stats(seg)
    finally:
        seg.close()
    return s["batches_total"], s["answered_total"], dict(s["batch_size_counts"])


def batches_between(before, after) -> dict:
    batches, answered = after[0] - before[0], after[1] - before[1]
    sizes = {n: c - before[2].get(n, 0) for n, c in after[2].items() if c - before[2].get(n, 0)}
    return {"batches": batches, "avg_batch": answered / batches if batches else 0.0,
            "largest_batch": max(sizes) if sizes else 0}


def cpu_s(procs) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def summary(latencies_s: np.ndarray, wall_s: float, n: int, failed: int) -> dict:
    ms = latencies_s * 1e3
    return {"requests": n, "failed": failed, "rps": n / wall_s,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean())}


def run_hey(url: str, name: str, concurrency: int, n: int, body_path: str) -> dict:
    out = subprocess.run(
        ["hey", "-n", str(n), "-c", str(concurrency), "-m", "POST", "-T", "application/json",
         "-D", body_path, "-o", "csv", f"http://{url}/v2/models/{name}/infer"],
        capture_output=True, text=True, check=True, timeout=600)
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    latency = np.array([float(r["response-time"]) for r in rows])
    offsets = np.array([float(r["offset"]) for r in rows])
    failed = sum(r["status-code"] != "200" for r in rows)
    return summary(latency, float((offsets + latency).max()), len(rows), failed)


def client_process(name: str, threads: int, per_thread: int, ready, start, out) -> None:
    import engine
    client = engine.Client(name)
    ready.put(os.getpid())
    latencies = [[] for _ in range(threads)]
    failed = [0] * threads

    def loop(i):
        x = X.copy()
        start.wait()
        for _ in range(per_thread):
            t = time.perf_counter()
            try:
                y = client.infer(x, timeout=30)
                if not np.array_equal(y, x * 2 + 1):
                    failed[i] += 1
            except engine.EngineError:
                failed[i] += 1
            latencies[i].append(time.perf_counter() - t)

    pool = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put((sum(latencies, []), sum(failed), time.time()))


def run_clients(name: str, concurrency: int, n: int, processes: int):
    ctx = multiprocessing.get_context("spawn")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    threads = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    per_thread = n // concurrency
    procs = [ctx.Process(target=client_process, args=(name, t, per_thread, ready, start, out))
             for t in threads if t]
    for p in procs:
        p.start()
    for _ in procs:  # each has attached; then all start at once
        ready.get(timeout=120)
    ps = [psutil.Process(p.pid) for p in procs]
    cpu0, began = cpu_s(ps), time.time()
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    cpu1 = cpu_s(ps)
    for p in procs:
        p.join(60)
    latency = np.array(sum((r[0] for r in results), []))
    wall = max(r[2] for r in results) - began
    return summary(latency, wall, len(latency), sum(r[1] for r in results)), cpu1 - cpu0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="4,16,64")
    ap.add_argument("--requests", type=int, default=4000, help="per row")
    ap.add_argument("--workers", type=int, default=4, help="HTTP workers, and Client processes")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--tree", type=pathlib.Path, default=ROOT, help="the source tree serve runs")
    ap.add_argument("--no-client", action="store_true", help="the hey rows alone")
    args = ap.parse_args()
    if shutil.which("hey") is None:
        raise SystemExit("needs hey (apt-get install hey)")
    name = f"httpload-{os.getpid()}"
    proc, url, http_procs = serve(name, args.workers, args.tree)
    rows = []
    try:
        body = {"inputs": [{"name": "INPUT", "shape": [1, 16], "datatype": "FP32",
                            "data": X.tolist()}]}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(body, f)
        run_hey(url, name, 4, 400, f.name)  # warm-up: connections, imports, the admission fit
        print(f"serve: synthetic 2 ms + 100 us/item, max_batch_size 32, {args.workers} HTTP "
              f"workers; {args.requests} requests a row; {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}")
        for c in [int(v) for v in args.concurrency.split(",")]:
            before, cpu0 = engine_counts(name), cpu_s(http_procs)
            h = run_hey(url, name, c, args.requests, f.name)
            h["cpu_us_per_request"] = (cpu_s(http_procs) - cpu0) / h["requests"] * 1e6
            h.update(batches_between(before, engine_counts(name)))
            if args.no_client:
                rows.append({"concurrency": c, "http": h})
                print(f"c={c:<3} HTTP (hey): {h['rps']:7,.0f} req/s  p50 {h['p50_ms']:6.2f} ms  "
                      f"p99 {h['p99_ms']:6.2f} ms  avg batch {h['avg_batch']:5.1f} (largest "
                      f"{h['largest_batch']})  cpu {h['cpu_us_per_request']:5.0f} us/req  "
                      f"failed {h['failed']}", flush=True)
                continue
            before = engine_counts(name)
            k, k_cpu = run_clients(name, c, args.requests, args.workers)
            k["cpu_us_per_request"] = k_cpu / k["requests"] * 1e6
            k.update(batches_between(before, engine_counts(name)))
            row = {"concurrency": c, "http": h, "client": k,
                   "http_cost_ms": h["mean_ms"] - k["mean_ms"],
                   "http_cpu_us": h["cpu_us_per_request"] - k["cpu_us_per_request"]}
            rows.append(row)
            for label, r in (("HTTP (hey)", h), ("Client", k)):
                print(f"c={c:<3} {label:>10}: {r['rps']:7,.0f} req/s  p50 {r['p50_ms']:6.2f} ms  "
                      f"p99 {r['p99_ms']:6.2f} ms  mean {r['mean_ms']:6.2f} ms  "
                      f"avg batch {r['avg_batch']:5.1f} (largest {r['largest_batch']})  "
                      f"cpu {r['cpu_us_per_request']:5.0f} us/req  failed {r['failed']}",
                      flush=True)
            print(f"c={c:<3} HTTP's own cost: {row['http_cost_ms'] * 1e3:,.0f} us per request "
                  f"(mean latency), {row['http_cpu_us']:,.0f} us of CPU", flush=True)
        os.unlink(f.name)
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
    finally:
        proc.terminate()
        proc.wait(120)
    if args.out:
        commit = subprocess.run(["git", "-C", str(args.tree), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        with open(args.out, "w") as f:
            json.dump({"commit": commit, "machine": platform.platform(),
                       "cpus": os.cpu_count(), "rows": rows}, f, indent=2)
    return 0 if all(r["http"]["failed"] + r.get("client", {"failed": 0})["failed"] == 0
                    for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
