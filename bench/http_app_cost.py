"""Instructions per HTTP infer in the worker's process, counted by callgrind.

    python bench/http_app_cost.py [--tree DIR] [--short 1000] [--long 3000]

An engine (identity backend, float32[16]) runs natively under `shmbatch serve`;
the Open Inference Protocol app runs in a process of its own under
`valgrind --tool=callgrind`, called directly (no socket, no uvicorn) with a
one-row JSON infer, as an HTTP worker calls it, twice: --short and --long
requests after the same warm-up. The figure is the difference of the two
totals over the difference of the counts (start-up and imports cancel): what
one request costs the worker's process (its app, its Client and the
Client's completion thread). --tree: another source tree of shmbatch (its
engine/_ringc built), e.g. a worktree of an earlier commit.
"""
import argparse
import asyncio
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
WARM = 200


def calls(name: str, n: int) -> None:
    """In the measured process: WARM, then n requests through the app."""
    try:
        from engine.segment import Segment
        try:
            from engine.http.front import Front as App
        except ImportError:  # a tree from before the HTTP front's families
            from engine.http.openinference import App
    except ImportError:  # a tree from before the package's sub-packages
        from engine.layout import Segment
        from engine.openinference import App
    seg = Segment.attach(name)
    config = seg.config
    seg.close()
    body = json.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 16],
                                   "data": [1.0] * 16}]}).encode()
    scope = {"type": "http", "method": "POST", "path": f"/v2/models/{name}/infer",
             "headers": [(b"content-length", str(len(body)).encode()),
                         (b"content-type", b"application/json")]}
    app = App({name: config}, 30.0, 1 << 20)
    app.open()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def run(k: int) -> None:
        for _ in range(k):
            sent = []

            async def send(message):
                sent.append(message)

            await app(scope, receive, send)
            assert sent[0]["status"] == 200, sent

    asyncio.run(run(WARM + n))
    app.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=pathlib.Path, default=ROOT)
    p.add_argument("--short", type=int, default=1000)
    p.add_argument("--long", type=int, default=3000)
    p.add_argument("--_calls", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._calls:
        calls(args._calls[0], int(args._calls[1]))
        return 0
    env = {**os.environ, "PYTHONPATH": str(args.tree.resolve())}
    name = f"appcost{os.getpid()}"
    serve = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--name", name,
                              "--backend", "engine.backends:identity", "--input-shape", "16",
                              "--output-shape", "16", "--log-level", "WARNING"],
                             stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
    totals = {}
    try:
        for line in serve.stdout:
            if "ready" in line:
                break
        with tempfile.TemporaryDirectory() as folder:
            for n in (args.short, args.long):
                out = pathlib.Path(folder) / f"callgrind.{n}"
                subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                                sys.executable, __file__, "--_calls", name, str(n)],
                               env=env, cwd="/tmp", check=True, capture_output=True)
                totals[n] = int(re.search(r"^(?:summary|totals): (\d+)", out.read_text(),
                                          re.M).group(1))
    finally:
        serve.terminate()
        serve.wait(60)
    per = (totals[args.long] - totals[args.short]) / (args.long - args.short)
    print(f"{args.tree}: {per:,.0f} instructions per HTTP infer in the worker's process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
