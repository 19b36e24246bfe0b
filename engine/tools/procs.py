"""The benchmarks' client processes: forked, told where to attach, started
together at one time, collected with a bound, and killed if they linger."""
import gc
import os
import sys
import time
from multiprocessing.connection import wait as wait_any
from typing import Callable

from engine.serving.supervisor import Engine
from engine.shm import ring
from engine.tools.baselines import Server
from engine.tools.load import Load


def await_target(conn):
    """A client's first step: the name of the engine (or server) once it runs,
    and the cores to run on; None if the parent gave up."""
    if not conn.poll(120):
        return None
    name, cpus = conn.recv()
    if cpus:
        os.sched_setaffinity(0, cpus)
    return name


def ready_for_start(conn):
    """Says ready, then waits (bounded) for the common start time (ns)."""
    conn.send("ready")
    return conn.recv() if conn.poll(60) else None


def sleep_until(t_ns: int) -> None:
    """Sleeps until the monotonic clock reaches t_ns (a closed loop's start)."""
    while ring.now_ns() < t_ns:
        time.sleep(max(0.0, (t_ns - ring.now_ns()) / 1e9))


def forked(target):
    """Runs target in a forked child, first moving the inherited heap out of
    the collector's reach: a full collection would walk (and copy-on-write
    fault) every object of a large parent, stalling the sender for 100s of ms."""
    def run(*args):
        gc.freeze()
        target(*args)
    return run


def fork_clients(target, args_of, count):
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    target = forked(target)
    procs, conns = [], []
    for cid in range(count):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=args_of(cid, child), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    return procs, conns


def collect(conns, procs, timeout_s, progress=None) -> list:
    """Waits (bounded) for one result per client, updating progress meanwhile."""
    results, pending = {}, dict(enumerate(conns))
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for conn in wait_any(list(pending.values()), timeout=0.2):
            cid = next(i for i, c in pending.items() if c is conn)
            results[cid] = conn.recv()
            del pending[cid]
        if progress:
            progress()
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(10)
    if pending:
        raise RuntimeError(f"{len(pending)} client(s) gave no result within {timeout_s} s")
    return [results[i] for i in range(len(conns))]


class Progress:
    """A one-line progress bar on a terminal's stderr; silent otherwise."""

    def __init__(self, label: str, total: int, count: Callable[[], int]):
        self.label, self.total, self.count = label, total, count
        self.on = sys.stderr.isatty()

    def __call__(self) -> None:
        if self.on:
            done = min(self.total, self.count())
            bar = "#" * (30 * done // max(1, self.total))
            sys.stderr.write(f"\r  {self.label} [{bar:<30}] {done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\r" + " " * 78 + "\r")
            sys.stderr.flush()


def placement(instances: int, pin: bool):
    """(cpus of each batcher, cpus of the clients): as a deployment would pin
    them, the batchers get cores of their own when the machine has enough."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) <= instances:
        return None, None
    return [[c] for c in cores[-instances:]], cores[:-instances]


SYSTEMS = ("shmbatch", "mpq-per-request", "mpq-batcher")


def start_server(system: str, load: Load, clients: int, max_batch_size: int,
                  max_delay_ms: float):
    """The baseline server for `system` (None for shmbatch), before clients fork."""
    if system == "shmbatch":
        return None
    return Server(load.backend, load.backend_args, clients,
                  1 if system == "mpq-per-request" else max_batch_size, max_delay_ms)


def start_engine(name: str, load: Load, **knobs) -> Engine:
    return Engine(name, backend=load.backend, backend_args=load.backend_args,
                  input_shape=load.input_shape, input_dtype=load.dtype,
                  output_shape=load.input_shape, output_dtype=load.dtype, **knobs).start()


def go(conns, name: str, client_cpus, lead_ns: int) -> int:
    """Tells the clients where to attach, waits (bounded) until all are ready,
    and gives them one common start time, lead_ns from now."""
    for conn in conns:
        conn.send((name, client_cpus))
    for conn in conns:
        if not conn.poll(30) or conn.recv() != "ready":
            raise RuntimeError("a bench client did not attach")
    start_ns = ring.now_ns() + lead_ns
    for conn in conns:
        conn.send(start_ns)
    return start_ns


def shut(procs, eng, server) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    if eng is not None:
        eng.stop()
    if server is not None:
        server.stop()
