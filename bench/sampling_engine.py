"""A sampling engine's tokens/s, sampled beside greedy, at the same running batch.

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=TREE:TREE/bench \
        python bench/sampling_engine.py [--rounds 5] [--steps 32] [--batches 1,8,32]

The step model has GPT-2's vocabulary and hidden size: a random LM head W
[768, 50257] float32 in numpy; each request keeps a hidden state h [768], and
a step is H @ W over the running requests' states (then h += W[:, token]
/ 10, tanh'd, so the next logits depend on the token sampled). One batcher,
sampling=True. At each running batch size B, B requests are submitted at
once (max_steps --steps, ignore_eos: every one runs its full length) and
their answers awaited: tokens/s = B * steps / wall time. Rounds alternate
greedy (temperature 0) and sampled (temperature 0.8, top_p 0.95, top_k 50)
in the one engine; the medians are reported, with the sampled/greedy ratio.
Beside them, the engine's processes' CPU time per token (user + system, from
psutil), whose ratio a shared machine's load moves far less than wall time's.
"""
import argparse
import os
import statistics
import time

import numpy as np
import psutil

import engine

VOCAB, HIDDEN = 50_257, 768


class Head:
    """join/step of a random LM head over per-request hidden states."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.w = (rng.standard_normal((HIDDEN, VOCAB), np.float32) * 0.1).astype(np.float32)
        self.states: dict = {}

    def join(self, ids, x, lengths=None):
        h = np.stack([np.tanh(self.w[:, np.asarray(row) % VOCAB].sum(axis=1) / 10)
                      for row in x]).astype(np.float32)
        for id_, row in zip(ids.tolist(), h):
            self.states[id_] = row
        return h @ self.w

    def step(self, ids, tokens):
        h = np.stack([self.states[i] for i in ids.tolist()])
        h = np.tanh(h + self.w[:, tokens].T / 10).astype(np.float32)
        for id_, row in zip(ids.tolist(), h):
            self.states[id_] = row
        return h @ self.w, np.zeros(len(ids), bool)

    def leave(self, ids):
        for id_ in ids.tolist():
            self.states.pop(id_, None)


def head(seed: int = 0) -> Head:
    return Head(seed)


def engine_cpu_s() -> float:
    """User + system CPU seconds of this process's children (the engine's)."""
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def tokens_per_s(c, batch: int, steps: int, sampling):
    """(tokens/s, the engine's CPU ms per token) of batch requests at once."""
    prompts = [np.array([7 + i, 11 * i + 3, 5], np.int64) for i in range(batch)]
    cpu0, t0 = engine_cpu_s(), time.perf_counter()
    futures = [c.submit(p, timeout=600, max_steps=steps, sampling=sampling) for p in prompts]
    got = sum(len(f.result(timeout=600)) for f in futures)
    wall, cpu = time.perf_counter() - t0, engine_cpu_s() - cpu0
    return got / wall, cpu * 1e3 / got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--batches", default="1,8,32")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    greedy = engine.Sampling(temperature=0, ignore_eos=True)
    sampled = engine.Sampling(temperature=0.8, top_p=0.95, top_k=50, ignore_eos=True)
    with engine.Engine(name=f"sampling-bench-{os.getpid()}", backend="sampling_engine:head",
                       iterative=True, sampling=True, input_shape=(None,), input_dtype="int64",
                       max_input_shape=(8,), max_steps=a.steps, max_batch_size=max(batches),
                       queue_capacity=max(64, 2 * max(batches)), max_delay_ms=20.0,
                       eos_token_ids=[50256]) as eng, engine.Client(eng.name) as c:
        tokens_per_s(c, 1, 2, greedy)  # warm: the head's pages, the first join
        print("| running batch | greedy tokens/s | sampled tokens/s | sampled / greedy "
              "| greedy CPU ms/token | sampled CPU ms/token | sampled / greedy |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for batch in batches:
            runs = {"greedy": [], "sampled": []}
            for _ in range(a.rounds):
                runs["greedy"].append(tokens_per_s(c, batch, a.steps, greedy))
                runs["sampled"].append(tokens_per_s(c, batch, a.steps, sampled))
            (g, gc), (s, sc) = ([statistics.median(r[i] for r in runs[k]) for i in (0, 1)]
                                for k in ("greedy", "sampled"))
            print(f"| {batch} | {g:.1f} | {s:.1f} | {s / g:.2f} | {gc:.2f} | {sc:.2f} "
                  f"| {sc / gc:.2f} |", flush=True)


if __name__ == "__main__":
    main()
