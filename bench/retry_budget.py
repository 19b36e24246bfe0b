"""Retries under overload: Client(retries=3) and its budget beside naive retry loops.

    python bench/retry_budget.py [--seconds 4] [--clients 8] [--factor 5] [--slo-ms 100]
                                 [--seed 1] [--rounds 1] [--json out.json]

An engine (synthetic 20 ms + 250 us per item, max_batch_size 8: n/S(n) = 364
req/s; admission by deadline, the default) is offered --factor times n/S(n)
by --clients open-loop Poisson client processes (asyncio, one task per
arrival), the same seeded arrivals in each row. Every request carries a
deadline: timeout = --slo-ms from its scheduled arrival. Rows:

- budget: Client(retries=3), infer_async(): refusals retried with backoff,
  within the deadline and the client's retry budget;
- naive: Client(), and a loop that catches QueueFull (Overloaded included)
  and sends again at once, up to 3 times, with the same timeout each time
  (as such loops are written);
- none: Client(), no retry (for scale).

Goodput: answers that arrive within their deadline (from the scheduled
arrival), per second; every answer is checked against its own request.
Retry share: retries sent / requests. "attempts" are what reached the engine
(requests + retries), "engine refused" what it refused of them. With
--rounds R the rows run R times, in a rotated order each round (a shared
machine's load drifts), and each mode's median goodput is printed last.
"""
import argparse
import asyncio
import json
import os
import sys

import numpy as np

from engine.client.client import Client
from engine.errors import EngineError, QueueFull, RequestTimeout
from engine.serving.supervisor import Engine
from engine.shm import ring
from engine.tools import load, overload, procs

FIXED_MS, PER_ITEM_US, MAX_BATCH = 20.0, 250.0, 8
RETRIES = 3
OK, LATE, REFUSED, EXPIRED, ERROR, WRONG, PENDING = range(7)
MODES = ("budget", "naive", "none")


def _client(cid, mode, args, conn) -> None:
    """One open-loop client process: its share of the arrivals, sent as `mode` says."""
    load.fine_timer_slack()
    rate = args.factor * load.theoretical_rps(MAX_BATCH, FIXED_MS, PER_ITEM_US) / args.clients
    offsets = overload.arrivals_ns(lambda t: rate, rate, args.seconds, args.seed * 1000 + cid)
    n, deadline_s = len(offsets), args.slo_ms / 1e3
    outcome = np.full(n, PENDING, np.int8)
    latency_ns, scheduled = np.zeros(n, np.int64), np.zeros(n, np.int64)
    naive_retries = [0]
    name = procs.await_target(conn)
    if name is None:
        return
    client = Client(name, retries=RETRIES if mode == "budget" else 0)

    async def naive(x, timeout):
        for attempt in range(RETRIES + 1):
            try:
                return await client.infer_async(x, timeout=timeout)
            except QueueFull:
                if attempt == RETRIES:
                    raise
                naive_retries[0] += 1

    async def one(k: int) -> None:
        x = np.full(16, load.tag_value(cid, k), np.float32)
        timeout = max(0.0, deadline_s - (ring.now_ns() - scheduled[k]) / 1e9)
        try:
            y = await (naive(x, timeout) if mode == "naive"
                       else client.infer_async(x, timeout=timeout))
            latency_ns[k] = ring.now_ns() - scheduled[k]
            if not np.array_equal(y, x * 2 + 1):
                outcome[k] = WRONG
            else:
                outcome[k] = OK if latency_ns[k] <= deadline_s * 1e9 else LATE
        except QueueFull:
            outcome[k] = REFUSED
        except RequestTimeout:
            outcome[k] = EXPIRED
        except EngineError:
            outcome[k] = ERROR

    async def send_all(start_ns: int) -> None:
        tasks = []
        for k, offset in enumerate(offsets):
            scheduled[k] = start_ns + offset
            delay_ns = scheduled[k] - ring.now_ns()
            if delay_ns > 0:
                await asyncio.sleep(delay_ns / 1e9)
            tasks.append(asyncio.create_task(one(k)))
        await asyncio.gather(*tasks)

    start_ns = procs.ready_for_start(conn)
    if start_ns is None:
        return
    asyncio.run(send_all(start_ns))
    retries = client.retries_total if mode == "budget" else naive_retries[0]
    client.close()
    conn.send((outcome, retries))
    conn.close()


def run_row(mode: str, args) -> dict:
    name = f"retry-budget-{os.getpid()}"
    batcher_cpus, client_cpus = procs.placement(1, True)
    children, conns = procs.fork_clients(_client, lambda cid, conn: (cid, mode, args, conn),
                                         args.clients)
    eng = None
    try:
        eng = Engine(name, backend="engine.backends:synthetic",
                     backend_args={"fixed_ms": FIXED_MS, "per_item_us": PER_ITEM_US},
                     max_batch_size=MAX_BATCH, queue_capacity=256, cpus=batcher_cpus).start()
        procs.go(conns, name, client_cpus, 100_000_000)
        results = procs.collect(conns, children, args.seconds * 10 + 120)
        stats = eng.stats()
    finally:
        procs.shut(children, eng, None)
    outcome = np.concatenate([r[0] for r in results])
    retries = sum(r[1] for r in results)
    count = lambda o: int((outcome == o).sum())  # noqa: E731
    requests = len(outcome)
    return {
        "mode": mode, "requests": requests, "offered_rps": requests / args.seconds,
        "goodput_rps": count(OK) / args.seconds, "in_time": count(OK), "late": count(LATE),
        "refused": count(REFUSED), "expired": count(EXPIRED), "errors": count(ERROR),
        "wrong": count(WRONG), "unsettled": count(PENDING),
        "retries": retries, "retry_share": retries / max(1, requests),
        "attempts": requests + retries,
        "engine_refused": stats["overloaded_total"] + stats["rejected_total"],
        "engine_enqueued": stats["requests_total"], "engine_expired": stats["expired_total"],
    }


def line(r: dict) -> str:
    return (f"{r['mode']:>6}: {r['requests']} requests ({r['offered_rps']:,.0f}/s) | goodput "
            f"{r['goodput_rps']:6,.1f}/s ({r['in_time']} in time, {r['late']} late) | retries "
            f"{r['retries']} = {100 * r['retry_share']:5.1f} % of requests | attempts "
            f"{r['attempts']}, engine refused {r['engine_refused']}, enqueued "
            f"{r['engine_enqueued']}, expired {r['engine_expired']} | client: refused "
            f"{r['refused']}, timed out {r['expired']}, errors {r['errors']}, wrong {r['wrong']}"
            f", unsettled {r['unsettled']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--factor", type=float, default=5.0)
    p.add_argument("--slo-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json")
    args = p.parse_args()
    model_rps = load.theoretical_rps(MAX_BATCH, FIXED_MS, PER_ITEM_US)
    print(f"retry_budget: synthetic {FIXED_MS:g} ms + {PER_ITEM_US:g} us per item, max_batch_size "
          f"{MAX_BATCH}: n/S(n) = {model_rps:,.0f} req/s, offered {args.factor:g}x by "
          f"{args.clients} open-loop clients for {args.seconds:g} s, deadline {args.slo_ms:g} ms, "
          f"retries {RETRIES}, seed {args.seed}")
    rows, modes = [], args.modes.split(",")
    for k in range(args.rounds):
        for mode in modes[k % len(modes):] + modes[:k % len(modes)]:
            rows.append(run_row(mode, args))
            print(line(rows[-1]), flush=True)
    if args.rounds > 1:
        for mode in modes:
            mine = [r for r in rows if r["mode"] == mode]
            print(f"{mode:>6}: median goodput {np.median([r['goodput_rps'] for r in mine]):6,.1f}/s"
                  f", retries {np.median([r['retry_share'] for r in mine]) * 100:5.1f} % of "
                  f"requests ({args.rounds} rounds)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "model_rps": model_rps, "rows": rows}, f, indent=2)
    return 1 if any(r["wrong"] or r["unsettled"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
