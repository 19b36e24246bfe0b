"""`shmbatch bench`: throughput and latency versus max_batch_size (contract section 6).

Each row starts an engine, forks client processes, and drives it OPEN LOOP:
every client sends at Poisson times fixed in advance from a seeded generator,
whether or not its earlier requests were answered, and each request's
latency is counted from its SCHEDULED arrival (a late sender never hides
queueing). Every answer is checked against its own request. The engine's
own figures give queue wait and service time apart.
"""
import dataclasses
import gc
import json
import os
import platform
import sys
import time
from multiprocessing.connection import wait as wait_any
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from engine import ring, tools
from engine.client import Client
from engine.errors import EngineError, QueueFull, RequestTimeout
from engine.supervisor import Engine
from engine.tools.baselines import Caller, Server

DEFAULT_ROWS = [(1, 0.0), (32, 0.0), (8, 1.0), (32, 2.0), (32, 5.0)]

# outcome codes of one request
PENDING, OK, WRONG, ERROR, REJECTED, TIMEOUT = range(6)


@dataclasses.dataclass
class Load:
    """What a row offers the engine: the backend, the inputs and the arrivals."""

    backend: str = "engine.backends:synthetic"
    backend_args: dict = dataclasses.field(
        default_factory=lambda: {"fixed_ms": 2.0, "per_item_us": 100.0})
    input_shape: Tuple[int, ...] = (16,)
    dtype: str = "float32"
    clients: int = 4
    rate: float = 1500.0
    requests: int = 1600
    queue_capacity: Optional[int] = None  # None: room for every request (the seed's unbounded queue)
    timeout_s: float = 60.0
    seed: int = 1
    pin: bool = True  # batchers on the last cores, clients on the others (when there are >= 2)


# -- pure helpers (tested on their own) -----------------------------------------

def poisson_offsets_ns(rate_hz: float, n: int, seed: int) -> np.ndarray:
    """Arrival times (ns from the start) of n Poisson arrivals at rate_hz."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_hz, size=n)
    return (np.cumsum(gaps) * 1e9).astype(np.int64)


def split_requests(total: int, clients: int) -> List[int]:
    """total requests over clients, as evenly as whole numbers allow."""
    return [total // clients + (c < total % clients) for c in range(clients)]


def percentiles_ms(latency_ns: np.ndarray) -> Dict[str, float]:
    if len(latency_ns) == 0:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    ms = latency_ns / 1e6
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "max": float(ms.max())}


def tag_value(client: int, k: int) -> float:
    """A value exact in float32 (< 2**23) that names request k of a client."""
    return float((client % 16) * (1 << 19) + k % (1 << 19))


def expected_fn(backend: str) -> Optional[Callable[[np.ndarray], np.ndarray]]:
    """What the built-in backends answer, so every answer can be checked."""
    return {"engine.backends:synthetic": lambda x: x * 2 + 1,
            "engine.backends:identity": lambda x: x}.get(backend)


def sample_index(shape: Tuple[int, ...]) -> np.ndarray:
    """Flat positions checked in each answer: all of a small input, a strided
    sample (first, last and every 4096th) of a large one."""
    size = int(np.prod(shape))
    if size <= 4096:
        return np.arange(size)
    return np.unique(np.r_[np.arange(0, size, 4096), size - 1])


class AnswerCheck:
    """What every answer to one input must hold at the sampled flat positions,
    compared as bytes (dtype included): ~0.5 us an answer, where
    np.array_equal costs ~7 us, as much as a request in a closed loop."""

    def __init__(self, sent: np.ndarray, expect, index: np.ndarray, shape):
        self.shape, self.index = tuple(shape), index
        self.whole = len(index) == int(np.prod(shape))  # a small input: all of it
        want = None if expect is None else np.ascontiguousarray(expect(sent))
        self.dtype = None if want is None else want.dtype
        self.want = None if want is None else want.tobytes()

    def __call__(self, y: np.ndarray) -> bool:
        if self.want is None:
            return True
        if y.shape != self.shape or y.dtype != self.dtype:
            return False
        flat = y.reshape(-1)
        return (flat if self.whole else flat[self.index]).tobytes() == self.want


def check_answer(sent: np.ndarray, y: np.ndarray, expect, index: np.ndarray, shape) -> bool:
    """sent: the input's values at `index` (flat); y: the whole answer."""
    return AnswerCheck(sent, expect, index, shape)(y)


def theoretical_rps(n: int, fixed_ms: float, per_item_us: float) -> float:
    """Capacity n / S(n) of the seed's cost model S(n) = F + n c."""
    return n / ((fixed_ms + n * per_item_us / 1000.0) / 1000.0)


# -- the client processes ----------------------------------------------------------

def _await_target(conn):
    """A client's first step: the name of the engine (or server) once it runs,
    and the cores to run on; None if the parent gave up."""
    if not conn.poll(120):
        return None
    name, cpus = conn.recv()
    if cpus:
        os.sched_setaffinity(0, cpus)
    return name


def _ready_for_start(conn):
    """Says ready, then waits (bounded) for the common start time (ns)."""
    conn.send("ready")
    return conn.recv() if conn.poll(60) else None


def _open_loop_client(cid, n, load: Load, conn, server=None) -> None:
    """Runs in a forked process: attach (to the engine, or to a baseline
    server), report ready, wait for the common start time, send n requests
    at their scheduled times, and report every request's outcome."""
    _fine_timer_slack()
    offsets = poisson_offsets_ns(load.rate / load.clients, n, load.seed * 1000 + cid)
    expect, index = expected_fn(load.backend), sample_index(load.input_shape)
    scheduled, sent, answered, batch_done = (np.zeros(n, np.int64) for _ in range(4))
    outcome = np.full(n, PENDING, np.int8)
    copies = [None] * n
    x = np.zeros(load.input_shape, load.dtype)
    flat = x.reshape(-1)
    small = flat.size == len(index)
    name = _await_target(conn)
    if name is None:
        return

    def settle(k, get_answer, stamps_ns=None):
        answered[k] = ring.now_ns()
        if stamps_ns is not None:  # the engine's own stamp of when k's batch finished
            batch_done[k] = stamps_ns[ring.T_DONE]
        try:
            ok = check_answer(copies[k], get_answer(), expect, index, load.input_shape)
            outcome[k] = OK if ok else WRONG
        except RequestTimeout:
            outcome[k] = TIMEOUT
        except EngineError:
            outcome[k] = ERROR

    if server is None:
        client = Client(name)
        pending = {}  # k -> Future, until settled: a kept Future would keep its answer alive

        def done(f, k):
            settle(k, f.result, f.stamps_ns)
            pending.pop(k, None)

        def send(k):
            pending[k] = f = client.submit(x, timeout=load.timeout_s)
            f.add_done_callback(lambda f, k=k: done(f, k))

        def finish():
            for f in list(pending.values()):
                try:
                    f.exception(timeout=load.timeout_s + 10)
                except Exception:
                    pass
            client.close()
    else:
        caller = Caller(server, cid, lambda k, y: settle(k, lambda: y))
        caller.receive_in_background(n, load.timeout_s)

        def send(k):
            caller.send(k, x)

        def finish():
            caller.wait_received(load.timeout_s + 10)

    start_ns = _ready_for_start(conn)
    if start_ns is None:
        return
    for k in paced(offsets, start_ns, scheduled):
        if small:
            flat[:] = tag_value(cid, k)
        else:  # the tag where the answer is checked; the input is copied on send
            flat[index] = tag_value(cid, k)
        copies[k] = flat[index].copy()  # what the answer is checked against
        sent[k] = ring.now_ns()  # the actual arrival, as an in-process sender stamps it
        try:
            send(k)
        except QueueFull:
            outcome[k] = REJECTED
    finish()
    conn.send((scheduled, answered, outcome, sent, batch_done))
    conn.close()


def paced(offsets_ns, start_ns: int, scheduled: np.ndarray):
    """Yields k = 0, 1, ... at start_ns + offsets_ns[k] (recorded in scheduled[k]):
    an open loop's arrival schedule. A late sender is not made up for: its
    lateness counts in the latency measured from the scheduled time."""
    for k, offset in enumerate(offsets_ns):
        scheduled[k] = start_ns + offset
        delay_ns = scheduled[k] - ring.now_ns()
        if delay_ns > 0:
            time.sleep(delay_ns / 1e9)
        yield k


def _fine_timer_slack() -> None:
    """Sleeps wake within ~1 us of their time instead of the default 50 us
    slack: the arrival schedule is the measurement's clock."""
    import ctypes
    ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK


def _forked(target):
    """Runs target in a forked child, first moving the inherited heap out of
    the collector's reach: a full collection would walk (and copy-on-write
    fault) every object of a large parent, stalling the sender for 100s of ms."""
    def run(*args):
        gc.freeze()
        target(*args)
    return run


def _fork_clients(target, args_of, count):
    import multiprocessing
    ctx = multiprocessing.get_context("fork")
    target = _forked(target)
    procs, conns = [], []
    for cid in range(count):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=args_of(cid, child), daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    return procs, conns


def _collect(conns, procs, timeout_s, progress=None) -> list:
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


class _Progress:
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


def _start_server(system: str, load: Load, clients: int, max_batch_size: int,
                  max_delay_ms: float):
    """The baseline server for `system` (None for shmbatch), before clients fork."""
    if system == "shmbatch":
        return None
    return Server(load.backend, load.backend_args, clients,
                  1 if system == "mpq-per-request" else max_batch_size, max_delay_ms)


def _start_engine(name: str, load: Load, **knobs) -> Engine:
    return Engine(name, backend=load.backend, backend_args=load.backend_args,
                  input_shape=load.input_shape, input_dtype=load.dtype,
                  output_shape=load.input_shape, output_dtype=load.dtype, **knobs).start()


def _go(conns, name: str, client_cpus, lead_ns: int) -> int:
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


def _shut(procs, eng, server) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    if eng is not None:
        eng.stop()
    if server is not None:
        server.stop()


def run_row(max_batch_size: int, max_delay_ms: float, load: Load, instances: int = 1,
            system: str = "shmbatch") -> dict:
    """One row: shmbatch (or a baseline) at these knobs under the load; its figures."""
    name = f"bench-{os.getpid()}-{max_batch_size}-{int(max_delay_ms * 1000)}"
    batcher_cpus, client_cpus = placement(instances, load.pin)
    per_client = split_requests(load.requests, load.clients)
    capacity = load.queue_capacity or max(load.requests, max_batch_size)
    server = _start_server(system, load, load.clients, max_batch_size, max_delay_ms)
    if server is not None and batcher_cpus:
        os.sched_setaffinity(server.proc.pid, batcher_cpus[0])
    procs, conns = _fork_clients(_open_loop_client,
                                 lambda cid, conn: (cid, per_client[cid], load, conn, server),
                                 load.clients)
    eng = None
    try:
        if server is None:
            eng = _start_engine(name, load, max_batch_size=max_batch_size,
                                max_delay_ms=max_delay_ms, instances=instances, cpus=batcher_cpus,
                                queue_capacity=max(capacity, max_batch_size))
        start_ns = _go(conns, name, client_cpus, 20_000_000)
        count = (lambda: eng.stats()["answered_total"]) if eng else (lambda: 0)
        bar = _Progress(f"{system} batch {max_batch_size} delay {max_delay_ms:g} ms",
                        load.requests, count)
        results = _collect(conns, procs, load.requests / load.rate * 20 + load.timeout_s + 60, bar)
        bar.close()
        stats = eng.stats() if eng else None
    finally:
        _shut(procs, eng, server)
    scheduled, answered, outcome, sent, batch_done = (np.concatenate([r[i] for r in results])
                                                      for i in range(5))
    good = outcome == OK
    latency = percentiles_ms(answered[good] - scheduled[good])
    from_send = percentiles_ms(answered[good] - sent[good])
    # the design notes' in-process measure: from the send to the end of the batch
    stamped = good & (batch_done > 0)
    to_done = (percentiles_ms(batch_done[stamped] - sent[stamped]) if stamped.any()
               else {"p50": float("nan"), "p99": float("nan")})
    end_ns = answered[outcome != PENDING].max() if (outcome != PENDING).any() else start_ns
    span_s = max(1e-9, (end_ns - start_ns) / 1e9)
    sched_span_s = max(1e-9, (scheduled.max() - start_ns) / 1e9)
    row = {
        "system": system, "max_batch_size": max_batch_size, "max_delay_ms": max_delay_ms,
        "offered_rps": load.rate, "achieved_rps": int(good.sum()) / span_s,
        # this run's own Poisson draw: what was actually offered, over the same start
        "offered_actual_rps": len(outcome) / sched_span_s,
        "requests": int(len(outcome)), "answered": int(good.sum()),
        "wrong": int((outcome == WRONG).sum()), "errors": int((outcome == ERROR).sum()),
        "rejected": int((outcome == REJECTED).sum()), "timeouts": int((outcome == TIMEOUT).sum()),
        "lost": int((outcome == PENDING).sum()),
        "p50_ms": latency["p50"], "p99_ms": latency["p99"], "max_ms": latency["max"],
        # how late the load generator itself sent (included in the latency), and the
        # latency from the actual send, as a sender in the engine's process measures it
        "send_lateness_p99_ms": percentiles_ms(sent - scheduled)["p99"],
        "p50_from_send_ms": from_send["p50"], "p99_from_send_ms": from_send["p99"],
        "p50_send_to_batch_done_ms": to_done["p50"], "p99_send_to_batch_done_ms": to_done["p99"],
        "avg_batch": float("nan"), "max_queue_wait_ms": float("nan"),
        "queue_wait_p99_ms": float("nan"), "mean_service_ms": float("nan"),
    }
    if stats is not None:
        row.update({
            "avg_batch": stats["avg_batch_size"],
            "max_queue_wait_ms": stats["queue_wait_ms"]["max"],
            "queue_wait_p99_ms": stats["queue_wait_ms"]["p99"],
            "mean_service_ms": stats["service_ms"]["mean"],
            "zero_copy_share": stats["zero_copy_batches"] / max(1, stats["batches_total"]),
            "largest_batch": max(stats["batch_size_counts"], default=0),
            "engine_requests": stats["requests_total"],
            "engine_answered": stats["answered_total"],
        })
    return row


def row_line(row: dict) -> str:
    return (f"max_batch {row['max_batch_size']:>3} delay {row['max_delay_ms']:>4g} ms | "
            f"offered {row['offered_rps']:>6.0f} | {row['achieved_rps']:>6.0f} req/s | "
            f"avg batch {row['avg_batch']:>5.1f} | p50 {row['p50_ms']:>8.2f} ms "
            f"p99 {row['p99_ms']:>8.2f} ms (from send {row['p99_from_send_ms']:>7.2f}, "
            f"to batch end {row['p99_send_to_batch_done_ms']:>7.2f}) | "
            f"max queue wait {row['max_queue_wait_ms']:>8.2f} ms | "
            f"mean service {row['mean_service_ms']:>5.2f} ms | "
            f"wrong {row['wrong']} rejected {row['rejected']}")


def compare_line(mine: dict, base: dict) -> str:
    ratio = mine["achieved_rps"] / max(1e-9, base["achieved_rps"])
    return (f"max_batch {base['max_batch_size']:>3} delay {base['max_delay_ms']:>4g} ms | "
            f"{base['system']:>15}: {base['achieved_rps']:>6.0f} req/s p50 {base['p50_ms']:>8.2f} ms "
            f"p99 {base['p99_ms']:>8.2f} ms | shmbatch {mine['achieved_rps']:>6.0f} req/s "
            f"p99 {mine['p99_ms']:>7.2f} ms | throughput x{ratio:.2f}, "
            f"p99 x{base['p99_ms'] / max(1e-9, mine['p99_ms']):.2f} lower | wrong {base['wrong']}")


def environment() -> dict:
    import cffi
    return {"machine": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__,
            "cffi": cffi.__version__, "kernel": platform.release()}


# -- the engine's own overhead: closed loops on the identity backend --------------------

def _closed_loop_client(cid, load: Load, seconds: float, window: int, conn, server=None,
                        lend: bool = False) -> None:
    """Sends back to back for `seconds`: one at a time (window 1, blocking; with
    lend, each written into and answered in a lent slot, Client.request()),
    keeping `window` submitted requests in flight, or -window at a time through
    infer_many; reports count, round trips, wrong."""
    expect, index = expected_fn(load.backend), sample_index(load.input_shape)
    x = np.full(load.input_shape, tag_value(cid, 1), load.dtype)
    sent = x.reshape(-1)[index].copy()
    right = AnswerCheck(sent, expect, index, load.input_shape)
    name = _await_target(conn)
    if name is None:
        return
    client = Client(name) if server is None else None
    caller = Caller(server, cid, None) if server is not None else None
    start_ns = _ready_for_start(conn)
    if start_ns is None:
        return
    while ring.now_ns() < start_ns:
        time.sleep(max(0.0, (start_ns - ring.now_ns()) / 1e9))
    end_ns = start_ns + int(seconds * 1e9)
    round_trips, wrong, count = [], 0, 0
    if window < 0:  # bulk: infer_many of -window requests per call
        xs = np.broadcast_to(x, (-window, *x.shape)).copy()
        while ring.now_ns() < end_ns:
            ys = client.infer_many(xs, timeout=load.timeout_s)
            if expect is not None:  # every answer, at the sampled positions, vectorised
                wrong += int((ys.reshape(len(ys), -1)[:, index] != expect(sent)).any(axis=1).sum())
            count += len(ys)
    elif lend:
        while ring.now_ns() < end_ns:
            t = ring.now_ns()
            with client.request() as lent:
                lent.input[...] = x  # the one copy
                wrong += not right(lent.infer(timeout=load.timeout_s))  # checked in place
            round_trips.append(ring.now_ns() - t)
            count += 1
    elif window == 1:
        out = np.empty(load.input_shape, load.dtype)  # the answers land in one warm buffer
        poison = out.reshape(-1)
        while ring.now_ns() < end_ns:
            poison[index] = np.nan  # a stale answer cannot pass the check
            t = ring.now_ns()
            y = client.infer(x, timeout=load.timeout_s, out=out) if client else caller.call(
                x, load.timeout_s)
            round_trips.append(ring.now_ns() - t)
            wrong += not right(y)
            count += 1
    else:
        from collections import deque
        inflight = deque()
        # big answers land in warm buffers, one per request in flight; small ones in new arrays
        outs = (np.empty((window + 1, *load.input_shape), load.dtype)
                if x.nbytes >= 65536 else None)
        while ring.now_ns() < end_ns:
            if len(inflight) >= window:
                wrong += not right(inflight.popleft().result(timeout=load.timeout_s))
                count += 1
            out = None
            if outs is not None:
                out = outs[(count + len(inflight)) % (window + 1)]
                out.reshape(-1)[index] = np.nan
            inflight.append(client.submit(x, timeout=load.timeout_s, out=out))
        for f in inflight:
            wrong += not right(f.result(timeout=load.timeout_s))
            count += 1
    elapsed_s = (ring.now_ns() - start_ns) / 1e9
    if client:
        client.close()
    conn.send((count, elapsed_s, np.array(round_trips, np.int64), wrong))
    conn.close()


def closed_loop(system: str, clients: int, window: int, load: Load, seconds: float = 2.0,
                max_batch_size: int = 32, lend: bool = False) -> dict:
    name = f"bench-cl-{os.getpid()}"
    server = _start_server(system, load, clients, max_batch_size, 0.0)
    procs, conns = _fork_clients(
        _closed_loop_client, lambda cid, conn: (cid, load, seconds, window, conn, server, lend),
        clients)
    eng = None
    try:
        if server is None:
            eng = _start_engine(name, load, max_batch_size=max_batch_size,
                                queue_capacity=max(64, clients * abs(window)))
        _go(conns, name, None, 50_000_000)
        results = _collect(conns, procs, seconds + load.timeout_s + 60)
    finally:
        _shut(procs, eng, server)
    count = sum(r[0] for r in results)
    elapsed = max(r[1] for r in results)
    rtt = np.concatenate([r[2] for r in results])
    return {"system": system, "clients": clients, "window": window, "lend": lend,
            "requests": count,
            "rps": count / elapsed, "wrong": sum(r[3] for r in results),
            "rtt_p50_us": float(np.percentile(rtt, 50) / 1e3) if len(rtt) else None,
            "rtt_p99_us": float(np.percentile(rtt, 99) / 1e3) if len(rtt) else None}


def copy_once_rps(shape, dtype, repeats: int = 2000) -> float:
    """The copy-once bound: requests/s if each cost one memcpy of its input."""
    src, dst = np.ones(shape, dtype), np.empty(shape, dtype)
    repeats = max(20, min(repeats, int(2e9 / max(1, src.nbytes))))
    np.copyto(dst, src)
    t = time.perf_counter_ns()
    for _ in range(repeats):
        np.copyto(dst, src)
    return 1e9 * repeats / (time.perf_counter_ns() - t)


def overhead(load: Load, seconds: float = 2.0, log=print) -> dict:
    """The engine's own cost, side by side with the baselines, in one run."""
    floor = ring.pingpong_floor_ns(5000)
    spin_floor = ring.pingpong_floor_ns(5000, ring.SPIN_NS)
    out = {"floor_p50_us": float(np.percentile(floor, 50) / 1e3),
           "floor_p99_us": float(np.percentile(floor, 99) / 1e3),
           "spin_floor_p50_us": float(np.percentile(spin_floor, 50) / 1e3),
           "copy_once_rps": copy_once_rps(load.input_shape, load.dtype), "runs": []}
    log(f"futex ping-pong floor (C, 2 processes): p50 {out['floor_p50_us']:.1f} us, "
        f"p99 {out['floor_p99_us']:.1f} us (spinning up to {ring.SPIN_NS / 1e3:.0f} us first: "
        f"p50 {out['spin_floor_p50_us']:.1f} us); copy-once bound "
        f"{out['copy_once_rps']:,.0f} req/s for {load.dtype}{list(load.input_shape)}")
    # in flight per pipelined client: 256, or fewer for big inputs (each slot is committed memory)
    window = 256 if np.prod(load.input_shape) <= 16384 else 8
    plan = ([(s, 1, 1, False) for s in SYSTEMS] + [(s, 8, 1, False) for s in SYSTEMS]
            + [("shmbatch", 2, window, False), ("shmbatch", 2, -window, False),
               ("shmbatch", 1, 1, True), ("shmbatch", 8, 1, True)])
    for system, clients, window, lend in plan:
        run = closed_loop(system, clients, window, load, seconds, lend=lend)
        out["runs"].append(run)
        rtt = (f" | round trip p50 {run['rtt_p50_us']:8.1f} us p99 {run['rtt_p99_us']:8.1f} us "
               f"= x{run['rtt_p50_us'] / out['floor_p50_us']:.2f} the floor"
               if clients == 1 else "")
        how = (f"request() lent" if lend else f"x {window:>3} in flight" if window > 0
               else f"infer_many({-window})")
        ratio = (f" = x{run['rps'] / out['copy_once_rps']:.2f} the copy-once bound"
                 if np.prod(load.input_shape) > 16384 else "")  # a bound for large inputs
        log(f"{system:>16} {clients} client(s) {how}: {run['rps']:>9,.0f} req/s{ratio}{rtt} "
            f"| wrong {run['wrong']}")
    return out


# -- saturation -------------------------------------------------------------------------

def stable(row: dict, max_delay_ms: float) -> bool:
    """A rate is served when all of it is answered right and the answers keep
    pace with the arrivals (the last answer comes soon after the last arrival),
    with a bounded queue: queue waits within 50 ms + 10 batches of service.
    Beyond capacity the backlog grows all through the run and both fail."""
    bound_ms = max_delay_ms + 10 * max(row["mean_service_ms"], 0.1) + 50.0
    return (row["answered"] == row["requests"] and row["wrong"] == 0
            and row["achieved_rps"] >= 0.97 * row["offered_actual_rps"]
            and row["queue_wait_p99_ms"] <= bound_ms)


def saturate(max_batch_size: int, max_delay_ms: float, load: Load, seconds: float = 2.0,
             start_rps: float = 200.0, refinements: int = 5, log=print) -> dict:
    """The highest offered rate served stably: doubles until it fails, then bisects."""
    def probe(rate):
        trial = dataclasses.replace(load, rate=rate, requests=max(200, int(rate * seconds)))
        row = run_row(max_batch_size, max_delay_ms, trial)
        ok = stable(row, max_delay_ms)
        log(f"  probe {rate:>7.0f} req/s: {'served' if ok else 'not served'} "
            f"({row['achieved_rps']:.0f} req/s, queue wait p99 {row['queue_wait_p99_ms']:.1f} ms)")
        return ok, row

    good, bad, best = 0.0, None, None
    rate = start_rps
    while bad is None:
        ok, row = probe(rate)
        if ok:
            good, best, rate = rate, row, rate * 2
        else:
            bad = rate
        if rate > 1e6:
            break
    for _ in range(refinements if bad is not None else 0):
        mid = (good + bad) / 2
        ok, row = probe(mid)
        if ok:
            good, best = mid, row
        else:
            bad = mid
    return {"max_batch_size": max_batch_size, "max_delay_ms": max_delay_ms,
            "capacity_rps": good, "row": best}


# -- output -----------------------------------------------------------------------------

def write_outputs(out_dir: str, result: dict, load: Load) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    plot(os.path.join(out_dir, "bench.png"), result["rows"], load)


def plot(path: str, rows: Sequence[dict], load: Load) -> None:
    plt = tools.pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    delays = sorted({r["max_delay_ms"] for r in rows})
    for d in delays:
        sel = sorted((r for r in rows if r["max_delay_ms"] == d), key=lambda r: r["max_batch_size"])
        xs = [r["max_batch_size"] for r in sel]
        ax1.plot(xs, [r["achieved_rps"] for r in sel], "o-", label=f"measured, delay {d:g} ms")
        ax2.plot(xs, [r["p50_ms"] for r in sel], "o-", label=f"p50, delay {d:g} ms")
        ax2.plot(xs, [r["p99_ms"] for r in sel], "s--", label=f"p99, delay {d:g} ms")
    top = max(r["max_batch_size"] for r in rows)
    if load.backend == "engine.backends:synthetic":
        n = np.arange(1, top + 1)
        args = {"fixed_ms": 2.0, "per_item_us": 100.0, **load.backend_args}
        ax1.plot(n, [theoretical_rps(int(k), float(args["fixed_ms"]), float(args["per_item_us"]))
                     for k in n], "k:", label="capacity n / S(n)")
    offered = rows[0]["offered_rps"] if all(r["offered_rps"] == rows[0]["offered_rps"] for r in rows) else None
    if offered:
        ax1.axhline(offered, color="grey", lw=0.8, label=f"offered {offered:g} req/s")
    ax1.set(xlabel="max_batch_size", ylabel="requests / s", title="throughput")
    ax2.set(xlabel="max_batch_size", ylabel="latency (ms)", title="latency from scheduled arrival",
            yscale="log")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
