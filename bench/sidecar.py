"""The sidecar scenario: a WSGI app under gunicorn (4 workers) answering HTTP
through a `shmbatch serve` sidecar, against the same app with the model
called inside each worker (no sidecar, no batching). Same synthetic backend,
same open-loop Poisson HTTP load on 127.0.0.1, side by side in one run.

    python bench/sidecar.py [--rate 1200] [--requests 2400] [--workers 4]

The load generator is asyncio, one connection per request (so a slow answer
never delays the next arrival), in --senders processes; latency is counted
from each request's scheduled time.
"""
import argparse
import asyncio
import json
import multiprocessing
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

from engine.tools import load

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(stream, needle: str, count: int = 1, timeout_s: float = 60.0) -> None:
    import selectors
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    deadline, seen = time.monotonic() + timeout_s, 0
    while seen < count:
        if not sel.select(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"no {needle!r} within {timeout_s} s")
        line = stream.readline()
        if not line:
            raise EOFError(f"stream closed before {needle!r}")
        seen += needle in line


def sender(port: int, rate: float, n: int, seed: int, start_ns: int, out) -> None:
    """Open-loop HTTP: request k goes at start + its Poisson offset, on its own connection."""
    due = start_ns + load.poisson_offsets_ns(rate, n, seed)
    done = np.zeros(n, np.int64)
    status = np.zeros(n, np.int32)

    async def one(k: int, body: bytes):
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            data = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            status[k] = int(data.split(b" ", 2)[1])
        except (OSError, asyncio.TimeoutError, ValueError, IndexError):
            status[k] = -1
        done[k] = time.monotonic_ns()

    async def main():
        loop = asyncio.get_running_loop()
        tasks = []
        for k in range(n):
            delay = (int(due[k]) - time.monotonic_ns()) / 1e9
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival schedule
            body = np.full(16, float(k), np.float32).tobytes()
            tasks.append(loop.create_task(one(k, body)))
        await asyncio.gather(*tasks)

    asyncio.run(main())
    out.put((due, done, status))


def drive(port: int, rate: float, requests: int, senders: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    start_ns = time.monotonic_ns() + 300_000_000
    per = load.split_requests(requests, senders)
    procs = [ctx.Process(target=sender, args=(port, rate / senders, per[i], 100 + i, start_ns, out))
             for i in range(senders)]
    for p in procs:
        p.start()
    results = [out.get(timeout=requests / rate * 20 + 120) for _ in procs]
    for p in procs:
        p.join(10)
    due, done, status = (np.concatenate([r[i] for r in results]) for i in range(3))
    ok = status == 200
    p = load.percentiles_ms(done[ok] - due[ok])
    span_s = max(1e-9, (done.max() - start_ns) / 1e9)
    return {"offered_rps": rate, "requests": int(len(status)), "ok": int(ok.sum()),
            "failed": int((~ok).sum()), "achieved_rps": int(ok.sum()) / span_s,
            "p50_ms": p["p50"], "p99_ms": p["p99"], "max_ms": p["max"]}


def gunicorn(name: str, workers: int, threads: int, in_worker: bool, fixed_ms: float,
             per_item_us: float):
    port = free_port()
    env = {**os.environ, "SHMBATCH_NAME": name, "SHMBATCH_IN_WORKER": "1" if in_worker else "0",
           "SHMBATCH_FIXED_MS": str(fixed_ms), "SHMBATCH_PER_ITEM_US": str(per_item_us)}
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "--preload", "-w", str(workers),
                             "--threads", str(threads),
                             "-b", f"127.0.0.1:{port}", "--backlog", "4096", "--chdir", str(TESTS),
                             "sidecar_app:app"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(proc.stderr, "Booting worker", count=workers)
    return proc, port


def stop(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=800.0)
    ap.add_argument("--requests", type=int, default=2400)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=8, help="gthread threads per worker")
    ap.add_argument("--senders", type=int, default=2)
    ap.add_argument("--fixed-ms", type=float, default=2.0)
    ap.add_argument("--per-item-us", type=float, default=100.0)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-delay-ms", type=float, default=4.0)
    ap.add_argument("--out", help="write DIR/sidecar.json and the status/metrics of the run")
    args = ap.parse_args()
    name = f"sidecar-{os.getpid()}"
    metrics_port = free_port()
    print(f"# synthetic {args.fixed_ms} ms + {args.per_item_us} us/item; sidecar max_batch_size "
          f"{args.max_batch_size} max_delay_ms {args.max_delay_ms:g}; gunicorn {args.workers} "
          f"workers x {args.threads} threads; open-loop HTTP {args.rate:g} req/s, {args.requests} requests; "
          f"{os.cpu_count()} cpus")
    serve = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--name", name, "--backend",
         "engine.backends:synthetic", "--backend-arg", f"fixed_ms={args.fixed_ms}",
         "--backend-arg", f"per_item_us={args.per_item_us}", "--input-shape", "16",
         "--output-shape", "16", "--max-batch-size", str(args.max_batch_size),
         "--max-delay-ms", str(args.max_delay_ms),
         "--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rows = {}
    try:
        wait_for(serve.stdout, "ready")
        for label, in_worker in (("sidecar (shmbatch)", False), ("model in each worker", True)):
            web, port = gunicorn(name, args.workers, args.threads, in_worker, args.fixed_ms,
                                 args.per_item_us)
            try:
                rows[label] = drive(port, args.rate, args.requests, args.senders)
            finally:
                stop(web)
            if not in_worker:
                status = subprocess.run([sys.executable, "-m", "engine", "status", name],
                                        capture_output=True, text=True).stdout
                metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                                 timeout=10).read().decode()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
    for label, r in rows.items():
        print(f"{label:>22}: offered {r['offered_rps']:>6.0f} req/s | served {r['achieved_rps']:>6.0f} req/s"
              f" | ok {r['ok']:>5} of {r['requests']}"
              f" | p50 {r['p50_ms']:>8.2f} ms p99 {r['p99_ms']:>8.2f} ms max {r['max_ms']:>8.2f} ms"
              f" | failed {r['failed']}")
    print("\n$ shmbatch status " + name + "\n" + status)
    wanted = ("shmbatch_requests_total", "shmbatch_batches_total", "shmbatch_batch_size_sum",
              "shmbatch_batch_size_count", "shmbatch_queue_wait_seconds_sum",
              "shmbatch_queue_wait_seconds_count", "shmbatch_queue_depth")
    print("$ curl /metrics (excerpt)")
    print("\n".join(line for line in metrics.splitlines() if line.startswith(wanted)))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sidecar.json"), "w") as f:
            json.dump({"rows": rows, "status": status, "metrics": metrics}, f, indent=2)


if __name__ == "__main__":
    main()
