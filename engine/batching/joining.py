"""Who of an iterative batcher's claimed requests joins its running batch.

Claimed requests wait in a Group until they fit the max_batch_tokens budget
(a request reserves its input length + its max_steps from join to leave).
At each step the waiting ones are taken most urgent first, oldest first, and
one that does not fit lets the later ones that do go ahead of it: no
head-of-line blocking. It is passed over for at most `bound_steps` steps
(the engine's max_steps, the longest any request runs) counted from the
first step something went ahead of it; from then on it is due: it comes
first, nothing joins past it and nothing new is claimed until it fits. So
its wait is bounded: every request that went ahead has at most max_steps
steps left, and then the budget it needs is free (one request always fits,
config checks it).
"""
import numpy as np

from engine.shm import ring

NEVER = np.iinfo(np.int64).max  # `passed` of a request nothing went ahead of
NO_DEADLINE = 2**64 - 1


class Group:
    """Requests as parallel arrays, in the order they came: the running batch
    (joined), or those claimed that wait to join (over the token budget)."""

    def __init__(self, size: int):
        self.n = 0
        self.slots = np.zeros(size, np.uint32)
        self.gens = np.zeros(size, np.uint32)
        self.ids = np.zeros(size, np.int64)
        self.steps = np.zeros(size, np.uint32)      # chunks written
        self.limits = np.zeros(size, np.uint32)     # its max_steps
        self.deadlines = np.zeros(size, np.uint64)  # 0: none
        self.tokens = np.zeros(size, np.int64)      # its reservation
        self.levels = np.zeros(size, np.uint64)     # its priority level (0: most urgent)
        self.arrivals = np.zeros(size, np.uint64)   # when it was published (ns)
        self.passed = np.zeros(size, np.int64)      # the step a later one first joined ahead
        self.fields = (self.slots, self.gens, self.ids, self.steps, self.limits,
                       self.deadlines, self.tokens, self.levels, self.arrivals, self.passed)
        self.soonest_ns = NO_DEADLINE  # the nearest deadline among them

    def add(self, slots, gens, ids, limits, deadlines, tokens, levels=0, arrivals=0) -> None:
        n, k = self.n, len(slots)
        values = (slots, gens, ids, 0, limits, deadlines, tokens, levels, arrivals, NEVER)
        for field, v in zip(self.fields, values):
            field[n:n + k] = v
        self.n = n + k
        self._deadlines_changed()

    def keep(self, mask: np.ndarray) -> None:
        """Keeps the requests where mask (over the first n) is True, in order."""
        k = int(mask.sum())
        for field in self.fields:
            field[:k] = field[:self.n][mask]
        self.n = k
        self._deadlines_changed()

    def _deadlines_changed(self) -> None:
        d = self.deadlines[:self.n]
        d = d[d != 0]
        self.soonest_ns = int(d.min()) if len(d) else NO_DEADLINE


def claim_ranks(r: ring.Ring, slots: np.ndarray):
    """(levels, arrivals) of claimed slots, as their clients published them
    (a level out of range ranks last)."""
    levels, arrivals = np.zeros(len(slots), np.uint32), np.zeros(len(slots), np.uint64)
    r.claimed_ranks(slots, levels, arrivals)
    return levels, arrivals


def is_due(group: Group, step: int, bound_steps: int) -> bool:
    """Whether a waiting request has been passed over for bound_steps steps."""
    n = group.n
    return bool(n) and int(group.passed[:n].min()) <= step - bound_steps


def pick(group: Group, free_tokens: int, room: int, step: int, bound_steps: int) -> list:
    """The indices (into group) of the waiting requests that join now, in the
    order they join: due ones first, then most urgent, then oldest; each
    that fits what is left of free_tokens and room; past one that does not
    fit only while it is not due. Marks the ones passed over (at `step`)."""
    n = group.n
    passed = group.passed[:n]
    due = passed <= step - bound_steps
    order = np.lexsort((group.arrivals[:n], group.levels[:n], ~due))
    tokens = group.tokens[:n]
    take, skipped = [], []
    for i in order.tolist():
        if room == 0:
            break
        t = int(tokens[i])
        if t <= free_tokens:
            take.append(i)
            free_tokens -= t
            room -= 1
            for j in skipped:  # went ahead of them
                if passed[j] == NEVER:
                    passed[j] = step
            skipped.clear()
        elif due[i]:
            break
        else:
            skipped.append(i)
    return take
