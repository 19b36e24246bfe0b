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

With length_buckets a batch holds one bucket, padded to its bound: S(n) is
measured and fitted per bucket, and the recommendation is the largest
bucket's (the slowest: what it allows, the shorter buckets allow too; each
is checked).

It also says whether batching pays at all: it shares the fixed cost F of a
call among a batch, so a model whose F is below an engine round trip (tens of
µs) saves less than the sidecar's hop costs; a copy of the model in each
worker then serves more (if one per worker fits). A fit whose F comes out
negative says the fixed cost is too small to resolve: it is reported so,
and flagged in the JSON, which keeps the fit's own figure.

An iterative engine (a step model) is tuned by engine.tools.tune_steps.
"""
import os
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from engine import spec, tools


def batch_sizes(limit: int) -> List[int]:
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    return sizes + [limit]


def random_batch(specs, n: int, rng: np.random.Generator, bucket: Optional[int] = None):
    """n random requests of each input spec (tensors.TensorSpec), at its padded
    shape: (batch, lengths or None) as the batcher would call the backend.
    bucket: a length bucket's bound, to which each variable dim is padded
    instead (never beyond its own bound), as in a batch of that bucket."""
    def shape(spec):
        dims = list(spec.max_shape)
        if bucket is not None and spec.var_axis is not None:
            dims[spec.var_axis] = min(dims[spec.var_axis], int(bucket))
        return tuple(dims)

    def rows(spec):
        dims, dtype = (n, *shape(spec)), np.dtype(spec.dtype)
        if dtype.kind in "iub":  # ids and masks: 0 and 1 are valid for any vocabulary
            return rng.integers(0, 2, dims).astype(dtype)
        return rng.random(dims).astype(dtype)

    def lengths(spec):
        return np.full(n, shape(spec)[spec.var_axis], np.int64)

    if len(specs) == 1 and specs[0].name == "":
        spec = specs[0]
        return rows(spec), (lengths(spec) if spec.var_axis is not None else None)
    batch = {t.name: rows(t) for t in specs}
    variable = {t.name: lengths(t) for t in specs if t.var_axis is not None}
    return batch, (variable or None)


def backend_of(backend, backend_args: dict):
    """The factory's backend, made once in this process; a step model is
    refused with what to say instead (it is tune_steps' to measure)."""
    fn = spec.resolve(backend)(**(backend_args or {}))
    if not callable(fn):
        steps = all(callable(getattr(fn, m, None)) for m in ("join", "step", "leave"))
        hint = ("; it is a step model (join, step, leave): tune it as an iterative engine "
                "(--iterative true, or iterative = true in the config)") if steps else ""
        raise TypeError(f"backend {backend} returned {type(fn).__name__}, which is not "
                        f"callable{hint}")
    return fn


def measure(fn, specs, sizes: Sequence[int], repeats: int = 15,
            bucket: Optional[int] = None) -> Dict[int, float]:
    """S(n) in ms for each n: the median of `repeats` calls of the backend fn
    after one warm-up, on inputs padded to `bucket` (None: the input's bound)."""
    rng = np.random.default_rng(0)
    out = {}
    for n in sizes:
        batch, lengths = random_batch(specs, n, rng, bucket)
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


def fit_record(f_ms: float, c_ms: float) -> dict:
    """The fit as the JSON keeps it: its own figures, and whether F came out
    below what the measurements resolve (negative)."""
    return {"fixed_ms": f_ms, "per_item_ms": c_ms, "fixed_below_resolution": f_ms < 0}


def fit_text(f_ms: float, c_ms: float, name: str = "S(n)", per: str = "row",
             times: Optional[Dict[int, float]] = None) -> str:
    """The fit in words: a negative F is no cost, but one too small to measure;
    and where the line falls below half the smallest batch's own time (times:
    the figures fitted), the cost grows faster than n, which it says."""
    if f_ms >= 0:
        return f"fit: {name} = {f_ms:.3f} ms + n x {c_ms * 1000:.1f} us"
    text = (f"fit: {name} = F + n c, c = {c_ms * 1000:.1f} us a {per}; fixed cost F: below "
            f"measurement resolution (fit gave {f_ms:.3f} ms; the cost is all per {per})")
    if times:
        n = min(times)
        if f_ms + n * c_ms < 0.5 * times[n]:
            text += ". The line misses the small batches: the cost grows faster than n"
    return text


# About an engine round trip, client to batcher and back (bench/RESULTS.md:
# p50 13-16 us, p99 ~50 us): the least fixed cost per call that batching repays.
ROUND_TRIP_MS = 0.05


def pays_note(f_ms: float) -> str:
    """Why batching repays little, where it does (empty where it pays)."""
    if f_ms >= ROUND_TRIP_MS:
        return ""
    fixed = "too small to measure" if f_ms < 0 else f"F = {f_ms:.3f} ms"
    return (f"note: the fixed cost per call ({fixed}) is below an engine round trip "
            f"(~{ROUND_TRIP_MS:g} ms): batching shares little of it, and a copy of the model in "
            f"each worker serves more requests, if one per worker fits")


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


def run(backend, backend_args, specs, slo_ms, limit=64, out_dir=None, log=print, buckets=None):
    """Measures, fits and recommends (module doc); specs: the engine's input
    specs (EngineConfig.input_specs, or tensors.TensorSpec of each input);
    buckets: its length_buckets (EngineConfig.length_buckets: ascending, the
    largest variable bound last), or None."""
    sizes = batch_sizes(limit)
    fn = backend_of(backend, backend_args)
    bounds = tuple(buckets) if buckets else (None,)
    shown = ", ".join(f"{t.name + ': ' if t.name else ''}{t.dtype}{list(t.max_shape)}" for t in specs)
    log(f"backend {backend}{f' {backend_args}' if backend_args else ''}, input {shown}")
    tables = {}
    for bound in bounds:
        service = tables[bound] = measure(fn, specs, sizes, bucket=bound)
        f_ms, c_ms = fit(service)
        if bound is not None:
            rec = recommend(service, slo_ms)
            log(f"\nlength bucket <= {bound} (inputs padded to {bound}): alone it would take "
                f"max_batch_size={rec['max_batch_size']}"
                + ("" if rec["fits_slo"] else " (none fits the SLO)"))
        log(f"{'n':>5} {'S(n) ms':>9} {'fit ms':>9} {'n/S(n) req/s':>13}")
        for n in sizes:
            log(f"{n:>5} {service[n]:>9.3f} {f_ms + n * c_ms:>9.3f} {n / service[n] * 1000:>13,.0f}")
        log(fit_text(f_ms, c_ms, times=service))
    worst = bounds[-1]
    service = tables[worst]
    f_ms, c_ms = fit(service)
    rec = recommend(service, slo_ms)
    if worst is not None:
        n = rec["max_batch_size"]
        over = [b for b in bounds if rec["fits_slo"] and 2 * tables[b][n] + rec["margin_ms"] > slo_ms]
        rec["buckets_over_slo"] = over
        log(f"\nthe recommendation is the largest bucket's (<= {worst}), the slowest: it holds "
            + (f"for every bucket but {over} (slower at n={n}: their batches exceed the SLO)"
               if over else "for every bucket"))
    _log_recommendation(rec, slo_ms, log)
    note = pays_note(f_ms)
    if note:
        log(note)
    result = {"kind": "one-shot", "service_ms": service, "fit": fit_record(f_ms, c_ms),
              "slo_ms": slo_ms, "recommendation": rec}
    if worst is not None:
        result["recommended_for_bucket"] = worst
        result["buckets"] = {b: {"service_ms": tables[b], "fit": fit_record(*fit(tables[b])),
                                 "recommendation": recommend(tables[b], slo_ms)} for b in bounds}
    if out_dir:
        curves = {(f"bucket <= {b}" if b else "measured"): tables[b] for b in bounds}
        write(out_dir, result, curves, "S(n)", (slo_ms / 2, "SLO / 2"), "requests / s")
        log(f"wrote {out_dir}/tune.json and {out_dir}/tune.png")
    return result


def _log_recommendation(rec: dict, slo_ms: float, log) -> None:
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


def write(out_dir: str, result: dict, curves: Dict[str, Dict[int, float]], name: str,
          objective, rate: str) -> None:
    """DIR/tune.json, and DIR/tune.png: each curve's time per call ({n: ms})
    against n with the line of `objective` (ms, label), and its rate n per
    second, the recommended n marked. The fit drawn is the result's."""
    import json

    plt = tools.pyplot()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tune.json"), "w") as f:
        json.dump(result, f, indent=2)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, times in curves.items():
        n = np.array(sorted(times))
        s = np.array([times[k] for k in n])
        a1.plot(n, s, "o-", label=f"{label} {name}")
        a2.plot(n, n / s * 1000, "o-", label=label)
    n = np.array(sorted(list(curves.values())[-1]))  # the curve fitted: the last
    a1.plot(n, result["fit"]["fixed_ms"] + n * result["fit"]["per_item_ms"], "k:",
            label="fit F + n c" + (f" ({list(curves)[-1]})" if len(curves) > 1 else ""))
    a1.axhline(objective[0], color="r", lw=0.8, label=objective[1])
    a1.set(xlabel="batch size n", ylabel="ms", title="time per call")
    a2.axvline(result["recommendation"]["max_batch_size"], color="g", lw=0.8, label="recommended")
    a2.set(xlabel="batch size n", ylabel=rate, title="throughput per instance")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "tune.png"), dpi=110)
    plt.close(fig)
