"""The HTTP front under careless and hostile callers, beside the same load in quiet.

    python bench/http_hostile.py [--seconds 10] [--concurrency 8] [--idle 300]
                                 [--big-mib 30] [--stalled 4] [--tree DIR] [--out FILE.json]

One `shmbatch serve` with ONE HTTP worker serves a one-shot engine (synthetic
backend, 1 ms + 20 us per item, float32[16]) and an iterative one whose chunks
are float64[1024] (large events). `hey` sends one-row JSON infers for
--seconds at --concurrency, twice: first alone (quiet), then while
- --idle sockets connect and send nothing (each reopened once the server closes it),
- a thread sends --big-mib MiB JSON bodies to the infer route, one after
  another, each sent whole before its answer is read (as urllib does),
- --stalled callers open generate_stream and never read (reopened when closed).
Per phase: requests/s, p50/p99 ms, non-200 answers; and the hostile phase's
p99 over the quiet one's. The tests' step model (tests/serve_backends.py)
serves the iterative engine. --tree serves from another source tree of
shmbatch (its engine/_ringc built), e.g. a worktree of an earlier commit.
"""
import argparse
import csv
import io
import json
import os
import pathlib
import platform
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = """http_workers = 1
[engines.hostile-quiet]
backend = "engine.backends:synthetic"
backend_args = {fixed_ms = 1.0, per_item_us = 20.0}
input_shape = [16]
output_shape = [16]
max_batch_size = 32
[engines.hostile-wide]
backend = "serve_backends:wide"
backend_args = {width = 1024}
iterative = true
max_steps = 2048
queue_capacity = 8
max_batch_size = 8
input_shape = [2]
input_dtype = "int64"
output_shape = [1024]
output_dtype = "float64"
"""


def serve(folder: pathlib.Path, tree: pathlib.Path):
    path = folder / "models.toml"
    path.write_text(CONFIG)
    env = {"PYTHONPATH": f"{tree}:{ROOT / 'tests'}"}
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--config", str(path),
                             "--http-port", "0", "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env}, cwd=folder)  # `python -m` puts the cwd first on the path
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("serve exited before it was ready")
        if "ready" in line:
            host, port = re.search(r"http://(\S+)$", line.strip()).group(1).rsplit(":", 1)
            return proc, host, int(port)
    raise TimeoutError("serve not ready within 120 s")


def run_hey(host: str, port: int, seconds: float, concurrency: int, body_path: str) -> dict:
    out = subprocess.run(
        ["hey", "-z", f"{seconds}s", "-c", str(concurrency), "-m", "POST", "-T",
         "application/json", "-D", body_path, "-o", "csv",
         f"http://{host}:{port}/v2/models/hostile-quiet/infer"],
        capture_output=True, text=True, check=True, timeout=seconds + 120)
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    ms = np.array([float(r["response-time"]) for r in rows]) * 1e3
    return {"requests": len(rows), "rps": len(rows) / seconds,
            "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "not_200": sum(r["status-code"] != "200" for r in rows)}


class Hostile:
    """The careless and hostile callers, each kept going by a thread until stop()."""

    def __init__(self, host: str, port: int, idle: int, big_mib: int, stalled: int):
        self.address, self.stopping = (host, port), threading.Event()
        self.counts = {"idle_reopened": 0, "big_sent": 0, "big_answers": {}, "stalled_reopened": 0}
        self.threads = [threading.Thread(target=self.idle, args=(idle,), daemon=True),
                        threading.Thread(target=self.big, args=(big_mib,), daemon=True),
                        *(threading.Thread(target=self.stall, daemon=True)
                          for _ in range(stalled))]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> dict:
        self.stopping.set()
        for t in self.threads:
            t.join(60)
        return self.counts

    def idle(self, n: int) -> None:
        socks = [socket.create_connection(self.address) for _ in range(n)]
        for s in socks:
            s.setblocking(False)
        while not self.stopping.wait(0.2):
            for i, s in enumerate(socks):
                try:
                    if s.recv(4096) == b"":  # closed by the server: reopen it
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                s.close()
                socks[i] = socket.create_connection(self.address)
                socks[i].setblocking(False)
                self.counts["idle_reopened"] += 1
        for s in socks:
            s.close()

    def big(self, mib: int) -> None:
        row = ", ".join(["1.0"] * 16)
        rows = (mib << 20) // (len(row) + 4)
        data = ('{"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [%d, 16], '
                '"data": [%s]}]}' % (rows, ", ".join(f"[{row}]" for _ in range(rows)))).encode()
        head = (f"POST /v2/models/hostile-quiet/infer HTTP/1.1\r\nHost: x\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
        while not self.stopping.is_set():
            try:
                with socket.create_connection(self.address, timeout=60) as s:
                    s.sendall(head + data)  # whole, then read the answer (urllib's way)
                    status = s.recv(64).split(b" ")[1].decode()
            except OSError as e:
                status = type(e).__name__
            self.counts["big_sent"] += 1
            self.counts["big_answers"][status] = self.counts["big_answers"].get(status, 0) + 1

    def stall(self) -> None:
        body = json.dumps({"INPUT": [0, 0], "parameters": {"timeout": 5_000_000}}).encode()
        while not self.stopping.is_set():
            with socket.create_connection(self.address) as s:
                s.sendall(f"POST /v2/models/hostile-wide/generate_stream HTTP/1.1\r\nHost: x\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                s.settimeout(0.2)
                while not self.stopping.is_set():  # read nothing; notice a close
                    try:
                        if s.recv(1, socket.MSG_PEEK) == b"":
                            break
                    except socket.timeout:
                        continue
                    except OSError:
                        break
                    time.sleep(0.2)
            self.counts["stalled_reopened"] += 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--idle", type=int, default=300)
    p.add_argument("--big-mib", type=int, default=30)
    p.add_argument("--stalled", type=int, default=4)
    p.add_argument("--tree", type=pathlib.Path, default=ROOT)
    p.add_argument("--out")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        proc, host, port = serve(pathlib.Path(folder), args.tree.resolve())
        try:
            body = pathlib.Path(folder) / "body.json"
            body.write_text(json.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32",
                                                    "shape": [1, 16], "data": [1.0] * 16}]}))
            run_hey(host, port, 2, args.concurrency, str(body))  # warm-up
            quiet = run_hey(host, port, args.seconds, args.concurrency, str(body))
            hostile = Hostile(host, port, args.idle, args.big_mib, args.stalled)
            hostile.start()
            time.sleep(1.0)  # the hostile callers in place before the measured load
            loaded = run_hey(host, port, args.seconds, args.concurrency, str(body))
            counts = hostile.stop()
        finally:
            proc.terminate()
            proc.wait(60)
    result = {"tree": str(args.tree), "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} "
                         f"CPUs", "quiet": quiet, "hostile": loaded, "hostile_callers": counts,
              "p99_ratio": loaded["p99_ms"] / quiet["p99_ms"]}
    print(f"{'phase':8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'not 200':>8}")
    for label, r in (("quiet", quiet), ("hostile", loaded)):
        print(f"{label:8} {r['rps']:8.0f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{r['not_200']:8d}")
    print(f"p99 hostile / quiet: {result['p99_ratio']:.2f}; hostile callers: {counts}")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
