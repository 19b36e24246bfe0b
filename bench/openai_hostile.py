"""The OpenAI routes under hostile callers, beside the same streams in quiet.

    python bench/openai_hostile.py [--seconds 10] [--streams 8] [--tree DIR]
                                   [--hostile embeddings,stops,id] [--out FILE.json]

One `shmbatch serve` with ONE HTTP worker serves an iterative engine (the
tests' Echo step model, 2 ms a step; its prompt of at most 64 tokens answered
back, then eos) and an embeddings engine (inputs of at most 32 tokens, a
queue of 16384), both through a byte-level tokenizer. --streams callers each stream completions one after
another (max_tokens 16) for --seconds, twice: first alone (quiet), then
while three callers send, one request after another:
- /v1/embeddings with one 30 MB string as its input,
- /v1/completions whose answer keeps matching the start of its 16 stop
  strings of 4 KB each (a 64 KB body),
- generate_stream with a 60 KB request id (under the route's body limit).
Per phase: each stream's time to its first token (p50, p99), the worker's
peak resident memory, and the hostile callers' answers by status. --tree
serves from another source tree of shmbatch (its engine/_ringc built).
"""
import argparse
import http.client
import json
import multiprocessing
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = """http_workers = 1
[engines.hostile-echo]
backend = "openai_models:echo"
backend_args = {step_ms = 2.0}
iterative = true
input_shape = ["none"]
max_input_shape = [64]
input_dtype = "int64"
output_shape = []
output_dtype = "int64"
max_steps = 128
max_batch_size = 32
[engines.hostile-echo.openai]
tokenizer = "openai_models:bytes_tokenizer"
model = "echo"
[engines.hostile-embed]
backend = "openai_models:embedder"
input_shape = ["none"]
max_input_shape = [32]
input_dtype = "int64"
output_shape = [4]
output_dtype = "float32"
queue_capacity = 16384
[engines.hostile-embed.openai]
tokenizer = "openai_models:bytes_tokenizer"
model = "embed"
"""


def serve(folder: pathlib.Path, tree: pathlib.Path):
    path = folder / "models.toml"
    path.write_text(CONFIG)
    env = {**os.environ, "PYTHONPATH": f"{tree}:{ROOT / 'tests'}"}
    # run in the folder: `python -m` puts the working directory first on the path
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--config", str(path),
                             "--http-port", "0", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=folder)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("serve exited before it was ready")
        if "ready" in line:
            host, port = re.search(r"http://(\S+)$", line.strip()).group(1).rsplit(":", 1)
            return proc, host, int(port)
    raise TimeoutError("serve not ready within 120 s")


def worker_of(serve_pid: int) -> psutil.Process:
    """serve's HTTP worker (its one child that runs uvicorn)."""
    for child in psutil.Process(serve_pid).children(recursive=True):
        if any("engine.http.worker" in part for part in child.cmdline()):
            return child
    raise RuntimeError("no HTTP worker found")


def post(address, path: str, body: bytes, timeout_s: float = 120):
    conn = http.client.HTTPConnection(*address, timeout=timeout_s)
    conn.request("POST", path, body, {"content-type": "application/json"})
    return conn, conn.getresponse()


def one_stream(address) -> float:
    """Seconds to the first token of one streamed completion (read to its end)."""
    begun = time.monotonic()
    conn, response = post(address, "/v1/completions", json.dumps(
        {"model": "echo", "prompt": "hello, world", "max_tokens": 16, "stream": True}).encode())
    first = None
    try:
        for line in response:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - begun
            if line.startswith(b"data: [DONE]"):
                break
    finally:
        conn.close()
    if first is None or response.status != 200:
        raise RuntimeError(f"a stream answered {response.status} with no token")
    return first


def phase(address, seconds: float, streams: int, worker: psutil.Process) -> dict:
    ttft, peak = [], [worker.memory_info().rss]
    stop_at = time.monotonic() + seconds

    def caller() -> None:
        while time.monotonic() < stop_at:
            ttft.append(one_stream(address))

    threads = [threading.Thread(target=caller) for _ in range(streams)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak.append(worker.memory_info().rss)
        time.sleep(0.05)
    ms = np.array(ttft) * 1e3
    return {"streams": len(ttft), "ttft_p50_ms": float(np.percentile(ms, 50)),
            "ttft_p99_ms": float(np.percentile(ms, 99)), "worker_peak_mib": max(peak) / 2**20}


def hostile_bodies(engine: str) -> dict:
    stops = [("a" * 4095) + chr(0x62 + i) for i in range(16)]
    return {
        "embeddings 30 MB": ("/v1/embeddings", json.dumps(
            {"model": "embed", "input": "x" * (30 << 20)}).encode()),
        "stops 16 x 4 KB": ("/v1/completions", json.dumps(
            {"model": "echo", "prompt": "a" * 63, "stop": stops}).encode()),
        "id 60 KB": (f"/v2/models/{engine}/generate_stream", json.dumps(
            {"INPUT": [97] * 8, "id": "i" * (60 << 10)}).encode()),
    }


def hostile(address, engine: str, kinds, stopping, out) -> None:
    """The hostile callers, a thread each sending one request after another
    until `stopping` is set; their answers by status put on `out`. Run in a
    process of its own, so that its threads cost the measured streams'
    process nothing."""
    answers: dict = {}

    def send(kind: str, path: str, body: bytes) -> None:
        counts = answers.setdefault(kind, {})
        while not stopping.is_set():
            try:
                conn, response = post(address, path, body)
                try:
                    answer = response.read()
                finally:
                    conn.close()
                status = str(response.status)
                counts["largest answer B"] = max(counts.get("largest answer B", 0), len(answer))
                if response.status != 200:
                    counts.setdefault(f"a {status}", answer[:160].decode(errors="replace"))
            except OSError as e:
                status = type(e).__name__
            counts[status] = counts.get(status, 0) + 1

    threads = [threading.Thread(target=send, args=(kind, *request), daemon=True)
               for kind, request in hostile_bodies(engine).items() if kind.split()[0] in kinds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    out.put(answers)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tree", type=pathlib.Path, default=ROOT)
    p.add_argument("--hostile", default="embeddings,stops,id",
                   help="the hostile callers to run: some of embeddings, stops, id")
    p.add_argument("--out")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        proc, host, port = serve(pathlib.Path(folder), args.tree.resolve())
        address = (host, port)
        try:
            worker = worker_of(proc.pid)
            phase(address, 2, args.streams, worker)  # warm-up
            quiet = phase(address, args.seconds, args.streams, worker)
            stopping, out = multiprocessing.Event(), multiprocessing.Queue()
            callers = multiprocessing.Process(target=hostile,
                                              args=(address, "hostile-echo", args.hostile,
                                                    stopping, out))
            callers.start()
            time.sleep(1.0)  # the hostile callers at work before the measured streams
            loaded = phase(address, args.seconds, args.streams, worker)
            stopping.set()
            answers = out.get(timeout=300)
            callers.join(60)
        finally:
            proc.terminate()
            proc.wait(60)
    result = {"tree": str(args.tree),
              "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs",
              "quiet": quiet, "hostile": loaded, "hostile_answers": answers,
              "ttft_p99_ratio": loaded["ttft_p99_ms"] / quiet["ttft_p99_ms"]}
    print(f"{'phase':8} {'streams':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
          f"{'worker peak MiB':>16}")
    for label, r in (("quiet", quiet), ("hostile", loaded)):
        print(f"{label:8} {r['streams']:8d} {r['ttft_p50_ms']:12.2f} {r['ttft_p99_ms']:12.2f} "
              f"{r['worker_peak_mib']:16.0f}")
    print(f"TTFT p99 hostile / quiet: {result['ttft_p99_ratio']:.2f}")
    for kind, counts in answers.items():
        print(f"  {kind}: {counts}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
