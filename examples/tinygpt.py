"""A GPT-2-style decoder in numpy, random weights from a seed: a step model to
start from (nothing to download, no torch).

Pre-norm blocks of causal multi-head attention and a GELU MLP, token and
position embeddings, the token embedding tied as the output head; float32.
Each running request keeps its keys and values in one row of a preallocated
cache (`rows` of them: the engine's max_batch_size at most), so a step feeds
only each request's last token: one matmul per weight for the whole running
batch, attention over each row's own positions.

- TinyGPT: for `sampling = true`. join gives each request's logits at its
  last prompt position (every position's with positions="all"), step(ids,
  tokens) feeds the tokens the engine sampled and gives the next logits.
- embedder: a one-shot backend of the same weights, each input's last hidden
  states averaged over its tokens (float32[d]).
- reranker: a one-shot backend scoring a (query, document) pair, tokenized
  as one sequence: its last hidden state projected on a head from the seed
  (float32 ()), as a cross-encoder does.

Token ids come from callers: any outside 0..vocab - 1 fails the call that
carries them (ValueError), never an index that wraps.
"""
import numpy as np


def norm(x):
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(0.7978846 * (x + 0.044715 * x ** 3)))


class TinyGPT:
    def __init__(self, vocab=257, d=128, layers=4, heads=4, context=512, rows=64, seed=0):
        if d % heads:
            raise ValueError(f"d ({d}) must be a multiple of heads ({heads})")
        r = np.random.default_rng(seed)

        def w(*shape):  # variance 1 / fan-in: the residual stream stays of order 1
            return r.normal(0.0, shape[0] ** -0.5, shape).astype(np.float32)

        self.wte, self.wpe, self.heads = w(vocab, d), w(context, d), heads
        self.blocks = [(w(d, 3 * d), w(d, d), w(d, 4 * d), w(4 * d, d)) for _ in range(layers)]
        # [layer, key/value, row, head, position, d / heads]; pages are touched only as used
        self.kv = np.zeros((layers, 2, rows, heads, context, d // heads), np.float32)
        self.free = list(range(rows))
        self.at = {}  # request id -> [its cache row, its length so far]

    def hidden(self, rows, tokens, start):
        """The last block's normed states [n, t, d] of tokens [n, t], row i's at
        positions start[i] .. start[i] + t - 1, their keys and values cached."""
        if tokens.size and (tokens.min() < 0 or tokens.max() >= len(self.wte)):
            raise ValueError(f"expected token ids in 0..{len(self.wte) - 1}, got "
                             f"{tokens.min()}..{tokens.max()}")
        n, t = tokens.shape
        pos = start[:, None] + np.arange(t)
        if pos.max() >= len(self.wpe):
            raise ValueError(f"expected at most {len(self.wpe)} positions (the context), got "
                             f"position {pos.max()}")
        end = pos.max() + 1
        x = self.wte[tokens] + self.wpe[pos]
        # a position sees itself and those before it; a shorter row's padding is
        # past its length, so no real position sees it
        mask = np.where(np.arange(end) <= pos[:, None, :, None], 0, -np.inf).astype(np.float32)
        for (qkv, proj, up, down), (keys, values) in zip(self.blocks, self.kv):
            q, k, v = (norm(x) @ qkv).reshape(n, t, 3, self.heads, -1).transpose(2, 0, 3, 1, 4)
            keys[rows[:, None], :, pos] = k.swapaxes(1, 2)
            values[rows[:, None], :, pos] = v.swapaxes(1, 2)
            a = q @ keys[rows, :, :end].swapaxes(2, 3) * q.shape[-1] ** -0.5 + mask
            a = np.exp(a - a.max(-1, keepdims=True))
            a = (a / a.sum(-1, keepdims=True)) @ values[rows, :, :end]  # [n, heads, t, d/heads]
            x = x + a.swapaxes(1, 2).reshape(n, t, -1) @ proj
            x = x + gelu(norm(x) @ up) @ down
        return norm(x)

    def join(self, ids, batch, lengths, positions="last"):
        """Prefill: each request's prompt (batch [k, L], zero-padded past its
        length) into a cache row; its logits [k, vocab] at its last position,
        or [k, L, vocab] at every position."""
        if len(ids) > len(self.free):
            raise ValueError(f"{len(ids)} requests joining, {len(self.free)} cache rows free "
                             f"(rows must be at least the engine's max_batch_size)")
        rows = np.array([self.free.pop() for _ in range(len(ids))], np.int64)
        self.at.update((i, [r, n]) for i, r, n in zip(ids.tolist(), rows.tolist(),
                                                      lengths.tolist()))
        h = self.hidden(rows, batch, np.zeros(len(ids), np.int64))
        if positions != "all":
            h = h[np.arange(len(ids)), np.maximum(lengths, 1) - 1]
        return h @ self.wte.T

    def step(self, ids, tokens):
        """Feeds each request the token the engine picked for it last; the next
        logits [n, vocab], and none done (eos, stop ids or max_steps end them)."""
        rows, start = np.array([self.at[i] for i in ids.tolist()], np.int64).reshape(-1, 2).T
        for i in ids.tolist():
            self.at[i][1] += 1
        logits = self.hidden(rows, np.asarray(tokens, np.int64)[:, None], start)[:, 0] @ self.wte.T
        return logits, np.zeros(len(ids), bool)

    def leave(self, ids):
        self.free += [self.at.pop(i)[0] for i in ids.tolist() if i in self.at]


def _states(model, batch):
    """The last hidden states [n, L, d] of a one-shot call's inputs (no cache kept)."""
    if len(batch) > len(model.kv[0, 0]):
        raise ValueError(f"expected at most {len(model.kv[0, 0])} inputs a call (rows), "
                         f"got {len(batch)}")
    return model.hidden(np.arange(len(batch)), batch, np.zeros(len(batch), np.int64))


def embedder(**weights):
    """A one-shot backend: each input's mean last hidden state, float32[d]."""
    model = TinyGPT(**weights)

    def embed(batch, lengths):
        real = np.arange(batch.shape[1]) < lengths[:, None]
        mean = (_states(model, batch) * real[..., None]).sum(1) / np.maximum(lengths, 1)[:, None]
        return mean.astype(np.float32)

    return embed


def reranker(seed=0, **weights):
    """A one-shot backend: each (query, document) sequence's score, float32 ()."""
    model = TinyGPT(seed=seed, **weights)
    head = np.random.default_rng(seed + 1).normal(0.0, 1.0, len(model.wte[0])).astype(np.float32)

    def score(batch, lengths):
        last = _states(model, batch)[np.arange(len(batch)), np.maximum(lengths, 1) - 1]
        return (last @ head / np.sqrt(len(head))).astype(np.float32)

    return score
