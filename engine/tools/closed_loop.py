"""The engine's own overhead: closed loops on the identity backend.

Each client sends back to back for a while in one of four modes, and every
answer is checked against its own request:

  blocking   one infer() at a time (its round trip timed)
  lent       one request at a time written into a lent slot (Client.request())
  pipelined  `depth` submit() Futures kept in flight
  bulk       infer_many() of `depth` requests per call
"""
import os
import time
from collections import deque

import numpy as np

from engine.client.client import Client
from engine.shm import ring
from engine.tools import baselines, procs
from engine.tools.baselines import Caller
from engine.tools.load import AnswerCheck, Load, expected_fn, sample_index, tag_value

MODES = ("blocking", "lent", "pipelined", "bulk")


def _client(cid, load: Load, seconds: float, mode: str, depth: int, conn, server=None) -> None:
    """Runs in a forked process: sends for `seconds` in `mode`; reports count,
    elapsed seconds, round trips (blocking and lent) and wrong answers."""
    expect, index = expected_fn(load.backend), sample_index(load.input_shape)
    x = np.full(load.input_shape, tag_value(cid, 1), load.dtype)
    sent = x.reshape(-1)[index].copy()
    right = AnswerCheck(sent, expect, index, load.input_shape)
    name = procs.await_target(conn)
    if name is None:
        return
    client = Client(name) if server is None else None
    caller = Caller(server, cid, None) if server is not None else None
    start_ns = procs.ready_for_start(conn)
    if start_ns is None:
        return
    procs.sleep_until(start_ns)
    end_ns = start_ns + int(seconds * 1e9)
    round_trips, wrong, count = [], 0, 0
    if mode == "bulk":
        xs = np.broadcast_to(x, (depth, *x.shape)).copy()
        while ring.now_ns() < end_ns:
            ys = client.infer_many(xs, timeout=load.timeout_s)
            if expect is not None:  # every answer, at the sampled positions, vectorised
                wrong += int((ys.reshape(len(ys), -1)[:, index] != expect(sent)).any(axis=1).sum())
            count += len(ys)
    elif mode == "lent":
        while ring.now_ns() < end_ns:
            t = ring.now_ns()
            with client.request() as lent:
                lent.input[...] = x  # the one copy
                wrong += not right(lent.infer(timeout=load.timeout_s))  # checked in place
            round_trips.append(ring.now_ns() - t)
            count += 1
    elif mode == "blocking":
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
    else:  # pipelined
        inflight = deque()
        # big answers land in warm buffers, one per request in flight; small ones in new arrays
        outs = np.empty((depth + 1, *load.input_shape), load.dtype) if x.nbytes >= 65536 else None
        while ring.now_ns() < end_ns:
            if len(inflight) >= depth:
                wrong += not right(inflight.popleft().result(timeout=load.timeout_s))
                count += 1
            out = None
            if outs is not None:
                out = outs[(count + len(inflight)) % (depth + 1)]
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


def closed_loop(system: str, clients: int, mode: str, load: Load, seconds: float = 2.0,
                depth: int = 1, max_batch_size: int = 32) -> dict:
    """`clients` processes in `mode` (depth: Futures in flight, or requests per
    infer_many) against shmbatch or a baseline server; requests/s and round trips."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "blocking" and system != "shmbatch":
        raise ValueError(f"the baselines run blocking clients only, not {mode!r}")
    name = f"bench-cl-{os.getpid()}"
    server = procs.start_server(system, load, clients, max_batch_size, 0.0)
    children, conns = procs.fork_clients(
        _client, lambda cid, conn: (cid, load, seconds, mode, depth, conn, server), clients)
    eng = None
    try:
        if server is None:
            eng = procs.start_engine(name, load, max_batch_size=max_batch_size,
                                     queue_capacity=max(64, clients * depth))
        procs.go(conns, name, None, 50_000_000)
        results = procs.collect(conns, children, seconds + load.timeout_s + 60)
    finally:
        procs.shut(children, eng, server)
    count = sum(r[0] for r in results)
    elapsed = max(r[1] for r in results)
    rtt = np.concatenate([r[2] for r in results])
    return {"system": system, "clients": clients, "mode": mode, "depth": depth,
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
    floor = baselines.pingpong_floor_ns(5000)
    spin_floor = baselines.pingpong_floor_ns(5000, ring.SPIN_NS)
    out = {"floor_p50_us": float(np.percentile(floor, 50) / 1e3),
           "floor_p99_us": float(np.percentile(floor, 99) / 1e3),
           "spin_floor_p50_us": float(np.percentile(spin_floor, 50) / 1e3),
           "copy_once_rps": copy_once_rps(load.input_shape, load.dtype), "runs": []}
    log(f"futex ping-pong floor (C, 2 processes): p50 {out['floor_p50_us']:.1f} us, "
        f"p99 {out['floor_p99_us']:.1f} us (spinning up to {ring.SPIN_NS / 1e3:.0f} us first: "
        f"p50 {out['spin_floor_p50_us']:.1f} us); copy-once bound "
        f"{out['copy_once_rps']:,.0f} req/s for {load.dtype}{list(load.input_shape)}")
    # in flight per pipelined client: 256, or fewer for big inputs (each slot is committed memory)
    depth = 256 if np.prod(load.input_shape) <= 16384 else 8
    plan = ([(s, 1, "blocking", 1) for s in procs.SYSTEMS]
            + [(s, 8, "blocking", 1) for s in procs.SYSTEMS]
            + [("shmbatch", 2, "pipelined", depth), ("shmbatch", 2, "bulk", depth),
               ("shmbatch", 1, "lent", 1), ("shmbatch", 8, "lent", 1)])
    for system, clients, mode, n in plan:
        run = closed_loop(system, clients, mode, load, seconds, depth=n)
        out["runs"].append(run)
        rtt = (f" | round trip p50 {run['rtt_p50_us']:8.1f} us p99 {run['rtt_p99_us']:8.1f} us "
               f"= x{run['rtt_p50_us'] / out['floor_p50_us']:.2f} the floor"
               if clients == 1 else "")
        how = {"blocking": "x   1 in flight", "lent": "request() lent",
               "pipelined": f"x {n:>3} in flight", "bulk": f"infer_many({n})"}[mode]
        ratio = (f" = x{run['rps'] / out['copy_once_rps']:.2f} the copy-once bound"
                 if np.prod(load.input_shape) > 16384 else "")  # a bound for large inputs
        log(f"{system:>16} {clients} client(s) {how}: {run['rps']:>9,.0f} req/s{ratio}{rtt} "
            f"| wrong {run['wrong']}")
    return out
