"""The sampler's cost per step, beside the step itself (GPT-2's LM head).

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 PYTHONPATH=TREE python bench/sampler_cost.py [--repeat 30]

(one thread per pool, as an unpinned batcher beside others should compute:
engine/batching/threads.py; on a shared 2-core VM a 2-thread pool waits on
its other thread for ms.)

For 1, 8 and 64 rows over GPT-2's vocabulary (V = 50,257), Rows.sample on
numpy float32 logits and, where torch is installed, on torch CPU tensors
(which the numpy path reads through a view) and on the same made to take the
torch path (as tensors on a GPU do; here torch's CPU kernels). Rows: greedy;
temperature 0.8 + top_p 0.9 + top_k 50; temperature 1 alone (no truncation);
top_p 0.9 alone (its nucleus, ~2,300 ids here: numpy gathers ~3,700 by a p
threshold, torch reads 1,024 candidates, then 4,096); top_p 0.99 alone; the
second with logprobs=5. "The step itself": the LM head's matmul, [n, 768] @ [768,
50257] float32, numpy and torch. Logits are N(0, 1) * 3, about as peaked as a
small LM's. Medians of --repeat calls of wall time, after one unmeasured.
"""
import argparse
import os
import statistics
import time

import numpy as np

from engine.batching import sampler
from engine.batching.sampler import Rows
from engine.sampling import Sampling

VOCAB, HIDDEN = 50_257, 768
CONFIGS = {
    "greedy": Sampling(temperature=0),
    "T 0.8, top_p 0.9, top_k 50": Sampling(temperature=0.8, top_p=0.9, top_k=50),
    "temperature 1 (OpenAI's default)": Sampling(),
    "top_p 0.9 alone": Sampling(top_p=0.9),
    "top_p 0.99 alone": Sampling(top_p=0.99),
    "T 0.8, top_p 0.9, top_k 50, logprobs 5": Sampling(temperature=0.8, top_p=0.9, top_k=50,
                                                       logprobs=5),
}


def median_ms(call, repeat: int) -> float:
    call()
    times = []
    for _ in range(repeat):
        begun = time.perf_counter()
        call()
        times.append(time.perf_counter() - begun)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    head = (rng.standard_normal((HIDDEN, VOCAB)) * 0.02).astype(np.float32)
    print(f"ms per step, median of {args.repeat}; numpy {np.__version__}"
          + (f", torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch
             else " (torch not installed)")
          + f"; OMP/OPENBLAS_NUM_THREADS {os.environ.get('OMP_NUM_THREADS')}/"
          + f"{os.environ.get('OPENBLAS_NUM_THREADS')}")
    print("| rows | per step | numpy | torch CPU tensor | torch ops on CPU |")
    print("|---:|---|---:|---:|---:|")
    for n in (1, 8, 64):
        logits = (rng.standard_normal((n, VOCAB)) * 3).astype(np.float32)
        hidden = rng.standard_normal((n, HIDDEN)).astype(np.float32)
        cells = [median_ms(lambda: hidden @ head, args.repeat)]
        if torch is not None:
            th, tw = torch.from_numpy(hidden), torch.from_numpy(head)
            cells.append(median_ms(lambda: th @ tw, args.repeat))
        print(f"| {n} | the step: [n, 768] @ [768, 50257] | " + " | ".join(
            f"{c:.2f}" for c in cells) + (" | |" if torch is not None else " |"))
        for name, params in CONFIGS.items():
            rows = Rows(n, seed=1)
            rows.add([params] * n)
            cells = [median_ms(lambda: rows.sample(logits), args.repeat)]
            if torch is not None:
                tl = torch.from_numpy(logits)
                cells.append(median_ms(lambda: rows.sample(tl), args.repeat))
                sampler.TORCH_CPU_AS_NUMPY = False  # the device path, as on a GPU
                cells.append(median_ms(lambda: rows.sample(tl), args.repeat))
                sampler.TORCH_CPU_AS_NUMPY = True
            print(f"| {n} | {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
