"""`shmbatch bench`: throughput and latency versus max_batch_size.

Each row starts an engine, forks client processes, and drives it OPEN LOOP:
every client sends at Poisson times fixed in advance from a seeded generator,
whether or not its earlier requests were answered, and each request's
latency is counted from its SCHEDULED arrival (a late sender never hides
queueing). Every answer is checked against its own request. The engine's
own figures give queue wait and service time apart.
"""
import dataclasses
import json
import os
import platform
from typing import Sequence

import numpy as np

from engine import tools
from engine.client.client import Client
from engine.errors import EngineError, QueueFull, RequestTimeout
from engine.shm import codes, ring
from engine.tools import procs
from engine.tools.baselines import Caller
from engine.tools.load import (
    Load,
    check_answer,
    expected_fn,
    fine_timer_slack,
    paced,
    percentiles_ms,
    poisson_offsets_ns,
    sample_index,
    split_requests,
    tag_value,
    theoretical_rps,
)

DEFAULT_ROWS = [(1, 0.0), (32, 0.0), (8, 1.0), (32, 2.0), (32, 5.0)]

# outcome codes of one request
PENDING, OK, WRONG, ERROR, REJECTED, TIMEOUT = range(6)


# -- the client processes ----------------------------------------------------------

def _open_loop_client(cid, n, load: Load, conn, server=None) -> None:
    """Runs in a forked process: attach (to the engine, or to a baseline
    server), report ready, wait for the common start time, send n requests
    at their scheduled times, and report every request's outcome."""
    fine_timer_slack()
    offsets = poisson_offsets_ns(load.rate / load.clients, n, load.seed * 1000 + cid)
    expect, index = expected_fn(load.backend), sample_index(load.input_shape)
    scheduled, sent, answered, batch_done = (np.zeros(n, np.int64) for _ in range(4))
    outcome = np.full(n, PENDING, np.int8)
    copies = [None] * n
    x = np.zeros(load.input_shape, load.dtype)
    flat = x.reshape(-1)
    small = flat.size == len(index)
    name = procs.await_target(conn)
    if name is None:
        return

    def settle(k, get_answer, stamps_ns=None):
        answered[k] = ring.now_ns()
        if stamps_ns is not None:  # the engine's own stamp of when k's batch finished
            batch_done[k] = stamps_ns[codes.T_DONE]
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

    start_ns = procs.ready_for_start(conn)
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


def run_row(max_batch_size: int, max_delay_ms: float, load: Load, instances: int = 1,
            system: str = "shmbatch") -> dict:
    """One row: shmbatch (or a baseline) at these knobs under the load; its figures."""
    name = f"bench-{os.getpid()}-{max_batch_size}-{int(max_delay_ms * 1000)}"
    batcher_cpus, client_cpus = procs.placement(instances, load.pin)
    per_client = split_requests(load.requests, load.clients)
    capacity = load.queue_capacity or max(load.requests, max_batch_size)
    server = procs.start_server(system, load, load.clients, max_batch_size, max_delay_ms)
    if server is not None and batcher_cpus:
        os.sched_setaffinity(server.proc.pid, batcher_cpus[0])
    children, conns = procs.fork_clients(
        _open_loop_client, lambda cid, conn: (cid, per_client[cid], load, conn, server),
        load.clients)
    eng = None
    try:
        if server is None:
            eng = procs.start_engine(name, load, max_batch_size=max_batch_size,
                                     max_delay_ms=max_delay_ms, instances=instances,
                                     cpus=batcher_cpus, queue_capacity=max(capacity, max_batch_size))
        start_ns = procs.go(conns, name, client_cpus, 20_000_000)
        count = (lambda: eng.stats()["answered_total"]) if eng else (lambda: 0)
        bar = procs.Progress(f"{system} batch {max_batch_size} delay {max_delay_ms:g} ms",
                             load.requests, count)
        results = procs.collect(conns, children,
                                load.requests / load.rate * 20 + load.timeout_s + 60, bar)
        bar.close()
        stats = eng.stats() if eng else None
    finally:
        procs.shut(children, eng, server)
    scheduled, answered, outcome, sent, batch_done = (np.concatenate([r[i] for r in results])
                                                      for i in range(5))
    good = outcome == OK
    latency = percentiles_ms(answered[good] - scheduled[good])
    from_send = percentiles_ms(answered[good] - sent[good])
    # an in-process measure: from the send to the end of the batch
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
