"""`shmbatch bench --model decoder`: a transformer decoder served the one-shot way
and the iterative way, on the same open-loop arrivals in the same run.

The model is engine.tools.decoder's transformer (random weights from a seed).
Prompt and output lengths are drawn from geometric distributions (long
tails: mean 32, capped), seeded, and each request asks for its own number
of tokens (max_steps). The one-shot way is a one-shot engine whose backend
runs the whole generate loop of its batch (every row until the longest is
done; the answer comes at the end); the iterative way is an iterative
engine whose requests join and leave the running batch at every step and
stream their tokens. Every answer is checked against the model decoding
that request alone.

With `http` (engine.tools.decoder_http), the same requests at the same
times also go to the iterative engine through HTTP: served by `shmbatch
serve`, through Triton's generate_stream and OpenAI's /v1/completions, and to
a FastAPI + StreamingResponse baseline doing the same model work; `pin` puts
the model on the last CPU (the engine's batcher; the baseline's process) and
the callers on the others (serve's HTTP workers with the clients that call
them), in every row.

Then the engine's own cost per step: the step's wall time (the engine's
service figure) minus the model's time inside it (join and step, timed in
the batcher), at 1, 8 and 32 active requests; and a client's CPU per chunk.
"""
import asyncio
import dataclasses
import json
import multiprocessing
import os
import tempfile
import time
from typing import List, Optional

import numpy as np

from engine.tools import decoder
from engine.client.client import Client
from engine.serving import processes
from engine.serving.supervisor import Engine
from engine.shm import ring
from engine.tools import decoder_http
from engine.tools import load as loads

ONE_SHOT, ITERATIVE = "one-shot", "iterative"


@dataclasses.dataclass
class Setup:
    seconds: float = 8.0           # of arrivals per row
    rates: Optional[tuple] = None  # offered requests/s; None: 0.25x, 1x, 3x the one-shot capacity
    max_batch_size: int = 16
    max_steps: int = 128
    max_prompt: int = 128
    mean_prompt: float = 32.0
    mean_output: float = 32.0
    clients: int = 2
    timeout_s: float = 300.0
    seed: int = 1
    model: dict = dataclasses.field(default_factory=dict)  # engine.tools.decoder.Decoder's arguments
    min_requests: int = 32         # a row's requests at least (enough for a p99 at a low rate)
    cost_actives: tuple = (1, 8, 32)  # the engine's own cost per step at these running batches
    cost_seconds: float = 3.0
    one_shot: bool = True          # the one-shot way's row at each rate
    http: tuple = ()               # rows of engine.tools.decoder_http.ROWS, after the Client's
    http_workers: int = 1
    pin: bool = False              # serving processes on the last CPU, clients on the others


# -- what is offered ------------------------------------------------------------------

def draw(setup: Setup, n: int, seed: int, vocab: int):
    """n requests: (prompt int64[len], new tokens), lengths geometric and capped."""
    rng = np.random.default_rng(seed)
    prompts = np.minimum(rng.geometric(1 / setup.mean_prompt, n), setup.max_prompt)
    outputs = np.minimum(rng.geometric(1 / setup.mean_output, n), setup.max_steps)
    return [(rng.integers(0, vocab, int(p)).astype(np.int64), int(o))
            for p, o in zip(prompts, outputs)]


def engine_settings(mode: str, setup: Setup, name: str) -> dict:
    common = dict(max_batch_size=setup.max_batch_size, queue_capacity=1024,
                  backend_args=dict(setup.model), drain_timeout_s=setup.timeout_s)
    if mode == ITERATIVE:
        return dict(name=name, backend="engine.tools.decoder:steps", iterative=True,
                    max_steps=setup.max_steps, input_shape=(None,), input_dtype="int64",
                    max_input_shape=(setup.max_prompt,), output_shape=(), output_dtype="int64",
                    **common)
    common["backend_args"]["steps"] = setup.max_steps
    return dict(name=name, backend="engine.tools.decoder:generate",
                inputs={"prompt": ["int64", [None]], "max_new_tokens": ["int64", [1]]},
                max_input_shapes={"prompt": [setup.max_prompt]},
                outputs={"tokens": ["int64", [setup.max_steps]]}, **common)


def one_shot_capacity_rps(setup: Setup, seed: int, batches: int = 2) -> float:
    """The one-shot way's capacity, measured on its engine: `batches` full
    batches of drawn requests sent at once, until the last is answered."""
    vocab = decoder.Decoder(**setup.model).vocab
    offered = draw(setup, setup.max_batch_size * batches, seed, vocab)
    name = f"bench-dec-{os.getpid()}-capacity"
    with Engine(**engine_settings(ONE_SHOT, setup, name)), Client(name) as client:
        started = time.perf_counter()
        futures = [client.submit({"prompt": p, "max_new_tokens": np.array([o], np.int64)},
                                 timeout=setup.timeout_s) for p, o in offered]
        for f in futures:
            f.result()
        took = time.perf_counter() - started
    return len(offered) / took


# -- a client process ---------------------------------------------------------------

def _client(name: str, mode: str, requests: list, cpus, conn) -> None:
    """Sends its requests at their scheduled times (open loop, asyncio) and
    reports, per request: index, scheduled, first chunk, end (ns), the gaps
    between chunks (ns), and its tokens (or the error)."""
    loads.fine_timer_slack()
    if cpus:
        os.sched_setaffinity(0, cpus)
    client = Client(name, wait_s=30)
    conn.send("ready")
    start_ns = conn.recv()
    timeout = float(conn.recv())

    async def one(index, offset_ns, prompt, steps):
        scheduled = start_ns + offset_ns
        delay = (scheduled - ring.now_ns()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)
        times, tokens = [], []
        try:
            if mode == ITERATIVE:
                async for token in client.stream_async(prompt, timeout=timeout, max_steps=steps):
                    times.append(ring.now_ns())
                    tokens.append(int(token))
            else:
                answer = await client.infer_async(
                    {"prompt": prompt, "max_new_tokens": np.array([steps], np.int64)},
                    timeout=timeout)
                tokens = answer["tokens"].tolist()
                tokens = tokens[:steps] if all(t == -1 for t in tokens[steps:]) else tokens
                times = [ring.now_ns()] * len(tokens)  # every chunk at once, at the end
        except Exception as e:
            return (index, scheduled, 0, ring.now_ns(), [], f"{type(e).__name__}: {e}")
        gaps = np.diff(times).tolist()
        return (index, scheduled, times[0], times[-1], gaps, tokens)

    async def main():
        return await asyncio.gather(*(one(*r) for r in requests))

    conn.send(asyncio.run(main()))
    client.close()


def run_row(mode: str, setup: Setup, rate: float, offered: list, oracle: list, row: int):
    """One row: the engine of `mode`, these requests at `rate`, every answer
    checked (an HTTP row's skip: a string saying why)."""
    name = f"bench-dec-{os.getpid()}-{mode}-{row}"
    settings = engine_settings(ITERATIVE if mode in decoder_http.ROWS else mode, setup, name)
    if decoder_http.server_cpus(setup.pin):  # the batcher on its core, in every row
        settings["cpus"] = [decoder_http.server_cpus(setup.pin)]
    if mode in decoder_http.ROWS:
        got = decoder_http.run_row(mode, setup, settings, rate, offered, row)
        if isinstance(got, str):
            return got
        out = summarize(mode, rate, got.results, oracle, got.stats)
        out["server_cpu_us_per_chunk"] = got.cpu_us_per_chunk
        return out
    offsets = loads.poisson_offsets_ns(rate, len(offered), setup.seed + row)
    ctx = multiprocessing.get_context("fork")
    with Engine(**settings) as eng:
        parts = [[] for _ in range(setup.clients)]
        for k, (prompt, steps) in enumerate(offered):
            parts[k % setup.clients].append((k, int(offsets[k]), prompt, steps))
        pipes, procs = [], []
        for part in parts:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_client, daemon=True, args=(
                name, mode, part, decoder_http.client_cpus(setup.pin), child))
            p.start()
            pipes.append(parent)
            procs.append(p)
        for conn in pipes:
            conn.recv()
        start_ns = ring.now_ns() + 200_000_000
        for conn in pipes:
            conn.send(start_ns)
            conn.send(setup.timeout_s)
        results = [r for conn in pipes for r in conn.recv()]
        for p in procs:
            p.join(30)
        stats = eng.stats()
    return summarize(mode, rate, results, oracle, stats)


def summarize(mode: str, rate: float, results: list, oracle: list, stats: dict) -> dict:
    answered = [r for r in results if not isinstance(r[5], str)]
    wrong = sum(1 for r in answered if r[5] != oracle[r[0]])
    ttft = np.array([r[2] - r[1] for r in answered], np.int64)
    e2e = np.array([r[3] - r[1] for r in answered], np.int64)
    gaps = np.array([g for r in answered for g in r[4]], np.int64)
    tokens = sum(len(r[5]) for r in answered)
    span_ns = (max(r[3] for r in answered) - min(r[1] for r in results)) if answered else 1

    def pct(ns):
        p = loads.percentiles_ms(ns)
        return {"p50": p["p50"], "p99": p["p99"]}
    errors = sorted({r[5].split(":")[0] for r in results if isinstance(r[5], str)})
    return {"mode": mode, "offered_rps": rate, "tokens_per_s": tokens / (span_ns / 1e9),
            "ttft_ms": pct(ttft), "chunk_ms": pct(gaps), "e2e_ms": pct(e2e),
            "requests": len(results), "answered": len(answered), "wrong": wrong,
            "errors": errors, "avg_batch_size": stats["avg_batch_size"]}


def row_line(r: dict) -> str:
    return (f"{r['mode']:>15} {r['offered_rps']:7.1f} req/s: {r['tokens_per_s']:7.0f} tokens/s  "
            f"TTFT p50 {r['ttft_ms']['p50']:8.1f} p99 {r['ttft_ms']['p99']:8.1f} ms  "
            f"chunk p50 {r['chunk_ms']['p50']:6.2f} p99 {r['chunk_ms']['p99']:6.2f} ms  "
            f"e2e p99 {r['e2e_ms']['p99']:8.1f} ms  answered {r['answered']}/{r['requests']} "
            f"wrong {r['wrong']}  batch {r['avg_batch_size']:.1f}"
            + (f"  server CPU {r['server_cpu_us_per_chunk']:.0f} us a chunk"
               if "server_cpu_us_per_chunk" in r else ""))


def _oracles(model_args: dict, offered: list, conn) -> None:
    model = decoder.Decoder(**model_args)
    conn.send([model.generate_one(p, s).tolist() for p, s in offered])


def oracles(setup: Setup, offered: list) -> List[list]:
    """Each request decoded alone (the answers every row is checked against),
    in a forked process per CPU (as every process of the bench: plain forks
    and pipes, which leave no helper process behind)."""
    ctx = multiprocessing.get_context("fork")
    parts = max(1, min(4, len(os.sched_getaffinity(0)), len(offered)))
    pipes, procs = [], []
    for k in range(parts):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_oracles, args=(setup.model, offered[k::parts], child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    answers: List[list] = [[] for _ in offered]
    for k, conn in enumerate(pipes):
        answers[k::parts] = conn.recv()
    for p in procs:
        p.join(30)
    return answers


# -- the engine's own cost per step ---------------------------------------------------

def _batcher_cpus():
    """The batcher on the last CPU, the clients on the others (with two or more)."""
    cpus = sorted(os.sched_getaffinity(0))
    return [[cpus[-1]]] if len(cpus) > 1 else None


def _pin_clients() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(0, cpus[:-1])


def timed_steps(path: str, **model_args):
    """engine.tools.decoder's step model, timing its own join and step calls into
    the file at path: [model ns, steps] (int64)."""
    inner = decoder.steps(**model_args)
    acc = np.memmap(path, np.int64, mode="r+", shape=(2,))

    class Timed:
        def join(self, ids, batch, lengths=None):
            started = time.perf_counter_ns()
            inner.join(ids, batch, lengths)
            acc[0] += time.perf_counter_ns() - started

        def step(self, ids):
            started = time.perf_counter_ns()
            out = inner.step(ids)
            acc[0] += time.perf_counter_ns() - started
            acc[1] += 1
            return out

        def leave(self, ids):
            inner.leave(ids)
    return Timed()


def _closed_loop(name: str, streams: int, seconds: float, prompt: int, steps: int, vocab: int,
                 seed: int, conn) -> None:
    """`streams` threads, each streaming one request after another; reports
    (chunks, CPU seconds of this process, errors)."""
    import threading
    _pin_clients()
    client = Client(name, wait_s=30)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, prompt).astype(np.int64) for _ in range(streams)]
    until = time.monotonic() + seconds
    counts, errors = [0] * streams, []

    def loop(k):
        try:
            while time.monotonic() < until:
                for _ in client.stream(prompts[k], timeout=60, max_steps=steps):
                    counts[k] += 1
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    cpu = time.process_time()
    threads = [threading.Thread(target=loop, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    conn.send((sum(counts), time.process_time() - cpu, errors))
    client.close()


def engine_cost(setup: Setup) -> list:
    """Per step: wall time, the model's time in it, and the rest (the
    engine's own), with `active` requests streaming; and client CPU per chunk."""
    rows = []
    ctx = multiprocessing.get_context("fork")
    actives, seconds = setup.cost_actives, setup.cost_seconds
    for active in actives:
        fd, path = tempfile.mkstemp(prefix="shmbatch-cost-")
        os.close(fd)
        np.zeros(2, np.int64).tofile(path)
        name = f"bench-cost-{os.getpid()}-{active}"
        try:
            settings = engine_settings(ITERATIVE, dataclasses.replace(setup, max_batch_size=max(actives)),
                                       name)
            settings.update(backend="engine.tools.decoder_bench:timed_steps",
                            backend_args={"path": path, **setup.model}, cpus=_batcher_cpus())
            with Engine(**settings) as eng:
                parent, child = ctx.Pipe()
                vocab = decoder.Decoder(**setup.model).vocab
                p = ctx.Process(target=_closed_loop, args=(
                    name, active, seconds, min(16, setup.max_prompt), min(64, setup.max_steps),
                    vocab, setup.seed, child))
                p.start()
                chunks, cpu_s, errors = parent.recv()
                p.join(30)
                if errors:
                    raise RuntimeError(f"the closed loop's streams failed: {errors[0]}")
                s = eng.stats()
            model_ns, steps = np.fromfile(path, np.int64)
        finally:
            os.unlink(path)
        wall_ms = s["service_ms"]["mean"]
        model_ms = model_ns / max(1, s["steps_total"]) / 1e6
        rows.append({"active": active, "avg_active": s["avg_batch_size"], "steps": int(steps),
                     "step_wall_ms": wall_ms, "model_ms": model_ms,
                     "engine_us": (wall_ms - model_ms) * 1e3,
                     "engine_share": (wall_ms - model_ms) / model_ms if model_ms else 0.0,
                     "client_cpu_us_per_chunk": cpu_s / max(1, chunks) * 1e6})
    return rows


def cost_line(r: dict) -> str:
    return (f"  {r['active']:>2} active (mean {r['avg_active']:.1f}): step {r['step_wall_ms']:.3f} ms, "
            f"model {r['model_ms']:.3f} ms, engine {r['engine_us']:.0f} us "
            f"({100 * r['engine_share']:.1f} % of the model's); client "
            f"{r['client_cpu_us_per_chunk']:.0f} us CPU a chunk")


# -- the whole bench ------------------------------------------------------------------

def run(setup: Setup, out_dir: Optional[str] = None) -> dict:
    # the model's matrices are small: a second BLAS thread per batcher would only spin
    # against the clients (the batchers start with this environment)
    for var in processes.THREAD_POOLS:
        os.environ.setdefault(var, "1")
    decoder_http.check(setup.http)
    model = decoder.Decoder(**setup.model)
    measured = setup.one_shot or not setup.rates
    capacity = one_shot_capacity_rps(setup, setup.seed) if measured else 0.0
    rates = setup.rates or tuple(round(capacity * f, 1) for f in (0.25, 1.0, 3.0))
    print(f"shmbatch bench --model decoder: {model.layers} layers, d_model {model.d}, vocab "
          f"{model.vocab}, max_batch_size {setup.max_batch_size}; "
          + (f"the one-shot way's capacity {capacity:.1f} req/s (measured); " if measured else "")
          + f"{setup.seconds:g} s of Poisson arrivals a row, "
          f"prompt and output lengths geometric (mean {setup.mean_prompt:g}, "
          f"{setup.mean_output:g}; capped {setup.max_prompt}, {setup.max_steps})", flush=True)
    result = {"setup": dataclasses.asdict(setup), "rows": []}
    for row, rate in enumerate(rates):
        n = max(setup.min_requests, int(rate * setup.seconds))
        offered = draw(setup, n, setup.seed + 1000 * row, model.vocab)
        oracle = oracles(setup, offered)
        for mode in (ONE_SHOT,) * setup.one_shot + (ITERATIVE,) + tuple(setup.http):
            r = run_row(mode, setup, rate, offered, oracle, row)
            if isinstance(r, str):
                print(f"{mode:>15} {rate:7.1f} req/s: skipped: {r}", flush=True)
                continue
            result["rows"].append(r)
            print(row_line(r), flush=True)
    print("\nthe engine's own cost per step (step wall time - model time):", flush=True)
    result["engine_cost"] = engine_cost(setup)
    for r in result["engine_cost"]:
        print(cost_line(r), flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "bench.json"), "w") as f:
            json.dump(result, f, indent=2)
        plot(os.path.join(out_dir, "bench.png"), result["rows"])
    return result


def plot(path: str, rows: list) -> None:
    from engine import tools
    plt = tools.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {ONE_SHOT: "s--", ITERATIVE: "o-"}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        style = styles.get(mode, "^:")
        sel = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["offered_rps"])
        xs = [r["offered_rps"] for r in sel]
        ax1.plot(xs, [r["tokens_per_s"] for r in sel], style, label=mode)
        ax2.plot(xs, [r["ttft_ms"]["p99"] for r in sel], style, label=mode)
    ax1.set(xlabel="offered requests / s", ylabel="output tokens / s", title="throughput")
    ax2.set(xlabel="offered requests / s", ylabel="time to first token, p99 (ms)",
            title="time to first token", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
