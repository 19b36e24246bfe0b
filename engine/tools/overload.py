"""`shmbatch bench --overload`: goodput when the offered load exceeds capacity.

The engine's capacity is measured first: answers per second while it never
idles (3x the cost model's n/S(n), admission "none", every batch full),
counted over the run's steady middle; on a shared machine it is a few percent
below n/S(n) (the sleeps overshoot, Python adds its share per batch), and a
"1x" of n/S(n) would be an overload. Then open-loop Poisson clients (as
bench's rows) offer 0.5x, 1x, 2x and 5x the measured capacity, and a burst
row (10x for 200 ms of every second, 0.5x the rest); every request carries a
deadline (its timeout, --slo-ms). Goodput is the answers that arrive within
their deadline, per second. Each row runs twice, in one run: with admission
by deadline (the default) and with admission "none" (the queue takes
whatever fits, as before).
"""
import dataclasses
import os
from typing import List

import numpy as np

from engine import tools
from engine.client.client import Client
from engine.errors import EngineError, Overloaded, QueueFull, RequestTimeout
from engine.serving.supervisor import Engine
from engine.shm import ring
from engine.tools import load, procs

OK, LATE, REFUSED, OVERLOADED, EXPIRED, ERROR, PENDING = range(7)
ROWS = (("0.5x", 0.5), ("1x", 1.0), ("2x", 2.0), ("5x", 5.0), ("burst", None))
SATURATE = 3.0  # the capacity row offers this many times n/S(n)
BURST = (10.0, 0.2, 0.5)  # 10x for the first 0.2 s of every second, 0.5x the rest


@dataclasses.dataclass(frozen=True)
class Setup:
    fixed_ms: float = 8.0
    per_item_us: float = 100.0
    max_batch_size: int = 16
    queue_capacity: int = 256
    clients: int = 4
    seconds: float = 3.0
    slo_ms: float = 100.0
    urgent_share: float = 0.0  # requests sent at priority 0 (the rest at 1)
    seed: int = 1
    capacity_rps: float = 0.0  # the rows' 1x; 0: measured first (measure_capacity)

    @property
    def model_rps(self) -> float:
        """The cost model's capacity n/S(n), before any overhead."""
        return load.theoretical_rps(self.max_batch_size, self.fixed_ms, self.per_item_us)


def arrivals_ns(rate_of, peak_rps: float, seconds: float, seed: int) -> np.ndarray:
    """Poisson arrivals whose rate varies (rate_of(t) <= peak_rps), by thinning."""
    rng = np.random.default_rng(seed)
    n = int(peak_rps * seconds * 1.2) + 16
    t = np.cumsum(rng.exponential(1.0 / peak_rps, n))
    t = t[t < seconds]
    keep = rng.random(len(t)) < np.array([rate_of(x) for x in t]) / peak_rps
    return (t[keep] * 1e9).astype(np.int64)


def _rate_of(factor, capacity: float):
    if factor is not None:
        return (lambda t: factor * capacity), factor * capacity
    high, width, low = BURST
    return (lambda t: (high if t % 1.0 < width else low) * capacity), high * capacity


def steady_rps(done_ns: np.ndarray, skip_s: float = 0.5, span_s: float = 2.0) -> float:
    """Answers per second from skip_s after the first answer, over span_s (or
    what is left before the last): a saturated engine's pace once its queue
    has filled, before the senders stop."""
    done = np.sort(done_ns)
    if len(done) < 2:
        return 0.0
    start = done[0] + skip_s * 1e9
    end = min(start + span_s * 1e9, done[-1])
    if end <= start:
        return 0.0
    return float(((done >= start) & (done < end)).sum() / ((end - start) / 1e9))


def _client(cid, setup: Setup, capacity_rps: float, factor, observe: bool, conn) -> None:
    """One open-loop client process: its share of the row's arrivals. With
    observe, each request is sent whatever admission would decide, and the
    decision it would have taken is recorded."""
    load.fine_timer_slack()
    rate_of, peak = _rate_of(factor, capacity_rps / setup.clients)
    offsets = arrivals_ns(rate_of, peak, setup.seconds, setup.seed * 1000 + cid)
    n = len(offsets)
    rng = np.random.default_rng(setup.seed * 7919 + cid)
    urgent = rng.random(n) < setup.urgent_share
    outcome = np.full(n, PENDING, np.int8)
    latency_ns, refusal_ns = np.zeros(n, np.int64), np.zeros(n, np.int64)
    would_refuse = np.zeros(n, bool)  # "observe": what admission would have refused
    predicted_ns = np.zeros(n, np.int64)  # "observe": the wait admission predicted
    scheduled = np.zeros(n, np.int64)
    name = procs.await_target(conn)
    if name is None:
        return
    client, deadline_s = Client(name), setup.slo_ms / 1e3
    x = np.zeros(16, np.float32)
    pending = {}

    def done(f, k):
        pending.pop(k, None)
        latency_ns[k] = ring.now_ns() - scheduled[k]
        try:
            f.result()
            outcome[k] = OK if latency_ns[k] <= deadline_s * 1e9 else LATE
        except RequestTimeout:
            outcome[k] = EXPIRED
        except EngineError:
            outcome[k] = ERROR

    start_ns = procs.ready_for_start(conn)
    if start_ns is None:
        return
    for k in load.paced(offsets, start_ns, scheduled):
        # the deadline counts from the scheduled arrival: a late sender gets less
        left_s = deadline_s - (ring.now_ns() - scheduled[k]) / 1e9
        t0 = ring.now_ns()
        try:
            if left_s <= 0:
                raise RequestTimeout("sent after its deadline")
            if observe:  # admission's own rule on the engine's own estimate, not applied
                wait_s = client.predicted_wait_s(0 if urgent[k] else 1)
                predicted_ns[k] = int(wait_s * 1e9) + (ring.now_ns() - scheduled[k])
                would_refuse[k] = ring.refuses(int(wait_s * 1e9), int(left_s * 1e9))
            pending[k] = f = client.submit(x, timeout=left_s, priority=0 if urgent[k] else 1)
            f.add_done_callback(lambda f, k=k: done(f, k))
        except Overloaded:
            outcome[k], refusal_ns[k] = OVERLOADED, ring.now_ns() - t0
        except QueueFull:
            outcome[k], refusal_ns[k] = REFUSED, ring.now_ns() - t0
        except RequestTimeout:
            outcome[k] = EXPIRED
    for f in list(pending.values()):
        try:
            f.exception(timeout=deadline_s + 10)
        except Exception:
            pass
    client.close()
    conn.send((outcome, latency_ns, refusal_ns, urgent, would_refuse, scheduled + latency_ns,
               predicted_ns))
    conn.close()


def run_row(label: str, factor, setup: Setup, admission: str, capacity_rps: float) -> dict:
    """One row: factor x capacity_rps offered (None: the burst) for setup.seconds."""
    name = f"overload-{os.getpid()}"
    batcher_cpus, client_cpus = procs.placement(1, True)
    observe = admission == "observe"  # the engine admits all; the clients note the rule
    children, conns = procs.fork_clients(
        _client, lambda cid, conn: (cid, setup, capacity_rps, factor, observe, conn),
        setup.clients)
    eng = None
    try:
        eng = Engine(name, backend="engine.backends:synthetic",
                           backend_args={"fixed_ms": setup.fixed_ms,
                                         "per_item_us": setup.per_item_us},
                           max_batch_size=setup.max_batch_size,
                           queue_capacity=setup.queue_capacity, cpus=batcher_cpus,
                           priority_levels=2,
                           admission="none" if observe else admission).start()
        procs.go(conns, name, client_cpus, 100_000_000)
        results = procs.collect(conns, children, setup.seconds * 10 + 120)
        stats = eng.stats()
    finally:
        procs.shut(children, eng, None)
    outcome = np.concatenate([r[0] for r in results])
    latency = np.concatenate([r[1] for r in results])
    refusal = np.concatenate([r[2] for r in results])
    urgent = np.concatenate([r[3] for r in results])
    would_refuse = np.concatenate([r[4] for r in results])
    done_ns = np.concatenate([r[5] for r in results])
    answered = np.isin(outcome, (OK, LATE))
    # observe: how much later than predicted the answers came (from the scheduled arrival)
    predicted = np.concatenate([r[6] for r in results])
    after_ms = (latency - predicted)[answered & (predicted > 0)] / 1e6 if observe else []
    refused = np.isin(outcome, (REFUSED, OVERLOADED))
    count = lambda o: int((outcome == o).sum())  # noqa: E731
    pct = lambda a, q: float(np.percentile(a, q)) if len(a) else None  # noqa: E731
    good = count(OK) / setup.seconds
    return {
        "row": label, "admission": admission, "offered_rps": len(outcome) / setup.seconds,
        "offered_x": len(outcome) / setup.seconds / capacity_rps,
        "goodput_rps": good, "goodput_share": good / capacity_rps,
        "steady_rps": steady_rps(done_ns[answered]),
        "requests": len(outcome), "in_time": count(OK), "late": count(LATE),
        "refused": int(refused.sum()), "overloaded": count(OVERLOADED), "expired": count(EXPIRED),
        "errors": count(ERROR), "unsettled": count(PENDING),
        "p50_ms": pct(latency[answered] / 1e6, 50), "p99_ms": pct(latency[answered] / 1e6, 99),
        "urgent_p99_ms": pct(latency[answered & urgent] / 1e6, 99),
        "refusal_p50_us": pct(refusal[refused] / 1e3, 50),
        "refusal_p99_us": pct(refusal[refused] / 1e3, 99),
        "engine_expired": stats["expired_total"], "engine_overloaded": stats["overloaded_total"],
        "engine_admission": stats["admission"],
        # "observe": requests admission would have refused, and those of them that made it
        "would_refuse": int(would_refuse.sum()),
        "would_refuse_in_time": int((would_refuse & (outcome == OK)).sum()),
        "answer_after_prediction_ms": {f"p{q}": pct(after_ms, q) for q in (10, 50, 90, 99)},
    }


def line(r: dict) -> str:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    return (f"{r['row']:>6} {r['admission']:>8} offered {r['offered_rps']:7,.0f}/s "
            f"({r['offered_x']:.1f}x) | goodput {r['goodput_rps']:7,.0f}/s "
            f"= {100 * r['goodput_share']:4.0f} % | refused {r['refused']:6} expired "
            f"{r['expired']:6} late {r['late']:5} | p50 {fmt(r['p50_ms'], '6.1f')} p99 "
            f"{fmt(r['p99_ms'], '6.1f')} ms urgent p99 {fmt(r['urgent_p99_ms'], '6.1f')} ms | "
            f"refusal p50 {fmt(r['refusal_p50_us'], '5.1f')} p99 {fmt(r['refusal_p99_us'], '6.1f')} us"
            + (f" | would refuse {r['would_refuse']}, of them in time {r['would_refuse_in_time']}"
               f" = {100 * r['would_refuse_in_time'] / max(1, r['requests']):.2f} % of requests;"
               f" answers came {fmt(r['answer_after_prediction_ms']['p50'], '.1f')} ms after the "
               f"prediction (p99 {fmt(r['answer_after_prediction_ms']['p99'], '.1f')})"
               if r["admission"] == "observe" else ""))


def measure_capacity(setup: Setup) -> dict:
    """The capacity row: SATURATE x n/S(n) offered with admission "none"; its
    steady_rps is the capacity the other rows are offered multiples of."""
    return run_row("capacity", SATURATE, setup, "none", setup.model_rps)


def run(setup: Setup, out_dir=None, log=print) -> List[dict]:
    log(f"shmbatch bench --overload: synthetic {setup.fixed_ms:g} ms + {setup.per_item_us:g} us "
        f"per item, max_batch_size {setup.max_batch_size}: n/S(n) = {setup.model_rps:,.0f} "
        f"req/s; {setup.clients} open-loop Poisson clients, deadline {setup.slo_ms:g} ms, "
        f"{100 * setup.urgent_share:g} % urgent (priority 0)")
    if setup.capacity_rps:
        saturated, capacity = None, setup.capacity_rps
        log(f"capacity given: {capacity:,.0f} req/s = {100 * capacity / setup.model_rps:.1f} % "
            f"of n/S(n); the rows below are multiples of it")
    else:
        saturated = measure_capacity(setup)
        capacity = saturated["steady_rps"]
        if not capacity > 0:
            raise RuntimeError(f"could not measure the capacity in {setup.seconds:g} s (no "
                               f"steady answers): give --seconds >= 1 or --capacity RPS")
        log(f"capacity measured: {capacity:,.0f} answers/s while saturated ({SATURATE:g}x "
            f"n/S(n) offered, admission 'none') = {100 * capacity / setup.model_rps:.1f} % of "
            f"n/S(n); the rows below are multiples of it")
    rows = []
    for label, factor in ROWS:
        # at loads the engine keeps up with, also the rule observed, not applied: did
        # the requests it would have refused make their deadline?
        modes = ("deadline", "none") + (("observe",) if factor is not None and factor <= 1 else ())
        for mode in modes:
            rows.append(run_row(label, factor, setup, mode, capacity))
            log(line(rows[-1]))
    if out_dir:
        import json
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "overload.json"), "w") as f:
            json.dump({"setup": dataclasses.asdict(setup), "model_rps": setup.model_rps,
                       "capacity_rps": capacity, "capacity_row": saturated, "rows": rows},
                      f, indent=2)
        plot(os.path.join(out_dir, "overload.png"), rows, setup)
        log(f"wrote {out_dir}/overload.json and {out_dir}/overload.png")
    return rows


def plot(path: str, rows: List[dict], setup: Setup) -> None:
    plt = tools.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, style in (("deadline", "o-"), ("none", "s--")):
        sel = sorted((r for r in rows if r["admission"] == mode and r["row"] != "burst"),
                     key=lambda r: r["offered_x"])
        ax.plot([r["offered_x"] for r in sel], [100 * r["goodput_share"] for r in sel], style,
                label=f"admission={mode!r}")
    ax.set_xlabel("offered load (x measured capacity)")
    ax.set_ylabel(f"goodput: answers within {setup.slo_ms:g} ms (% of measured capacity)")
    ax.set_ylim(0, 110)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
