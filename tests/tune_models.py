"""Models of tests/test_tune.py, with costs of a known form (busy-waits), and a
record of how the tuner called them (it measures in the test's own process).

- convex(per_item_sq_us): a one-shot backend taking n^2 x per_item_sq_us a
  batch of n: no fixed cost at all, and a cost a line F + n c fits with F < 0;
- steps(step_us, per_request_us, join_us, length): a step model over int64[4]
  prompts whose step of n takes step_us + n x per_request_us, and whose
  requests say they are done after `length` steps. It records every breach
  of the step model's protocol (a step of an id not joined, or already
  done; a join of an id already joined) and the size of every step;
- logits(vocab): a sampling engine's step model (join and step give logits
  [n, vocab], step(ids, tokens)) that records every token it is fed that is
  not the argmax of the logits it gave that request last.
"""
import numpy as np

from engine.shm import ring

MADE: list = []  # every step model made, last one last


def convex(per_item_sq_us=50.0):
    def run(batch):
        n = len(batch)
        ring.spin_ns(int(n * n * float(per_item_sq_us) * 1000))
        return batch
    return run


class Steps:
    def __init__(self, step_us, per_request_us, join_us, length):
        self.step_ns, self.per_ns = int(step_us * 1000), int(per_request_us * 1000)
        self.join_ns, self.length = int(join_us * 1000), int(length)
        self.chunks = {}  # id -> chunks written, while joined
        self.breaches, self.step_sizes, self.joined_shapes = [], [], []

    def join(self, ids, batch, lengths=None):
        self.joined_shapes.append((len(ids), batch.shape, lengths))
        for rid in ids.tolist():
            if rid in self.chunks:
                self.breaches.append(f"join of {rid}, joined already")
            self.chunks[rid] = 0
        ring.spin_ns(self.join_ns * len(ids))

    def step(self, ids):
        for rid in ids.tolist():
            if self.chunks.get(rid, self.length) >= self.length:
                self.breaches.append(f"step of {rid}, not joined or done")
            else:
                self.chunks[rid] += 1
        self.step_sizes.append(len(ids))
        ring.spin_ns(self.step_ns + self.per_ns * len(ids))
        done = np.array([self.chunks.get(rid, self.length) >= self.length
                         for rid in ids.tolist()])
        return ids.copy(), done

    def leave(self, ids):
        for rid in ids.tolist():
            self.chunks.pop(rid, None)


def steps(step_us=200.0, per_request_us=20.0, join_us=50.0, length=1000):
    MADE.append(Steps(float(step_us), float(per_request_us), float(join_us), length))
    return MADE[-1]


class Logits:
    def __init__(self, vocab):
        self.rng, self.vocab = np.random.default_rng(0), int(vocab)
        self.argmax = {}  # id -> the argmax of the logits it was given last
        self.wrong, self.step_sizes = [], []

    def logits(self, ids):
        x = self.rng.normal(size=(len(ids), self.vocab)).astype(np.float32)
        self.argmax.update(zip(ids.tolist(), x.argmax(1).tolist()))
        return x

    def join(self, ids, batch, lengths=None):
        return self.logits(ids)

    def step(self, ids, tokens):
        self.wrong += [(rid, t) for rid, t in zip(ids.tolist(), np.asarray(tokens).tolist())
                       if self.argmax.get(rid) != t]
        self.step_sizes.append(len(ids))
        return self.logits(ids), np.zeros(len(ids), bool)

    def leave(self, ids):
        for rid in ids.tolist():
            self.argmax.pop(rid, None)


def logits(vocab=7):
    MADE.append(Logits(vocab))
    return MADE[-1]
