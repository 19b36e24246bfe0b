"""What a reload costs the requests in flight: `python bench/reload_gap.py`.

3 client processes send back to back (each answer checked: x * 2 + bias)
while the parent reloads the engine N times, each time with the next bias.
Prints, per reload, how long it took and the longest round trip of a request
sent during it, against the median round trip outside reloads; and the
errors, lost requests and answers that went back to an older bias (all 0).
"""
import argparse
import multiprocessing
import time

import numpy as np

import engine
from engine.shm import ring


def offset(bias=0.0, fixed_ms=2.0, per_item_us=50.0):
    """x * 2 + bias, at the synthetic cost fixed_ms + n * per_item_us."""
    def run(batch):
        ring.spin_ns(int(fixed_ms * 1e6 + len(batch) * per_item_us * 1e3))
        return batch * 2 + np.float32(bias)
    return run


def client(name, cid, stop, q):
    rows = []  # (sent_ns, done_ns, bias or -1 on error)
    x = np.full(16, cid, np.float32)
    with engine.Client(name) as c:
        while not stop.is_set():
            t = ring.now_ns()
            try:
                y = c.infer(x, timeout=30)
                bias = float(y[0] - 2 * cid)
                rows.append((t, ring.now_ns(), bias if np.all(y == 2 * x + bias) else -2))
            except engine.EngineError:
                rows.append((t, ring.now_ns(), -1))
    q.put(np.array(rows))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--reloads", type=int, default=5)
    args = p.parse_args()
    name = f"reload-gap-{multiprocessing.current_process().pid}"
    ctx = multiprocessing.get_context("fork")
    with engine.Engine(name, backend="reload_gap:offset", backend_args={"bias": 0.0},
                       max_batch_size=8) as eng:
        stop, q = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=client, args=(name, c, stop, q)) for c in range(3)]
        for proc in procs:
            proc.start()
        time.sleep(1.0)  # steady state before the first reload (a measurement's warm-up)
        windows = []
        for k in range(1, args.reloads + 1):
            t0 = ring.now_ns()
            eng.reload(backend_args={"bias": float(k)})
            windows.append((t0, ring.now_ns()))
            time.sleep(0.5)
        stop.set()
        results = [q.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(10)
        stats = eng.stats()
    rows = np.concatenate(results)
    rtt_ms = (rows[:, 1] - rows[:, 0]) / 1e6
    during = np.zeros(len(rows), bool)
    print(f"3 clients, synthetic 2 ms + 50 us/item, max_batch 8; {len(rows)} requests, "
          f"{args.reloads} reloads")
    for k, (t0, t1) in enumerate(windows, 1):
        sel = (rows[:, 0] <= t1) & (rows[:, 1] >= t0)
        during |= sel
        print(f"reload {k}: took {(t1 - t0) / 1e6:7.1f} ms | requests in flight during it: "
              f"{int(sel.sum()):>4}, longest round trip {rtt_ms[sel].max():6.1f} ms")
    back = sum(int((np.diff(r[:, 2][r[:, 2] >= 0]) < 0).sum()) for r in results)
    print(f"round trip outside reloads: p50 {np.median(rtt_ms[~during]):.2f} ms, max "
          f"{rtt_ms[~during].max():.1f} ms | errors {int((rows[:, 2] == -1).sum())} "
          f"wrong {int((rows[:, 2] == -2).sum())} went back to an older bias {back} | "
          f"engine: requests {stats['requests_total']} answered {stats['answered_total']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
