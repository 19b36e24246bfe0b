"""Reclaiming the slots of dead clients: who owns a slot, and whether it lives.

Each slot's control word names its owner's pid, and its meta the owner's
start time; death is judged by both (liveness), so a reused pid is not taken
for the owner. The supervisor calls this every reap_interval_s; a client that
finds the ring full calls it at once, before it refuses a request.
"""
import numpy as np

from engine.shm import codes, liveness, ring


class Census:
    """One snapshot of every slot's control word and owner."""

    def __init__(self, r: ring.Ring, capacity: int):
        ctl, owner_start = np.zeros(capacity, np.uint64), np.zeros(capacity, np.uint64)
        n = r.snapshot(ctl, owner_start)
        self.ctl, self.owner_start = ctl[:n], owner_start[:n]
        self.states = ring.ctl_state(self.ctl)
        self.pids = ring.ctl_pid(self.ctl)

    def count(self, *states) -> int:
        return int(np.isin(self.states, states).sum())

    def answered_by_pid(self) -> dict:
        """{pid: answers (DONE or FAILED) its process has not read yet}."""
        held = np.isin(self.states, (codes.DONE, codes.FAILED)) & (self.pids != 0)
        pids, counts = np.unique(self.pids[held], return_counts=True)
        return dict(zip(pids.tolist(), counts.tolist()))


def reap_dead_clients(r: ring.Ring, census: Census) -> list:
    """Frees (or, if claimed, abandons) every slot whose owner is dead; one
    CAS each, which fails if the slot moved since the census. Returns the
    (slot, pid) pairs reclaimed."""
    owned = np.nonzero((census.states != codes.FREE) & (census.states != codes.ABANDONED)
                       & (census.pids != 0))[0]
    verdicts, reclaimed = {}, []
    for slot in owned.tolist():
        owner = (int(census.pids[slot]), int(census.owner_start[slot]))
        if owner not in verdicts:
            verdicts[owner] = not liveness.is_alive(*owner)
        if verdicts[owner] and r.reap_slot(slot, int(census.ctl[slot])) == codes.OK:
            reclaimed.append((slot, owner[0]))
    return reclaimed
