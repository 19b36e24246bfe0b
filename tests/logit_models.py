"""A step model that returns logits (tests/test_sampling_engine.py), whose
every logit a test can compute directly: `logits_of(prompt, generated)`.

Vocabulary V = 50. A request's logits after its prompt and the tokens
generated so far are TABLE[last token] + TABLE[(sum(prompt) + pos) % V] / 2,
pos the number generated. A prompt that starts with FORCE_EOS, n makes EOS
dominate the logits at pos n (its chunk n is EOS under greedy); one that
starts with DONE_AT, n is done (the model says so) at pos n.

join(..., positions="all") gives every prompt position's logits: position j's
are `prompt_logits(prompt[:j + 1])`, so the last is logits_of(prompt, []).
With calls_log (a path) each join appends a line: "all" or "last", and how
many requests joined (a test counts them: the model runs in the batcher).
"""
import numpy as np

V = 50
EOS = 0
FORCE_EOS, DONE_AT = 49, 48
TABLE = np.random.default_rng(39).normal(0.0, 2.0, (V, V)).astype(np.float32)


def logits_of(prompt, generated) -> np.ndarray:
    """float32[V]: the model's logits after prompt and the generated tokens."""
    prompt = [int(t) for t in prompt]
    pos = len(generated)
    last = int(generated[-1]) if pos else prompt[-1]
    x = TABLE[last % V] + TABLE[(sum(prompt) + pos) % V] / 2
    if prompt[0] == FORCE_EOS and len(prompt) > 1 and pos == prompt[1]:
        x = x.copy()
        x[EOS] += 100.0
    return x


def prompt_logits(prefix) -> np.ndarray:
    """float32[V]: the logits at the last position of prefix (predicting the next)."""
    return logits_of(prefix, [])


def done_at(prompt, pos: int) -> bool:
    return int(prompt[0]) == DONE_AT and len(prompt) > 1 and pos == int(prompt[1])


class Logits:
    """join -> logits [k, V]; step(ids, tokens) -> (logits [n, V], done)."""

    def __init__(self, torch_logits: bool = False, calls_log=None):
        self.torch = torch_logits
        self.calls_log = calls_log
        self.state: dict = {}  # id -> (prompt, generated)

    def out(self, rows: list):
        x = np.stack(rows)
        if self.torch:
            import torch
            return torch.from_numpy(x)
        return x

    def join(self, ids, x, lengths=None, positions=None):
        lengths = lengths if lengths is not None else np.full(len(ids), x.shape[1])
        if self.calls_log:
            with open(self.calls_log, "a") as f:
                f.write(f"{'all' if positions == 'all' else 'last'} {len(ids)}\n")
        rows = []
        for i, id_ in enumerate(ids.tolist()):
            prompt = x[i, :lengths[i]].tolist()
            self.state[id_] = (prompt, [])
            if positions == "all":  # padded positions past the prompt: zeros
                every = np.zeros((x.shape[1], V), np.float32)
                every[:len(prompt)] = [prompt_logits(prompt[:j + 1]) for j in range(len(prompt))]
                rows.append(every)
            else:
                rows.append(logits_of(prompt, []))
        return self.out(rows)

    def step(self, ids, tokens):
        rows, done = [], np.zeros(len(ids), bool)
        for i, (id_, token) in enumerate(zip(ids.tolist(), tokens.tolist())):
            prompt, generated = self.state[id_]
            generated.append(token)
            rows.append(logits_of(prompt, generated))
            done[i] = done_at(prompt, len(generated))
        return self.out(rows), done

    def leave(self, ids):
        for id_ in ids.tolist():
            self.state.pop(id_, None)


def logits(torch_logits: bool = False, calls_log=None) -> Logits:
    return Logits(torch_logits, calls_log)
