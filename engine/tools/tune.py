"""`shmbatch tune`: choose max_batch_size and max_delay_ms from the backend's cost.

Measures the backend's service time S(n) for batch sizes up to a limit (in
this process, median of repeated calls on random inputs of the engine's
padded shapes: one array, or named tensors), fits the cost model
S(n) = F + n c, and recommends:

- max_batch_size: where throughput n / S(n) flattens (the smallest n within
  10 % of the best measured) among the n whose tail fits the SLO. Under load a
  request can wait for the batch in service and then be served in the next,
  so the tail is about 2 S(n): we need 2 S(n) + margin <= SLO, with
  margin = max(1 ms, 10 % of SLO). This maximises throughput within the SLO;
- max_delay_ms: 0. Under load batches form by themselves, from the requests
  that arrive while the previous batch computes; a delay would make every
  request that arrives alone wait for it, for nothing, at low load. What the
  SLO would still allow (SLO - 2 S(n) - margin) is reported as the delay
  budget: spend it only to trade the latency of every request at low load
  for fewer, fuller batches (less compute per request).

It also says whether batching pays at all: it shares the fixed cost F of a
call among a batch, so a model whose F is below an engine round trip (tens of
µs) saves less than the sidecar's hop costs; a copy of the model in each
worker then serves more (if one per worker fits).
"""
import os
import time
from typing import Dict, List, Sequence

import numpy as np

from engine import spec, tools


def batch_sizes(limit: int) -> List[int]:
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    return sizes + [limit]


def random_batch(specs, n: int, rng: np.random.Generator):
    """n random requests of each input spec (tensors.TensorSpec), at its padded
    shape: (batch, lengths or None) as the batcher would call the backend."""
    def rows(spec):
        shape, dtype = (n, *spec.max_shape), np.dtype(spec.dtype)
        if dtype.kind in "iub":  # ids and masks: 0 and 1 are valid for any vocabulary
            return rng.integers(0, 2, shape).astype(dtype)
        return rng.random(shape).astype(dtype)

    def lengths(spec):
        return np.full(n, spec.max_shape[spec.var_axis], np.int64)

    if len(specs) == 1 and specs[0].name == "":
        spec = specs[0]
        return rows(spec), (lengths(spec) if spec.var_axis is not None else None)
    batch = {t.name: rows(t) for t in specs}
    variable = {t.name: lengths(t) for t in specs if t.var_axis is not None}
    return batch, (variable or None)


def measure(backend, backend_args: dict, specs, sizes: Sequence[int],
            repeats: int = 15) -> Dict[int, float]:
    """S(n) in ms for each n: the median of `repeats` calls after one warm-up."""
    fn = spec.resolve(backend)(**(backend_args or {}))
    rng = np.random.default_rng(0)
    out = {}
    for n in sizes:
        batch, lengths = random_batch(specs, n, rng)
        args = (batch,) if lengths is None else (batch, lengths)
        fn(*args)
        times = []
        for _ in range(repeats):
            t = time.perf_counter_ns()
            fn(*args)
            times.append(time.perf_counter_ns() - t)
        out[n] = float(np.median(times)) / 1e6
    return out


def fit(service_ms: Dict[int, float]):
    """(F ms, c ms per item) of S(n) = F + n c, least squares."""
    n = np.array(sorted(service_ms), dtype=float)
    s = np.array([service_ms[int(k)] for k in n])
    if len(n) < 2:
        return float(s[0]), 0.0
    c, f = np.polyfit(n, s, 1)
    return float(f), float(c)


# About an engine round trip, client to batcher and back (bench/RESULTS.md:
# p50 13-16 us, p99 ~50 us): the least fixed cost per call that batching repays.
ROUND_TRIP_MS = 0.05


def recommend(service_ms: Dict[int, float], slo_ms: float) -> dict:
    rec = _recommend(service_ms, slo_ms)
    rec["batching_pays"] = fit(service_ms)[0] >= ROUND_TRIP_MS
    return rec


def _recommend(service_ms: Dict[int, float], slo_ms: float) -> dict:
    margin_ms = max(1.0, 0.1 * slo_ms)
    throughput = {n: n / (s / 1000.0) for n, s in service_ms.items()}
    fitting = [n for n in sorted(service_ms) if 2 * service_ms[n] + margin_ms <= slo_ms]
    if not fitting:
        n = min(service_ms)
        return {"max_batch_size": n, "max_delay_ms": 0.0, "delay_budget_ms": 0.0,
                "margin_ms": margin_ms, "fits_slo": False, "throughput_rps": throughput[n]}
    best = max(throughput[n] for n in fitting)
    n = next(k for k in fitting if throughput[k] >= 0.9 * best)
    budget = max(0.0, slo_ms - 2 * service_ms[n] - margin_ms)
    return {"max_batch_size": n, "max_delay_ms": 0.0, "delay_budget_ms": round(budget, 3),
            "margin_ms": margin_ms, "fits_slo": True, "throughput_rps": throughput[n]}


def run(backend, backend_args, specs, slo_ms, limit=64, out_dir=None, log=print):
    """Measures, fits and recommends (module doc); specs: the engine's input
    specs (EngineConfig.input_specs, or tensors.TensorSpec of each input)."""
    sizes = batch_sizes(limit)
    service = measure(backend, backend_args, specs, sizes)
    f_ms, c_ms = fit(service)
    rec = recommend(service, slo_ms)
    shown = ", ".join(f"{t.name + ': ' if t.name else ''}{t.dtype}{list(t.max_shape)}" for t in specs)
    log(f"backend {backend} {backend_args or ''}, input {shown}")
    log(f"{'n':>5} {'S(n) ms':>9} {'fit ms':>9} {'n/S(n) req/s':>13}")
    for n in sizes:
        log(f"{n:>5} {service[n]:>9.3f} {f_ms + n * c_ms:>9.3f} {n / service[n] * 1000:>13,.0f}")
    log(f"fit: S(n) = {f_ms:.3f} ms + n x {c_ms * 1000:.1f} us")
    if rec["fits_slo"]:
        log(f"recommend for SLO {slo_ms:g} ms: max_batch_size={rec['max_batch_size']} "
            f"max_delay_ms=0 (~{rec['throughput_rps']:,.0f} req/s per instance)")
        log(f"  max_batch_size: the most throughput within the SLO (a request may wait for the "
            f"batch in service, then its own: 2 S(n) + margin {rec['margin_ms']:g} ms <= SLO)")
        log(f"  max_delay_ms 0: under load batches form while the previous one computes; a "
            f"delay makes every lone request wait it. The SLO leaves up to "
            f"{rec['delay_budget_ms']:g} ms, worth spending only for fuller batches (less "
            f"compute per request) at the price of every request's latency at low load")
    else:
        log(f"no batch size fits SLO {slo_ms:g} ms (2 S(1) + margin > SLO): "
            f"max_batch_size={rec['max_batch_size']} max_delay_ms=0, and add instances")
    if not rec["batching_pays"]:
        log(f"note: the fixed cost per call, F = {f_ms:.3f} ms, is below an engine round trip "
            f"(~{ROUND_TRIP_MS:g} ms): batching shares little of it, and a copy of the model in "
            f"each worker serves more requests, if one per worker fits")
    result = {"service_ms": service, "fit": {"fixed_ms": f_ms, "per_item_ms": c_ms},
              "slo_ms": slo_ms, "recommendation": rec}
    if out_dir:
        _write(out_dir, result)
        log(f"wrote {out_dir}/tune.json and {out_dir}/tune.png")
    return result


def _write(out_dir: str, result: dict) -> None:
    import json

    plt = tools.pyplot()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tune.json"), "w") as f:
        json.dump(result, f, indent=2)
    service = result["service_ms"]
    n = np.array(sorted(service))
    s = np.array([service[k] for k in n])
    fit_s = result["fit"]["fixed_ms"] + n * result["fit"]["per_item_ms"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(n, s, "o", label="measured S(n)")
    a1.plot(n, fit_s, "k:", label="fit F + n c")
    a1.axhline(result["slo_ms"] / 2, color="r", lw=0.8, label="SLO / 2")
    a1.set(xlabel="batch size n", ylabel="ms", title="service time")
    a2.plot(n, n / s * 1000, "o-", label="n / S(n)")
    a2.axvline(result["recommendation"]["max_batch_size"], color="g", lw=0.8, label="recommended")
    a2.set(xlabel="batch size n", ylabel="requests / s", title="throughput per instance")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "tune.png"), dpi=110)
    plt.close(fig)
