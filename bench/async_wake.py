"""An asyncio caller's round trip and CPU beside the blocking infer(), one or more trees.

    python bench/async_wake.py [--tree LABEL=DIR ...] [--rounds 3] [--seconds 2]
                               [--only blocking async1 async8 async32] [--model-us US]

For each tree (default: this one), each round starts an engine (identity
backend, float32[16], max_batch_size 32; with --model-us, the synthetic backend
busy-waiting US µs a batch, answering 2x + 1) in its own process, then measures in
a fresh caller process, one after another for --seconds each:

  blocking   Client.infer(), one request at a time
  asyncN     N asyncio tasks on one event loop, each awaiting infer_async() in
             turn (N in flight)

A row's figures: p50 and p99 of the round trips (each from the call to its
answer), requests/s, and the caller process's CPU (user + system, all its
threads: the completion thread's too) per request. Every answer is checked
against its own request. Trees alternate round by round, so they see the same
machine; the medians over the rounds are printed. A tree's engine/_ringc must
be built (python csrc/build_ring.py in it).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ENGINE = r"""
import signal, sys
import engine
model_us = float(sys.argv[2])
backend = dict(backend="engine.backends:synthetic",
               backend_args={"fixed_ms": model_us / 1000, "per_item_us": 0.0}) if model_us \
    else dict(backend="engine.backends:identity")
eng = engine.Engine(sys.argv[1], **backend, input_shape=(16,), output_shape=(16,),
                    max_batch_size=32, queue_capacity=256)
eng.start()
print("ready", flush=True)
signal.signal(signal.SIGTERM, lambda *a: (eng.stop(), sys.exit(0)))
signal.pause()
"""

PROBE = r"""
import asyncio, json, os, sys, time
import numpy as np
import engine
name, seconds, rows = sys.argv[1], float(sys.argv[2]), sys.argv[3].split(",")
c = engine.Client(name, wait_s=30)
xs = np.random.default_rng(0).random((256, 16), dtype=np.float32)
ys = xs * 2 + 1 if float(sys.argv[4]) else xs  # the synthetic model's answers, or identity's

def figures(times, n, cpu_s, wall_s):
    times = np.array(times)
    return {"p50_us": float(np.percentile(times, 50) / 1e3),
            "p99_us": float(np.percentile(times, 99) / 1e3),
            "rps": n / wall_s, "cpu_us": cpu_s / n * 1e6}

def blocking():
    for k in range(2000):
        c.infer(xs[k % 256])
    times, k = [], 0
    t0, c0 = time.monotonic_ns(), time.process_time()
    end = t0 + int(seconds * 1e9)
    while True:
        t = time.monotonic_ns()
        if t >= end:
            break
        y = c.infer(xs[k % 256])
        times.append(time.monotonic_ns() - t)
        assert (y == ys[k % 256]).all()
        k += 1
    return figures(times, k, time.process_time() - c0, (time.monotonic_ns() - t0) / 1e9)

async def in_flight(n):
    async def one(i, until, times, count):
        k = i
        while time.monotonic_ns() < until:
            t = time.monotonic_ns()
            y = await c.infer_async(xs[k % 256])
            times.append(time.monotonic_ns() - t)
            assert (y == ys[k % 256]).all()
            count[0] += 1
            k += n
    warm = []
    await asyncio.gather(*(one(i, time.monotonic_ns() + 300_000_000, warm, [0]) for i in range(n)))
    times, count = [], [0]
    t0, c0 = time.monotonic_ns(), time.process_time()
    await asyncio.gather(*(one(i, t0 + int(seconds * 1e9), times, count) for i in range(n)))
    return figures(times, count[0], time.process_time() - c0, (time.monotonic_ns() - t0) / 1e9)

out = {}
for row in rows:
    out[row] = blocking() if row == "blocking" else asyncio.run(in_flight(int(row[5:])))
c.close()
print("RESULT " + json.dumps(out))
"""


def run_tree(tree: str, rows: list, seconds: float, tag: str, model_us: float = 0.0) -> dict:
    path = [os.path.abspath(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                      if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    name = f"asyncwake-{os.getpid()}-{tag}"
    eng = subprocess.Popen([sys.executable, "-c", ENGINE, name, str(model_us)], env=env, cwd="/",
                           stdout=subprocess.PIPE, text=True)
    try:
        if eng.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{tree}: the engine did not start")
        proc = subprocess.run([sys.executable, "-c", PROBE, name, str(seconds), ",".join(rows),
                               str(model_us)],
                              env=env, capture_output=True, text=True, timeout=600, cwd="/")
    finally:
        eng.terminate()
        eng.wait(30)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{tree}: no result\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--only", nargs="*", default=["blocking", "async1", "async8", "async32"])
    p.add_argument("--model-us", type=float, default=0.0,
                   help="a synthetic model of this many µs a batch (default: identity)")
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": here}
    results = {label: [] for label in trees}
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
        for label, tree in order:
            results[label].append(run_tree(tree, args.only, args.seconds, f"{label}{r}",
                                           args.model_us))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"medians over {args.rounds} rounds of {args.seconds:g} s a row "
          f"(load average after: {' '.join(load)})")
    print(f"{'tree':>10} {'row':>9} {'p50 us':>9} {'p99 us':>9} {'req/s':>9} {'CPU us/req':>11}")
    for label in trees:
        for row in args.only:
            med = {k: statistics.median(x[row][k] for x in results[label])
                   for k in ("p50_us", "p99_us", "rps", "cpu_us")}
            print(f"{label:>10} {row:>9} {med['p50_us']:9.1f} {med['p99_us']:9.1f} "
                  f"{med['rps']:9.0f} {med['cpu_us']:11.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
