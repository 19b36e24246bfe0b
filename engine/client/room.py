"""Making room in a full ring, before a request is refused with QueueFull.

A slot holds a request from its enqueue until its answer is read, so a ring
can be full of answers nobody has asked for yet. A client that finds no free
slot first settles its own process's answered Futures, then reclaims the
slots of dead owners, then asks every other client process (through its
evictor thread) to let its answers go, waiting up to EVICT_WAIT_NS. Only then
is the request refused, with what holds the slots.

The Evictor is the other side of that ask: a thread per client that has
used submit(), asleep on the ring's evict_seq word, that settles the
client's answered Futures when a client of any process bumps it.
"""
import os
import threading
import weakref

from engine.client.handle import Handle
from engine.errors import QueueFull
from engine.shm import codes, reaper, ring

# How long a client that found the ring full of answers waits for other
# processes' evictors to move them out, before it raises QueueFull. It waits
# only when they hold more than a batch's worth (and 1/8 of the ring): fewer
# are the last batches' answers on their way to their readers.
EVICT_WAIT_NS = 100_000_000

# How often an idle evictor checks that its client still exists.
EVICTOR_SLICE_NS = 1_000_000_000

# Every Client of this process (their answered Futures are settled together).
clients: "weakref.WeakSet[Handle]" = weakref.WeakSet()


def queue_full(seg, census: reaper.Census) -> QueueFull:
    """The refusal, counted, with what holds the slots (after making room)."""
    seg.ring.add_word(codes.W_REJECTED)
    busy = census.count(codes.READY, codes.CLAIMED, codes.ABANDONED)
    held = census.answered_by_pid()
    text = (f"queue_capacity {seg.capacity} reached: expected a free slot, got {busy} requests "
            f"queued or being computed, {census.count(codes.WRITING)} being written or lent")
    if held:
        text += (f", {sum(held.values())} answers not yet read by live processes "
                 f"{sorted(held)}")
    return QueueFull(text)


def sweep_process(seg) -> int:
    """Settles the answered Futures of every client of this process on the
    engine of seg (copy out, free the slot); returns how many."""
    freed = 0
    for client in list(clients):
        other = client.attached
        if (other is not None and client.pid == os.getpid() and other.name == seg.name
                and other.incarnation == seg.incarnation):
            freed += sweep(client.held)
    return freed


def make_room(seg, pid: int, start_ticks: int, deadline):
    """(code, slot, generation) of a slot taken after the ring was found
    full: this process's answered Futures are settled, dead owners' slots
    reclaimed, other processes asked to let their answers go (waiting up
    to EVICT_WAIT_NS, within the deadline); QueueFull if still none."""
    r = seg.ring
    if sweep_process(seg):
        code, slot, gen = r.acquire(pid, start_ticks)
        if code != codes.EFULL:
            return code, slot, gen
    census = reaper.Census(r, seg.capacity)
    if reaper.reap_dead_clients(r, census):
        code, slot, gen = r.acquire(pid, start_ticks)
        if code != codes.EFULL:
            return code, slot, gen
        census = reaper.Census(r, seg.capacity)
    held = sum(census.answered_by_pid().values())  # answers other processes have not read
    # a few are answers of the last batches, on their way to their readers: waiting
    # for those would stall a sender under overload (up to EVICT_WAIT_NS a request)
    if held >= max(seg.config.max_batch_size + 1, seg.capacity // 8):
        r.request_evict()
        wait_ns = EVICT_WAIT_NS
        if deadline is not None:
            wait_ns = max(0, min(wait_ns, deadline - ring.now_ns()))
        code, slot, gen = r.acquire_wait(pid, start_ticks, wait_ns)
        if code != codes.EFULL:
            return code, slot, gen
        census = reaper.Census(r, seg.capacity)
    raise queue_full(seg, census)


class Evictor(threading.Thread):
    """Moves its client's answered Futures out of the ring when a client of
    any process finds it full (it bumps evict_seq): one sleeping thread per
    client that has used submit(), woken only then."""

    def __init__(self, client: Handle) -> None:
        super().__init__(name=f"shmbatch-evictor-{client.name}", daemon=True)
        self.client = weakref.ref(client)  # the thread must not keep its client alive

    def run(self) -> None:
        while True:
            client = self.client()
            if client is None or client.attached is None or client.pid != os.getpid():
                return
            seg, client = client.attached, None
            seen = seg.ring.evict_seq()
            seg.ring.wait_evict(seen, EVICTOR_SLICE_NS)
            if seg.ring.evict_seq() != seen:
                client = self.client()
                if client is not None:
                    sweep(client.held)
                    client = None


def sweep(held: dict) -> int:
    """Settles the answered Futures among held (slot -> weakref of a pending
    Future), dropping the entries of Futures gone; returns how many it settled."""
    settled = 0
    for slot, ref in list(held.items()):
        future = ref()
        if future is None:
            if held.get(slot) is ref:
                del held[slot]
        elif future.pending() and future.try_settle():
            settled += 1
    return settled
