"""A randomly initialised transformers GPT-2 served by an iterative engine
(continuous batching) on a GPU (or, slowly, the CPU); every streamed answer
is checked against the HF model's own greedy generate() of that prompt alone.

    python bench/gpt2_stream.py                    # cuda if available, else cpu
    python bench/gpt2_stream.py --device cpu --layers 2 --d-model 128 --heads 4 \
        --vocab 1000 --context 256 --requests 24 --max-steps 32

The step model keeps a static KV cache, preallocated once on the device:
[layers, 2, max_batch, heads, context, head_dim], one row per request from
join to leave. Each step is one batched decode of every active row with the
model's own weights and a mask over each row's length. The batchers import
it as `gpt2_stream:load`: the engine hands them this process's sys.path,
whose first entry is this script's folder. Nothing is downloaded.
"""
import argparse
import os
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import engine


def build(layers, d_model, heads, vocab, context, seed, device):
    """The same float32 weights wherever it runs, from the seed alone."""
    torch.set_float32_matmul_precision("highest")  # no TF32 on a GPU: exact float32 both ways
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=layers, n_embd=d_model, n_head=heads, vocab_size=vocab,
                        n_positions=context, bos_token_id=0, eos_token_id=None,
                        # untied: with a tied lm_head a random GPT-2 echoes its input token
                        tie_word_embeddings=False)
    return GPT2LMHeadModel(config).to(device).eval()


class GPT2Steps:
    """The step model: per request id its KV row, its position (tokens in its
    cache) and the token it feeds next."""

    def __init__(self, model, max_batch, device):
        c = model.config
        self.model, self.device = model, device
        self.vocab, self.context = c.vocab_size, c.n_positions
        self.heads, self.head_dim = c.n_head, c.n_embd // c.n_head
        # allocated once: nothing is allocated per request, and a row's stale
        # tail (its previous owner's) is never read, as the mask hides it
        self.kv = torch.zeros(c.n_layer, 2, max_batch, c.n_head, c.n_positions, self.head_dim,
                              device=device)
        self.free = list(range(max_batch - 1, -1, -1))
        self.state = {}  # id -> [row, position, next token]

    @torch.no_grad()
    def forward(self, tokens, positions, rows, span):
        """tokens, positions [B, T] into KV rows [B]: writes their keys and
        values at those positions, each query attends to its row's positions
        up to its own; returns the logits of each row's last token [B, vocab].
        span: 1 + the largest position (from the host: no device sync), as
        attention reads the longest row's length only, not the context."""
        t, (B, T) = self.model.transformer, tokens.shape
        mask = torch.arange(span, device=self.device) <= positions[:, None, :, None]  # [B,1,T,span]
        h = t.wte(tokens) + t.wpe(positions)
        for layer, block in enumerate(t.h):
            q, k, v = block.attn.c_attn(block.ln_1(h)).split(h.shape[-1], dim=2)
            q, k, v = (x.view(B, T, self.heads, self.head_dim) for x in (q, k, v))
            keys, values = self.kv[layer, 0], self.kv[layer, 1]  # [max_batch, H, C, Dh]
            keys[rows[:, None], :, positions] = k  # [B, T, H, Dh] at (row, position)
            values[rows[:, None], :, positions] = v
            a = F.scaled_dot_product_attention(q.transpose(1, 2), keys[rows, :, :span],
                                               values[rows, :, :span], attn_mask=mask)
            h = h + block.attn.c_proj(a.transpose(1, 2).reshape(B, T, -1))
            h = h + block.mlp(block.ln_2(h))
        return self.model.lm_head(t.ln_f(h[:, -1]))

    def join(self, ids, batch, lengths=None):
        n = np.full(len(ids), batch.shape[1]) if lengths is None else np.asarray(lengths)
        real = np.arange(batch.shape[1]) < n[:, None]
        # refuse a bad prompt here: an out-of-range id on a GPU is a device-side
        # assert that ruins the CUDA context for every later request
        bad = ((batch < 0) | (batch >= self.vocab))[real].any()
        if n.min() < 1 or n.max() > self.context or bad:
            raise ValueError(f"expected prompts of 1..{self.context} ids in [0, {self.vocab})")
        if len(ids) > len(self.free):
            raise RuntimeError(f"{len(ids)} joining, {len(self.free)} KV rows free")
        rows = [self.free.pop() for _ in range(len(ids))]
        last = batch[np.arange(len(ids)), n - 1]  # each prompt's last token: its first step's input
        for rid, row, size, token in zip(ids.tolist(), rows, n.tolist(), last.tolist()):
            self.state[rid] = [row, size - 1, token]
        m = int(n.max()) - 1
        if m > 0:  # prefill all but each prompt's last token, padded: what lies past a
            # prompt's end is written but masked, and its first step overwrites it
            positions = torch.arange(m, device=self.device).expand(len(ids), m)
            self.forward(torch.tensor(batch[:, :m], device=self.device), positions,
                         torch.tensor(rows, device=self.device), m)

    def step(self, ids):
        s = [self.state[rid] for rid in ids.tolist()]
        rows, positions, tokens = (torch.tensor(c, device=self.device) for c in zip(*s))
        span = max(x[1] for x in s) + 1
        logits = self.forward(tokens[:, None], positions[:, None], rows, span)
        out = logits.argmax(-1).cpu().numpy()  # greedy, as generate(do_sample=False)
        for x, token in zip(s, out.tolist()):
            x[1], x[2] = x[1] + 1, token
        done = np.array([x[1] >= self.context for x in s])  # its next token has no position left
        return out, done

    def leave(self, ids):
        for rid in ids.tolist():
            x = self.state.pop(rid, None)  # a failed join is left too
            if x is not None:
                self.free.append(x[0])


def load(layers=2, d_model=128, heads=4, vocab=1000, context=256, seed=0, max_batch=32,
         device="cpu", threads=1):
    """The factory (gpt2_stream:load)."""
    if device == "cpu":  # a small model's ops are too short to share: more threads
        torch.set_num_threads(threads)  # only spin against the client threads' cores
    model = build(layers, d_model, heads, vocab, context, seed, device)
    steps = GPT2Steps(model, max_batch, device)
    warm = np.array([-1])  # CUDA context and kernels, before any request's TTFT
    steps.join(warm, np.zeros((1, 2), np.int64), np.array([2]))
    steps.step(warm)
    steps.leave(warm)
    return steps


def pct(xs, q):
    return 1e3 * float(np.percentile(xs, q)) if xs else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-steps", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process on the cpu")
    a = p.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    P = min(64, a.context - a.max_steps)  # a prompt and its answer fit in the context
    if P < 1:
        p.error("--context must exceed --max-steps")
    rng = np.random.default_rng(a.seed)
    prompts = [rng.integers(0, a.vocab, int(rng.integers(1, P + 1))) for _ in range(a.requests)]
    model_args = dict(layers=a.layers, d_model=a.d_model, heads=a.heads, vocab=a.vocab,
                      context=a.context, seed=a.seed)
    answers, ttft, per_token = [None] * a.requests, [], []

    def run(i):  # one client thread per request, all streaming at once
        try:
            last, tokens = time.perf_counter(), []
            for token in c.stream(prompts[i], timeout=a.timeout, max_steps=a.max_steps):
                now = time.perf_counter()
                (per_token if tokens else ttft).append(now - last)
                last = now
                tokens.append(int(token))
            answers[i] = tokens
        except engine.EngineError as e:
            answers[i] = repr(e)

    with engine.Engine(name=f"gpt2-{os.getpid()}", backend="gpt2_stream:load", iterative=True,
                       max_steps=a.max_steps, input_shape=(None,), input_dtype="int64",
                       max_input_shape=(P,), output_shape=(), output_dtype="int64",
                       max_batch_size=a.max_batch_size,
                       backend_args=dict(model_args, max_batch=a.max_batch_size, device=a.device,
                                         threads=a.threads),
                       gpus=[0] if a.device == "cuda" else None) as eng, \
            engine.Client(eng.name) as c:
        clients = [threading.Thread(target=run, args=(i,)) for i in range(a.requests)]
        t0 = time.perf_counter()
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        wall = time.perf_counter() - t0
        stats = eng.stats()

    # the oracle: the HF model, same seed, each prompt alone through its own generate()
    hf = build(**model_args, device=a.device)
    wrong = near_ties = failed = 0
    with torch.no_grad():
        for prompt, got in zip(prompts, answers):
            if not isinstance(got, list):
                failed += 1
                print("failed:", got)
                continue
            x = torch.tensor(prompt, device=a.device)[None]
            want = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                               max_new_tokens=a.max_steps, pad_token_id=0)[0, x.shape[1]:].tolist()
            if got == want:
                continue
            # at the first difference: a near tie (float rounding of a batched
            # step vs one alone picked the other of two equal logits) or wrong
            both = min(len(got), len(want))
            j = next((j for j in range(both) if got[j] != want[j]), both)
            if j < both:
                x = torch.tensor(list(prompt) + want[:j], device=a.device)[None]
                logits = hf(x).logits[0, -1]
                gap = float(logits[want[j]] - logits[got[j]])
                if gap <= 1e-4 * (1 + float(logits.abs().max())):
                    near_ties += 1
                    continue
            wrong += 1
    tokens = sum(len(x) for x in answers if isinstance(x, list))
    print(f"gpt2 {a.layers}x{a.d_model} heads {a.heads} vocab {a.vocab} context {a.context} on "
          f"{a.device}: {a.requests} requests (prompts 1..{P}) x {a.max_steps} steps, "
          f"max_batch_size {a.max_batch_size}")
    print(f"  {tokens} tokens in {wall:.2f} s: {tokens / wall:.1f} tokens/s, "
          f"mean running batch {stats['chunks_total'] / max(1, stats['steps_total']):.1f}")
    print(f"  TTFT p50 {pct(ttft, 50):.1f} ms p99 {pct(ttft, 99):.1f} ms; "
          f"per token p50 {pct(per_token, 50):.2f} ms p99 {pct(per_token, 99):.2f} ms")
    print(f"  checked against HF generate() alone: wrong {wrong}, near ties {near_ties}, "
          f"failed {failed}")
    return 1 if wrong or failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
