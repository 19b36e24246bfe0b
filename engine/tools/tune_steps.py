"""`shmbatch tune` of an iterative engine: max_batch_size from the step time.

An iterative engine's factory returns a step model (engine.batching.iterative:
join, step, leave). Each step gives every one of the n requests of the
running batch its next output token, so the time per output token (TPOT) of
every stream is the step time T(n). A request's first token (TTFT) waits out
the step in service, then its join (prefill) and the step after it: about
J(1) + 2 T(n).

Measured in this process, for each running batch size n: n requests join
with random prompts of the input's padded shape (the longest: the slowest),
a few steps of the n are timed, and they leave; a request that says it is
done (or reaches max_steps) ends its group early, and n fresh ones join, so
every step timed has n. Medians of the repeats; fit T(n) = F + n c. A
sampling engine's model (sampling=True: join and step give logits) is fed
each row's argmax, as at temperature 0; picking it is not timed (the
sampler's own cost per step: bench/sampler_cost.py).
Recommends:

- max_batch_size: the largest measured n with T(n) + margin <= TPOT (and,
  with a TTFT objective, J(1) + 2 T(n) + margin <= TTFT), margin = 10 % of
  the objective (the engine's own work per step, and the joins of newcomers
  between steps). The running batch reaches n only under load, and a cap
  below what the objectives allow makes requests queue for whole answers to
  end: the most they allow, not the knee of the throughput;
- max_delay_ms: 0, as for a one-shot engine (engine.tools.tune).

Not measured: the memory n requests' state (KV caches) takes, and steps late
in a long answer (the timed ones are the first after a join).
"""
import math
import time
from typing import Dict, Optional, Sequence

import numpy as np

from engine import spec
from engine.tools import tune

STEPS_PER_GROUP = 5  # steps timed per join of n: a few, so the joins are sampled too


def step_model_of(backend, backend_args: dict):
    """The factory's step model, made once in this process."""
    model = spec.resolve(backend)(**(backend_args or {}))
    missing = [m for m in ("join", "step", "leave") if not callable(getattr(model, m, None))]
    if missing:
        raise TypeError(f"an iterative engine's factory returns a step model with join, step "
                        f"and leave; {backend} returned {type(model).__name__} without {missing}")
    return model


def measure(model, specs, sizes: Sequence[int], max_steps: int = 256, repeats: int = 15,
            sampling: bool = False):
    """({n: T(n) ms}, {n: J(n) ms}): the median of `repeats` steps of n
    requests, and of the joins of n at once (after one untimed group);
    sampling: the model gives logits and is fed tokens (module doc)."""
    rng = np.random.default_rng(0)
    per_group = max(1, min(int(max_steps), STEPS_PER_GROUP))
    next_id = 1
    steps_ms, joins_ms = {}, {}
    for n in sizes:
        steps, joins = [], []
        warm = False
        while len(steps) < repeats:
            ids = np.arange(next_id, next_id + n, dtype=np.int64)
            next_id += n
            batch, lengths = tune.random_batch(specs, n, rng)
            t = time.perf_counter_ns()
            logits = model.join(ids.copy(), batch, lengths)
            joined = time.perf_counter_ns() - t
            took = []
            try:
                for _ in range(per_group if warm else 1):
                    tokens = greedy_tokens(logits, n) if sampling else None
                    t = time.perf_counter_ns()
                    logits, done = model.step(ids.copy(), tokens) if sampling else \
                        model.step(ids.copy())
                    took.append(time.perf_counter_ns() - t)
                    done = np.asarray(done, bool)
                    if done.shape != (n,):
                        raise ValueError(f"step of {n} requests returned done of shape "
                                         f"{done.shape}, expected ({n},)")
                    if done.any():  # the engine would leave it: the batch is no longer n
                        break
            finally:
                model.leave(ids.copy())
            if warm:
                steps += took
                joins.append(joined)
            warm = True
        steps_ms[n] = float(np.median(steps[:repeats])) / 1e6
        joins_ms[n] = float(np.median(joins)) / 1e6
    return steps_ms, joins_ms


def greedy_tokens(logits, n: int) -> np.ndarray:
    """int64[n]: each row's argmax of a sampling model's logits [n, V] (numpy,
    or a torch tensor on any device); ValueError for another shape."""
    shape = tuple(getattr(logits, "shape", ()))
    if len(shape) != 2 or shape[0] != n:
        raise ValueError(f"a sampling model's join and step give logits [n, V]: expected "
                         f"[{n}, V], got {type(logits).__name__} of shape {list(shape)}")
    tokens = logits.argmax(-1)
    tokens = tokens.cpu().numpy() if hasattr(tokens, "cpu") else np.asarray(tokens)
    return tokens.astype(np.int64)


def recommend(steps_ms: Dict[int, float], joins_ms: Dict[int, float], tpot_ms: float,
              ttft_ms: Optional[float] = None) -> dict:
    """max_batch_size for the objectives (module doc), what stopped it there,
    and where the fit would put the limit between the sizes measured."""
    tpot_margin = 0.1 * tpot_ms
    ttft_margin = None if ttft_ms is None else 0.1 * ttft_ms
    join_1 = joins_ms[min(joins_ms)]

    def first_token(n):
        return join_1 + 2 * steps_ms[n]

    def fails(n):
        """The objective n misses first, or None."""
        if steps_ms[n] + tpot_margin > tpot_ms:
            return "tpot"
        if ttft_ms is not None and first_token(n) + ttft_margin > ttft_ms:
            return "ttft"
        return None

    sizes = sorted(steps_ms)
    fitting = [n for n in sizes if fails(n) is None]
    n = max(fitting) if fitting else sizes[0]
    above = [k for k in sizes if k > n]
    f_ms, c_ms = tune.fit(steps_ms)
    return {"max_batch_size": n, "max_delay_ms": 0.0, "fits": bool(fitting),
            "limited_by": fails(n) if not fitting else (fails(above[0]) if above else "max_batch"),
            "tpot_margin_ms": tpot_margin, "ttft_margin_ms": ttft_margin,
            "step_ms": steps_ms[n], "ttft_estimate_ms": first_token(n),
            "tokens_per_s": n / steps_ms[n] * 1000.0,
            "fit_limit": _fit_limit(f_ms, c_ms, tpot_ms - tpot_margin,
                                    None if ttft_ms is None else ttft_ms - ttft_margin, join_1)}


def _fit_limit(f_ms, c_ms, tpot_room, ttft_room, join_1) -> Optional[int]:
    """The largest n whose fitted step meets the objectives (None: the fit
    does not grow with n, or not even n = 1 meets them)."""
    if c_ms <= 0:
        return None
    room = tpot_room if ttft_room is None else min(tpot_room, (ttft_room - join_1) / 2)
    n = math.floor((room - f_ms) / c_ms)
    return n if n >= 1 else None


def run(backend, backend_args, specs, tpot_ms, ttft_ms=None, limit=64, max_steps=256,
        out_dir=None, log=print, sampling=False):
    """Measures, fits and recommends (module doc); specs: the engine's input
    specs (EngineConfig.input_specs), the prompt's; sampling: the engine's."""
    sizes = tune.batch_sizes(limit)
    model = step_model_of(backend, backend_args)
    steps_ms, joins_ms = measure(model, specs, sizes, max_steps, sampling=sampling)
    f_ms, c_ms = tune.fit(steps_ms)
    rec = recommend(steps_ms, joins_ms, tpot_ms, ttft_ms)
    shown = ", ".join(f"{t.name + ': ' if t.name else ''}{t.dtype}{list(t.max_shape)}" for t in specs)
    log(f"step model {backend}{f' {backend_args}' if backend_args else ''}, prompt {shown} (the longest)"
        + (", fed its argmax (sampling)" if sampling else ""))
    log(f"{'n':>5} {'T(n) ms':>9} {'fit ms':>9} {'J(n) ms':>9} {'TTFT~ ms':>9} {'tokens/s':>10}")
    for n in sizes:
        log(f"{n:>5} {steps_ms[n]:>9.3f} {f_ms + n * c_ms:>9.3f} {joins_ms[n]:>9.3f} "
            f"{joins_ms[1] + 2 * steps_ms[n]:>9.3f} {n / steps_ms[n] * 1000:>10,.0f}")
    log("T(n): a step of n requests (each one's next token); J(n): n joining at once "
        "(prefill); TTFT~: J(1) + 2 T(n)")
    log(tune.fit_text(f_ms, c_ms, "T(n)", "request", steps_ms))
    _log_recommendation(rec, tpot_ms, ttft_ms, log)
    result = {"kind": "iterative", "step_ms": steps_ms, "join_ms": joins_ms,
              "fit": tune.fit_record(f_ms, c_ms), "tpot_ms": tpot_ms, "ttft_ms": ttft_ms,
              "max_steps": max_steps, "recommendation": rec}
    if out_dir:
        tune.write(out_dir, result, {"measured": steps_ms}, "T(n)", (tpot_ms, "TPOT"),
                   "tokens / s")
        log(f"wrote {out_dir}/tune.json and {out_dir}/tune.png")
    return result


def _log_recommendation(rec: dict, tpot_ms: float, ttft_ms: Optional[float], log) -> None:
    n = rec["max_batch_size"]
    objectives = f"TPOT {tpot_ms:g} ms" + ("" if ttft_ms is None else f", TTFT {ttft_ms:g} ms")
    if not rec["fits"]:
        what = (f"a step of one request takes {rec['step_ms']:.3f} ms (+ margin "
                f"{rec['tpot_margin_ms']:g} ms)" if rec["limited_by"] == "tpot" else
                f"the first token of one request takes ~{rec['ttft_estimate_ms']:.3f} ms (+ "
                f"margin {rec['ttft_margin_ms']:g} ms)")
        log(f"no running batch size meets {objectives}: {what}. max_batch_size=1 "
            f"max_delay_ms=0, and a faster model (or shorter prompts) is needed")
        return
    log(f"recommend for {objectives}: max_batch_size={n} max_delay_ms=0 "
        f"(~{rec['tokens_per_s']:,.0f} tokens/s per instance, {rec['step_ms']:.3f} ms a token, "
        f"first token ~{rec['ttft_estimate_ms']:.3f} ms)")
    log(f"  max_batch_size: the largest running batch whose step meets the time per output "
        f"token (T(n) + margin {rec['tpot_margin_ms']:g} ms <= TPOT)"
        + ("" if ttft_ms is None else f" and whose first token meets TTFT (J(1) + 2 T(n) + "
                                      f"margin {rec['ttft_margin_ms']:g} ms <= TTFT)"))
    reason = {"tpot": "the next size measured misses the TPOT",
              "ttft": "the next size measured misses the TTFT",
              "max_batch": "every size measured meets them: a larger --max-batch may allow more"}
    limit = rec["fit_limit"]
    log(f"  {reason[rec['limited_by']]}"
        + ("" if limit is None else f" (the fit puts the limit near n = {limit})"))
    log("  a larger running batch gives more tokens/s, and a lower cap makes requests queue "
        "for whole answers to end; the memory of n requests' state (KV caches) is not "
        "measured: max_batch_tokens caps it")
    log("  max_delay_ms 0: under load requests join at every step; a delay makes a lone "
        "request wait it before its first token")
