"""submit()'s Future: a request whose answer waits in its slot until asked.

result(), exception() and done() take the answer in the asking thread, so a
caller keeping many requests in flight costs no thread switch per request.
Whoever waits without asking -- add_done_callback(),
concurrent.futures.wait(), as_completed() -- hands the request to the
client's completion thread (engine.client.completion), and a client of any
process that finds the ring full has this process's evictor settle the
answered ones (engine.client.room). What this leans on of
concurrent.futures beyond its public API is engine.client.stdfuture's.
"""
import os
import sys
import weakref
from typing import Optional, Tuple

from engine.client import sampled, ticket, tracing
from engine.client.handle import ANSWER, Handle
from engine.client.stdfuture import SettledHere
from engine.client.tracing import TRACE_MODULE
from engine.shm import codes, ring


class Request(SettledHere):
    """The Future of submit(): settled by whoever asks first. A Future
    dropped while its request is pending gives its slot back. To the
    completer, an item of kind ANSWER."""
    kind = ANSWER

    def __init__(self, client: Handle, seg, slot: int, gen: int, deadline: Optional[int],
                 timeout: Optional[float], outs: Optional[tuple] = None,
                 logprobs: Optional[int] = None) -> None:
        SettledHere.__init__(self, client.futures_cond, client.futures_lock)
        self.client, self.seg, self.slot, self.gen = client, seg, slot, gen
        self.deadline, self.timeout, self.outs = deadline, timeout, outs  # outs: in spec order
        self.logprobs = logprobs  # a sampling engine's: the chunks' cut (engine.client.sampled)
        self._pid = client.pid
        self._watched = False
        self._ref = weakref.ref(self)
        client.held[slot] = self._ref  # for room.sweep(), when the ring is full
        # once answered with one output (or traced: with several, or failed in the
        # engine): the engine's (arrival_ns, claim_ns, done_ns, batch_size) of the
        # request (CLOCK_MONOTONIC, codes.T_*; 0: not stamped): its queue wait is
        # claim - arrival, its batch done - claim
        self.stamps_ns: Optional[Tuple[int, int, int, int]] = None
        if TRACE_MODULE in sys.modules:  # a tracer provider may be set (engine.client.tracing)
            self._began = tracing.begin()

    def _outcome(self, error):
        settled, value, failure, self.stamps_ns = ticket.settle(
            self.seg, self.slot, self.gen, self.outs, error, self._began is not None)
        if value is not None and self.logprobs is not None:
            value = sampled.cut(value, self.logprobs)
        if settled and self.client.held.get(self.slot) is self._ref:
            del self.client.held[self.slot]
        return settled, value, failure

    def _await(self, wait_s: Optional[float]) -> None:
        """Settles the future once its request is over, waiting up to wait_s
        (None: as long as the request lives); a wait that ends first leaves
        it pending."""
        until = None if wait_s is None else ring.now_ns() + max(0, int(wait_s * 1e9))
        over, error = ticket.wait_over(self.client, self.seg, self.slot, self.gen,
                                       self.deadline, self.timeout, until)
        if over:
            self.try_settle(error)  # answered, or no longer ours: settles for sure

    def _watch(self) -> None:
        if not self._watched and self.pending():
            self._watched = True
            self.client.completer().add(self)

    def _withdraw(self) -> bool:
        return ticket.withdraw(self.seg, self.slot, self.gen, release=False) == codes.OK

    def _report(self, failure: Optional[BaseException]) -> None:
        tracing.record(self._began, self.seg.name, self.stamps_ns, failure)

    def __del__(self) -> None:
        # only in the process that sent it: a forked child's copy is not the owner
        try:
            if self.pending() and os.getpid() == self._pid and not self.seg.closed:
                ticket.withdraw(self.seg, self.slot, self.gen)
        except Exception:  # at interpreter exit, modules may be gone already
            pass
