"""A small generative model, built in: a transformer decoder in numpy.

Random weights from a seed (nothing to download): token and position
embeddings, `layers` pre-norm blocks of causal multi-head self-attention and
an MLP, logits through an output projection, greedy decoding. Each request
keeps its own KV cache. float64 throughout, so that a request decoded in a
batch and the same request decoded alone pick the same tokens.

Two backends over the same model, for an engine of prompts int64[1..P]:

- steps(...): a step model (iterative=True, output_shape () int64): join
  prefills each prompt, every step decodes one token per active request, and
  the engine ends each at its max_steps (or at `eos`, if one is set);
- generate(...): a one-shot backend (named inputs "prompt" int64[1..P] and
  "max_new_tokens" int64[1], output "tokens" int64[S]) that runs the whole
  generate loop for its batch, every row until the longest is done, and
  pads each answer with -1: the static way.

Either way a request also ends at the context's end: a prompt of n tokens
gets at most context - n + 1 of them (the rest of its batch goes on).
"""
from typing import Dict, Optional

import numpy as np


class Decoder:
    """The model: its weights, prefill of one prompt, and one decode step of a batch."""

    def __init__(self, vocab: int = 2048, d_model: int = 128, layers: int = 4, heads: int = 4,
                 context: int = 512, seed: int = 0):
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of heads ({heads})")
        rng = np.random.default_rng(seed)
        d = d_model
        self.vocab, self.d, self.layers, self.heads, self.context = vocab, d, layers, heads, context
        self.dh = d // heads
        self.embed = rng.standard_normal((vocab, d))
        self.position = rng.standard_normal((context, d)) * 0.5
        scale = 1 / np.sqrt(d)
        self.w_qkv = [rng.standard_normal((d, 3 * d)) * scale for _ in range(layers)]
        self.w_out = [rng.standard_normal((d, d)) * scale for _ in range(layers)]
        self.w_up = [rng.standard_normal((d, 4 * d)) * scale for _ in range(layers)]
        self.w_down = [rng.standard_normal((4 * d, d)) * (scale / 2) for _ in range(layers)]
        # untied: a tied one would make each token predict itself
        self.unembed = rng.standard_normal((d, vocab))

    def new_cache(self) -> np.ndarray:
        """One request's KV cache: [layers, 2, context, d]."""
        return np.zeros((self.layers, 2, self.context, self.d))

    def prefill(self, tokens: np.ndarray, cache: np.ndarray) -> None:
        """Runs a prompt's tokens through the model, filling cache[:, :, :len]."""
        n = len(tokens)
        if n == 0:
            return
        if n > self.context:
            raise ValueError(f"a prompt of {n} tokens is longer than the context ({self.context})")
        x = self.embed[tokens] + self.position[:n]
        causal = np.triu(np.full((n, n), -np.inf), 1)
        for layer in range(self.layers):
            q, k, v = np.split(_norm(x) @ self.w_qkv[layer], 3, axis=1)
            cache[layer, 0, :n], cache[layer, 1, :n] = k, v
            qh, kh, vh = (a.reshape(n, self.heads, self.dh).transpose(1, 0, 2) for a in (q, k, v))
            scores = qh @ kh.transpose(0, 2, 1) / np.sqrt(self.dh) + causal
            attended = (_softmax(scores) @ vh).transpose(1, 0, 2).reshape(n, self.d)
            x = x + attended @ self.w_out[layer]
            x = x + _mlp(_norm(x), self.w_up[layer], self.w_down[layer])

    def decode(self, tokens: np.ndarray, positions: np.ndarray, caches: list) -> np.ndarray:
        """One step of a batch: each request's last token at its position,
        its KV cache extended; returns each one's next token (greedy)."""
        n = len(tokens)
        if n and int(positions.max()) >= self.context:
            raise ValueError(f"a request reached the context's end ({self.context} tokens)")
        x = self.embed[tokens] + self.position[positions]
        for layer in range(self.layers):
            q, k, v = np.split(_norm(x) @ self.w_qkv[layer], 3, axis=1)
            attended = np.empty((n, self.d))
            for i, (cache, p) in enumerate(zip(caches, positions.tolist())):
                cache[layer, 0, p], cache[layer, 1, p] = k[i], v[i]
                keys = cache[layer, 0, :p + 1].reshape(p + 1, self.heads, self.dh)
                values = cache[layer, 1, :p + 1].reshape(p + 1, self.heads, self.dh)
                qi = q[i].reshape(self.heads, 1, self.dh)
                scores = qi @ keys.transpose(1, 2, 0) / np.sqrt(self.dh)
                attended[i] = (_softmax(scores) @ values.transpose(1, 0, 2)).reshape(self.d)
            x = x + attended @ self.w_out[layer]
            x = x + _mlp(_norm(x), self.w_up[layer], self.w_down[layer])
        return np.argmax(_norm(x) @ self.unembed, axis=1).astype(np.int64)

    def generate_one(self, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
        """A request decoded alone: the oracle of every batched answer."""
        cache = self.new_cache()
        prompt = np.asarray(prompt, np.int64)
        self.prefill(prompt[:-1], cache)
        token, out = prompt[-1:], []
        for p in range(len(prompt) - 1, len(prompt) - 1 + new_tokens):
            token = self.decode(token, np.array([p]), [cache])
            out.append(int(token[0]))
        return np.array(out, np.int64)


def _norm(x: np.ndarray) -> np.ndarray:
    return (x - x.mean(axis=-1, keepdims=True)) / np.sqrt(x.var(axis=-1, keepdims=True) + 1e-5)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _mlp(x: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return np.maximum(x @ up, 0) @ down


class DecoderSteps:
    """The step model over a Decoder: per request id, its KV cache, its
    position and the token it feeds next."""

    def __init__(self, model: Decoder, eos: Optional[int] = None):
        self.model, self.eos = model, eos
        self.state: Dict[int, list] = {}  # id -> [cache, position, last token]

    def join(self, ids, batch, lengths=None):
        for i, rid in enumerate(ids.tolist()):
            n = int(lengths[i]) if lengths is not None else batch.shape[1]
            prompt = batch[i, :n]
            if n < 1 or prompt.min() < 0 or prompt.max() >= self.model.vocab:
                raise ValueError(f"expected a prompt of 1.. token ids in [0, {self.model.vocab}), "
                                 f"got {n} ids in [{prompt.min()}, {prompt.max()}]")
            cache = self.model.new_cache()
            self.model.prefill(prompt[:-1], cache)
            self.state[rid] = [cache, n - 1, int(prompt[-1])]

    def step(self, ids):
        states = [self.state[rid] for rid in ids.tolist()]
        tokens = np.array([s[2] for s in states], np.int64)
        positions = np.array([s[1] for s in states], np.int64)
        out = self.model.decode(tokens, positions, [s[0] for s in states])
        for s, token in zip(states, out.tolist()):
            s[1], s[2] = s[1] + 1, token
        done = positions + 1 >= self.model.context  # its next token has no position left
        if self.eos is not None:
            done |= out == self.eos
        return out, done

    def leave(self, ids):
        for rid in ids.tolist():
            self.state.pop(rid, None)


def steps(vocab: int = 2048, d_model: int = 128, layers: int = 4, heads: int = 4,
          context: int = 512, seed: int = 0, eos: Optional[int] = None) -> DecoderSteps:
    """The built-in step model (a factory: engine.tools.decoder:steps)."""
    return DecoderSteps(Decoder(int(vocab), int(d_model), int(layers), int(heads), int(context),
                                int(seed)), None if eos is None else int(eos))


def generate(vocab: int = 2048, d_model: int = 128, layers: int = 4, heads: int = 4,
             context: int = 512, seed: int = 0, steps: int = 256):
    """The same model as a one-shot backend (engine.tools.decoder:generate): the
    whole generate loop of a batch in one call, the static way; `steps` is
    the width S of its output "tokens"."""
    width = int(steps)
    model = Decoder(int(vocab), int(d_model), int(layers), int(heads), int(context), int(seed))

    def run(batch, lengths):
        prompts, budgets = batch["prompt"], batch["max_new_tokens"][:, 0]
        n = len(prompts)
        caches = [model.new_cache() for _ in range(n)]
        positions = np.zeros(n, np.int64)
        tokens = np.zeros(n, np.int64)
        for i in range(n):
            size = max(1, int(lengths["prompt"][i]))
            model.prefill(prompts[i, :size - 1], caches[i])
            positions[i], tokens[i] = size - 1, prompts[i, size - 1]
        out = np.full((n, width), -1, np.int64)
        for step in range(min(int(budgets.max(initial=0)), width)):
            # every row, done or not (a done one again at its last position, so
            # that it never runs past the context for tokens nobody reads)
            live = (budgets > step) & (positions < model.context)
            decoded = model.decode(tokens, np.minimum(positions, model.context - 1), caches)
            out[live, step] = decoded[live]
            tokens = np.where(live, decoded, tokens)
            positions += live
        return {"tokens": out}

    return run
