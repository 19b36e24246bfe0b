"""Two builds of shmbatch side by side in one run: before and after a change.

    git worktree add /tmp/sb-before <commit>
    (cd /tmp/sb-before && python csrc/build_ring.py)     # its own engine/_ringc
    python bench/ab.py --before /tmp/sb-before --after . --rounds 5
    python bench/ab.py --tree A=/tmp/a --tree B=/tmp/b --tree C=. --only rtt pipelined

Each measurement runs in a fresh process whose `engine` is imported from one
tree (PYTHONPATH first); the trees alternate round by round, so both see the
same machine, and the medians over the rounds are printed with their ratio,
then the median and range of each round's own ratio.

Measurements (--only picks some):
  rtt        1 client, 1 request at a time (identity backend): round trip p50
  rtt_named  the same on a named engine, inputs {"x": float32 (16,)} and outputs
             {"y": ...} (backend ab:named_identity, y = x), infer() with out=
             in this process for the seconds after a warm-up: rtt_p50_us,
             rtt_p99_us, and arr_p50_us, the same loop on a single-array engine
  peak8      8 client processes, 1 request at a time each: requests/s
  pipelined  2 clients x 256 submit() Futures in flight: requests/s
  cap=N      1 client, sequential infer() on an engine of queue_capacity N:
             round trip p50 and p99 (e.g. cap=64 cap=65536)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = r"""
import json, sys, time
import numpy as np
import engine
try:
    from engine.tools.closed_loop import closed_loop
    from engine.tools.load import Load
except ImportError:  # a tree from before the closed loops had modes: `window` (1, n, -n)
    try:
        from engine.tools import bench
    except ImportError:  # a tree from before the tooling moved
        from engine import bench
    Load = bench.Load
    def closed_loop(system, clients, mode, load, seconds, depth=1):
        return bench.closed_loop(system, clients, depth, load, seconds)
what, seconds = sys.argv[1], float(sys.argv[2])
def sequential(x, out, **knobs):  # round trips (ns) of infer() after a warm-up, for the seconds
    with engine.Engine("ab-seq", max_batch_size=32, queue_capacity=64, **knobs) as eng, \
            engine.Client("ab-seq") as c:
        for _ in range(2000):
            c.infer(x, out=out)
        times, end = [], time.monotonic_ns() + int(seconds * 1e9)
        while time.monotonic_ns() < end:
            t = time.monotonic_ns()
            c.infer(x, out=out)
            times.append(time.monotonic_ns() - t)
    return np.array(times)
load = Load(backend="engine.backends:identity", backend_args={})
if what == "rtt":
    run = closed_loop("shmbatch", 1, "blocking", load, seconds)
    out = {"rtt_p50_us": run["rtt_p50_us"], "rtt_p99_us": run["rtt_p99_us"]}
elif what == "rtt_named":
    sys.path.append(sys.argv[3])  # where ab.py is: the batchers import its named_identity
    x, y = np.arange(16, dtype=np.float32), np.empty(16, np.float32)
    named = sequential({"x": x}, {"y": y}, backend="ab:named_identity",
                       inputs={"x": ("float32", (16,))}, outputs={"y": ("float32", (16,))})
    assert (y == x).all(), y
    y[:] = -1
    arr = sequential(x, y, backend="engine.backends:identity", input_shape=(16,),
                     input_dtype="float32", output_shape=(16,), output_dtype="float32")
    assert (y == x).all(), y
    out = {"rtt_p50_us": float(np.percentile(named, 50) / 1e3),
           "rtt_p99_us": float(np.percentile(named, 99) / 1e3),
           "arr_p50_us": float(np.percentile(arr, 50) / 1e3)}
elif what == "peak8":
    run = closed_loop("shmbatch", 8, "blocking", load, seconds)
    out = {"rps": run["rps"]}
elif what == "pipelined":
    run = closed_loop("shmbatch", 2, "pipelined", load, seconds, depth=256)
    out = {"rps": run["rps"]}
else:  # cap=N: sequential infer() after a warm-up, on an engine of N slots
    capacity = int(what.split("=")[1])
    name = f"ab-cap-{capacity}"
    with engine.Engine(name, backend="engine.backends:identity", queue_capacity=capacity,
                       max_batch_size=32) as eng, engine.Client(name) as c:
        x, y = np.ones(16, np.float32), np.empty(16, np.float32)
        for _ in range(2000):
            c.infer(x, out=y)
        times = np.empty(20000, np.int64)
        for k in range(len(times)):
            t = time.monotonic_ns()
            c.infer(x, out=y)
            times[k] = time.monotonic_ns() - t
    out = {"rtt_p50_us": float(np.percentile(times, 50) / 1e3),
           "rtt_p99_us": float(np.percentile(times, 99) / 1e3)}
print("RESULT " + json.dumps(out))
"""


def named_identity():
    """rtt_named's backend (imported by the batchers from this file): y = x."""
    return lambda batch, lengths=None: {"y": batch["x"]}


def measure(tree: str, what: str, seconds: float) -> dict:
    path = [os.path.abspath(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = subprocess.run([sys.executable, "-c", PROBE, what, str(seconds),
                           os.path.dirname(os.path.abspath(__file__))], env=env,
                          capture_output=True, text=True, timeout=600, cwd="/")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{tree} {what}: no result\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--before", help="the tree before the change")
    p.add_argument("--after", help="the tree after it")
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                   help="more trees, or instead of --before/--after")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--only", nargs="*", default=["rtt", "peak8", "pipelined"])
    args = p.parse_args()
    trees = {label: path for label, path in (("before", args.before), ("after", args.after))
             if path}
    trees.update(t.split("=", 1) for t in args.tree)
    results = {(what, label): [] for what in args.only for label in trees}
    for r in range(args.rounds):
        for what in args.only:
            order = list(trees.items()) if r % 2 == 0 else list(trees.items())[::-1]
            for label, tree in order:
                results[what, label].append(measure(tree, what, args.seconds))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    labels = list(trees)
    print(f"medians over {args.rounds} alternating rounds ("
          + ", ".join(f"{label} = {path}" for label, path in trees.items()) + ")")
    for what in args.only:
        for key in results[what, labels[0]][0]:
            medians = [statistics.median(x[key] for x in results[what, label]) for label in labels]
            # each round's ratio pairs runs made minutes apart at most: its median
            # and range say more than the ratio of medians on a drifting machine
            base = [x[key] for x in results[what, labels[0]]]
            paired = {label: sorted(x[key] / b for x, b in zip(results[what, label], base))
                      for label in labels[1:]}
            print(f"{what:>12} {key:>11}: " + "  ".join(
                f"{label} {m:12,.1f}" for label, m in zip(labels, medians))
                + "  " + "  ".join(f"{label}/{labels[0]} {m / medians[0]:5.2f}"
                                   for label, m in zip(labels[1:], medians[1:])))
            print(f"{'':>12} {'':>11}  per round: " + "  ".join(
                f"{label}/{labels[0]} median {statistics.median(r):.2f} "
                f"(range {r[0]:.2f}-{r[-1]:.2f})" for label, r in paired.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
