"""Priority shares: a request of priority p > 0 is refused while the requests
queued at p or less urgent fill (SHARE_STEPS - p) / SHARE_STEPS of the queue,
so each level more urgent than p keeps 1/SHARE_STEPS of it for itself.

One rule for a single submit (room for one) and a bulk call (room for its
next chunk: as many rows as that many single submits would have enqueued).
"""
from engine.errors import QueueFull
from engine.shm import codes

SHARE_STEPS = 8


def room(seg, priority: int) -> int:
    """How many more requests of `priority` its share admits now (0: none;
    priority 0 is bounded by the queue alone, given as its capacity)."""
    if not priority:
        return seg.capacity
    return max(0, share(seg, priority) - held(seg, priority))


def held(seg, priority: int) -> int:
    """How many requests of `priority` or less urgent are queued."""
    r = seg.ring
    return r.queued(seg.config.priority_levels - 1) - r.queued(priority - 1)


def share(seg, priority: int) -> int:
    """How many requests of `priority` or less urgent may be queued."""
    return seg.capacity * (SHARE_STEPS - priority) // SHARE_STEPS


def refused(seg, priority: int) -> QueueFull:
    """The refusal of a request whose level's share is full, counted."""
    seg.ring.add_word(codes.W_REJECTED)
    return QueueFull(f"priority {priority} may hold {share(seg, priority)} of queue_capacity "
                     f"{seg.capacity} (the rest is kept for more urgent requests), "
                     f"got {held(seg, priority)} queued")
