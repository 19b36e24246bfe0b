"""Lent slots (Client.request()): a large input written once, in place, in
the request's own row of shared memory, and its answer read there."""
import os
from typing import Optional

import numpy as np

from engine.client import ticket
from engine.client.handle import Handle
from engine.errors import EngineUnavailable, InvalidInput
from engine.shm import codes


class SlotRequest:
    """A slot lent by Client.request(): its input row to fill, then its answer
    to read in place. Use it as a context manager, in the process that made it."""

    def __init__(self, client: Handle, seg, slot: int, gen: int) -> None:
        self.client, self.seg, self.slot, self.gen = client, seg, slot, gen
        # writable: the request's row in shared memory (0-d for a scalar input)
        self.input = seg.in_regions[0][slot, ...]
        self._sent = False
        self._pid = client.pid

    def infer(self, timeout: Optional[float] = 1.0, *, priority: int = 0) -> np.ndarray:
        """Sends the row as it is now; blocks until its answer; returns it as a
        read-only view of the slot's output row (valid until the slot is freed)."""
        if self._sent:
            raise RuntimeError("a SlotRequest sends once: use client.request() again")
        levels = self.seg.config.priority_levels
        if priority and not (type(priority) is int and 0 <= priority < levels):
            raise InvalidInput(f"priority: expected an int in [0, {levels}), got {priority!r}")
        deadline = ticket.deadline_ns(timeout)
        self._sent = True
        if self.seg.ring.publish(self.slot, self.gen, 0, deadline or 0, priority) != codes.OK:
            raise EngineUnavailable(f"engine {self.client.name!r} reclaimed the request "
                                    f"before it was queued")
        ticket.await_answer(self.client, self.seg, self.slot, self.gen, deadline, timeout,
                            take=False)
        answer = self.seg.out_regions[0][self.slot, ...].view()  # 0-d for a scalar answer
        answer.flags.writeable = False
        return answer

    def close(self) -> None:
        """Frees the slot: drops an unsent request, abandons a pending one,
        releases an answered one (each a no-op once the slot is no longer ours)."""
        if self.input is None:
            return
        self.input = None
        r = self.seg.ring
        if not self._sent:
            r.cancel(self.slot, self.gen)
        else:
            ticket.withdraw(self.seg, self.slot, self.gen)

    def __enter__(self) -> "SlotRequest":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            if os.getpid() == self._pid and not self.seg.closed:
                self.close()
        except Exception:  # at interpreter exit, modules may be gone already
            pass
