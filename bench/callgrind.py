"""Instructions per request, counted by callgrind, for one source tree.

    python bench/callgrind.py --tree /path/to/tree [--only blocking pipelined] [--json out.json]

The tree's `engine` is imported first (PYTHONPATH) in every process, and its
engine/_ringc*.so must be built: (cd TREE && python csrc/build_ring.py).

Each scenario runs twice, with N_SHORT and N_LONG requests, on an engine with
the identity backend (input and output (16,) float32, max_batch_size 32):

  blocking   1 client process, sequential infer()
  blocking8  8 client processes, sequential infer() each
  pipelined  1 client process, 256 submit() Futures in flight (submit 256,
             then result() each, repeat)
  async8     1 client process, 8 asyncio tasks on one loop, each awaiting
             infer_async() in turn (8 in flight; batches flush at 8, so every
             answer reaches the loop by its wake)

The clients and the batcher run under `valgrind --tool=callgrind`; the
engine's own process (not reported) does not, as valgrind 3.19 lacks the
pidfd_open it calls. It starts its batcher with sys.executable, set there to a
script that runs python under callgrind as its child, not exec'd: the batcher
asks for SIGKILL when the thread that started it ends, which stop() ends before
the batcher has exited, and a killed process writes no counts. The batcher's
last argument, the pid it must have as parent (engine.launch), becomes the
script's own.

A role's figure is (I(N_LONG) - I(N_SHORT)) / (N_LONG - N_SHORT), I being the
instructions of that role's processes (all threads, the clients summed): the
fixed costs (start-up, imports, exit) cancel. Everything is pinned to CPU 0,
so the engine sees one CPU at import and never spins: a wait costs the same
instructions however long it lasts. How many requests a batch holds is the
scheduler's to say (callgrind slows each process some 50x, so time slices end
far more often per request than natively, and a woken process may preempt the
running one mid-request): it is printed, and the batcher's figure depends on
it and on the interleaving, so it moves from run to run more than the client's.
Every answer is checked against its input. The client's own loop (256 inputs
made once and cycled, the answers kept and compared at the end) is counted
with it: about 700 instructions a request above the bare call.
"""
import argparse
import asyncio
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

N_SHORT, N_LONG = 2048, 6144  # multiples of 8 clients x DEPTH
DEPTH = 256
ASYNC_TASKS = 8
# (client processes, their call, the engine's knobs). Batches flush on size alone
# (max_delay_ms beyond any run) where more than one request is in flight: every
# batch then holds 8 (blocking8) or 32 (pipelined) requests, whatever the
# scheduler does, so the batcher's count per request repeats from run to run.
FULL_ONLY = {"max_delay_ms": 600_000.0}
SCENARIOS = {"blocking": (1, "infer", {}),
             "blocking8": (8, "infer", {"max_batch_size": 8, **FULL_ONLY}),
             "pipelined": (1, "submit", FULL_ONLY),
             "async8": (1, "async", {"max_batch_size": ASYNC_TASKS, **FULL_ONLY})}
ENGINE = dict(backend="engine.backends:identity", input_shape=(16,), output_shape=(16,),
              max_batch_size=32)
TIMEOUT_S = 60.0  # a request's deadline: 1 s (the default) is too short under callgrind


def _spin_ns(engine):
    """The tree's SPIN_NS (engine.shm.ring's, or engine.ring's in a tree before the sub-packages)."""
    return (engine.shm.ring if hasattr(engine, "shm") else engine.ring).SPIN_NS


def serve(name, wrapper, scenario):
    """Child: the engine's process. Serves until its stdin gives a line or closes."""
    import engine
    sys.executable = wrapper  # the batcher process it starts runs under callgrind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that stop() runs
    eng = engine.Engine(name, **{**ENGINE, **SCENARIOS[scenario][2]}).start()
    try:
        print("ready", engine.__file__, _spin_ns(engine), flush=True)
        sys.stdin.readline()
        print(json.dumps(eng.stats()["batch_size_counts"]), flush=True)
    finally:
        eng.stop()


def client(name, n, mode, processes):
    """Child: `processes` client processes (this one and its forks, so one interpreter
    start-up serves them all), n requests each once its stdin gives a byte; each
    checks its answers and says done."""
    import numpy as np

    import engine
    me, children = 0, []
    for k in range(1, processes):
        pid = os.fork()
        if pid == 0:  # a child forks no more and waits for nobody
            me, children = k, []
            break
        children.append(pid)
    # (a fork's counts start with its parent's: fixed, they cancel.) DEPTH distinct
    # inputs, each process its own values (a misrouted answer shows), made once
    # and cycled: the loop adds little to a request (b"".join checks the answers)
    pool = list(np.repeat(np.arange(me * DEPTH, (me + 1) * DEPTH, dtype=np.float32)[:, None],
                          16, axis=1))
    with engine.Client(name) as c:  # after the fork: a Client belongs to one process
        if mode == "async":  # one loop throughout: its wake socket is made once, uncounted
            ys = asyncio.run(_in_flight(c, pool, n // DEPTH))
        else:
            ys = _sequential(c, pool, n // DEPTH, mode)
    ok = len(ys) == n and b"".join(ys) == b"".join(pool) * (n // DEPTH)
    os.write(1, b"done\n" if ok else b"WRONG ANSWERS\n")
    ok = all([os.waitpid(pid, 0)[1] == 0 for pid in children]) and ok
    os._exit(0 if ok else 1)


def _ready(engine):
    os.write(1, f"ready {engine.__file__} {_spin_ns(engine)}\n".encode())
    os.read(0, 1)  # one byte each, so that every process reads its own


def _sequential(c, pool, rounds, mode):
    """The answers of `rounds` passes over pool by infer() or submit()."""
    import engine
    # the first batch's one-off costs: fixed (a full batch, where only full ones flush)
    for f in [c.submit(x, timeout=TIMEOUT_S) for x in pool[:32 if mode == "submit" else 1]]:
        f.result()
    _ready(engine)
    ys = []
    for _ in range(rounds):
        if mode == "infer":
            for x in pool:
                ys.append(c.infer(x, timeout=TIMEOUT_S))
        else:
            futures = [c.submit(x, timeout=TIMEOUT_S) for x in pool]
            for f in futures:
                ys.append(f.result())
    return ys


async def _in_flight(c, pool, rounds, tasks=ASYNC_TASKS):
    """The answers of `rounds` passes over pool, `tasks` tasks each awaiting
    infer_async() for its share (pool[k::tasks]) in turn."""
    import engine

    async def share(k, xs):
        return [await c.infer_async(x, timeout=TIMEOUT_S) for x in xs]

    async def one_pass(xs):
        shares = await asyncio.gather(*(share(k, xs[k::tasks]) for k in range(tasks)))
        ys = [None] * len(xs)
        for k, answers in enumerate(shares):
            ys[k::tasks] = answers
        return ys
    await one_pass(pool[:tasks])  # the first batch (and the loop's wake socket): fixed
    _ready(engine)
    ys = []
    for _ in range(rounds):
        ys.extend(await one_pass(pool))
    return ys


def read_ready(proc, tree, what):
    line = proc.stdout.readline().split()
    if len(line) != 3 or line[0] != "ready":
        raise RuntimeError(f"{what} did not start: {line}")
    if not line[1].startswith(os.path.join(tree, "engine") + os.sep):
        raise RuntimeError(f"{what} imported engine from {line[1]}, not from {tree}")
    if line[2] != "0":
        raise RuntimeError(f"{what} sees SPIN_NS={line[2]}: not pinned to one CPU")


def parse(path):
    """(role, instructions, the _ringc objects it loaded) of one callgrind output."""
    text = open(path, errors="replace").read()
    cmd = re.search(r"^cmd: (.*)$", text, re.M)
    total = re.search(r"^totals: (\d+)", text, re.M)
    if cmd is None or total is None:
        raise RuntimeError(f"{path} has no totals: its process was killed before writing them")
    # a tree before the package's sub-packages started engine.batcher
    role = ("batcher" if re.search(r"engine(\.batching)?\.batcher import _entry", cmd.group(1)) else
            "client" if " _client " in cmd.group(1) else "other")
    return role, int(total.group(1)), set(re.findall(r"\S*_ringc\S*\.so", text))


def gone(pid, wait_s=10.0):
    """Whether pid has exited (or is a zombie) within wait_s."""
    for _ in range(int(wait_s * 10)):
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def run_once(tree, scenario, n, workdir):
    """Runs scenario with n requests in all; returns {role: instructions}."""
    clients, mode, _ = SCENARIOS[scenario]
    name = f"cg{os.getpid()}-{scenario}-{n}"
    outdir = tempfile.mkdtemp(prefix=f"{scenario}-{n}-", dir=workdir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [tree] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    vg = ["valgrind", "--tool=callgrind", "--vgdb=no", f"--callgrind-out-file={outdir}/cg.%p",
          f"--log-file={outdir}/vg.%p.log", sys.executable]
    wrapper = os.path.join(outdir, "python-callgrind")
    with open(wrapper, "w") as f:
        # the batcher's parent is this script, not the engine: its last argument says so
        f.write("#!/bin/bash\nargs=(\"$@\"); args[-1]=$$\n" + " ".join(vg) + ' "${args[@]}"\n')
    os.chmod(wrapper, 0o755)

    def spawn(*args, under=vg):
        return subprocess.Popen(under + [os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env, cwd=outdir)
    sup, procs = spawn("_serve", name, wrapper, scenario, under=[sys.executable]), []
    try:
        read_ready(sup, tree, "the engine")
        procs = [spawn("_client", name, str(n // clients), mode, str(clients))]
        for _ in range(clients):  # all started (first request done) before any counted one
            read_ready(procs[0], tree, "a client")
        procs[0].stdin.write("g" * clients)
        procs[0].stdin.flush()
        outs = [procs[0].stdout.readline().strip() for _ in range(clients)]
        if procs[0].wait() != 0 or outs != ["done"] * clients:
            raise RuntimeError(f"a client failed: {outs} (logs in {outdir})")
        sup.stdin.write("stop\n")
        sup.stdin.flush()
        sizes = json.loads(sup.stdout.readline())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        sup.stdin.close()  # the engine stops: drains, stops its batcher, unlinks its segment
        try:
            sup.wait(timeout=120)
        except subprocess.TimeoutExpired:
            sup.terminate()
            sup.wait()
        stray = [pid for pid in (int(p.split(".")[-2]) for p in glob.glob(f"{outdir}/vg.*.log"))
                 if not gone(pid)]  # every process callgrind ran, batcher included
        for pid in stray:
            os.kill(pid, signal.SIGKILL)
        left = glob.glob(f"/dev/shm/*shmbatch-{name}*")
        for path in left:
            os.unlink(path)
        if stray or left:
            raise RuntimeError(f"left behind after the engine stopped: pids {stray}, {left}")
    totals, found = {}, []
    for path in glob.glob(f"{outdir}/cg.*"):
        role, total, ringc = parse(path)
        found.append(role)
        if role in ("client", "batcher"):
            if not ringc or any(not so.startswith(tree + os.sep) for so in ringc):
                raise RuntimeError(f"{path}: its _ringc is not the tree's: {ringc}")
            totals[role] = totals.get(role, 0) + total
    totals["batches"] = sum(sizes.values())
    if sorted(found) != ["batcher"] + ["client"] * clients:
        raise RuntimeError(f"expected 1 batcher and {clients} client(s), found {found} in {outdir}")
    return totals


def main():
    if sys.argv[1:2] == ["_serve"]:
        return serve(*sys.argv[2:])
    if sys.argv[1:2] == ["_client"]:
        return client(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", required=True, help="source tree whose engine is measured")
    ap.add_argument("--only", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    tree = os.path.realpath(args.tree)
    if not glob.glob(f"{tree}/engine/_ringc*.so"):
        sys.exit(f"{tree}/engine has no _ringc*.so: (cd {tree} && python csrc/build_ring.py)")
    os.sched_setaffinity(0, {0})  # inherited by every process started from here
    commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    started, results = time.monotonic(), {}
    workdir = tempfile.mkdtemp(prefix="callgrind-")  # kept, with its logs, if a run fails
    for scenario in args.only:
        short, long_ = (run_once(tree, scenario, n, workdir) for n in (N_SHORT, N_LONG))
        per = {role: (long_[role] - short[role]) / (N_LONG - N_SHORT)
               for role in ("client", "batcher")}
        per["client+batcher"] = per["client"] + per["batcher"]
        per["requests/batch"] = (N_LONG - N_SHORT) / (long_["batches"] - short["batches"])
        results[scenario] = {"per_request": per, "short": short, "long": long_}
        for role, value in per.items():
            print(f"{scenario:>10}  {role:<15} {value:>10,.{1 if '/' in role else 0}f}",
                  flush=True)
    shutil.rmtree(workdir)
    elapsed = time.monotonic() - started
    print(f"tree {tree} ({commit or 'no git'}), instructions per request, N {N_SHORT} -> "
          f"{N_LONG}, {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tree": tree, "commit": commit, "n": [N_SHORT, N_LONG],
                       "seconds": round(elapsed, 1), "scenarios": results}, f, indent=1)


if __name__ == "__main__":
    main()
