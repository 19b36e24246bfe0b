"""Client(retries=N): a refused request sent again, within a retry budget.

A request refused at enqueue (QueueFull, and Overloaded, its subclass) or
failed unstarted by the engine (STATUS_EXPIRED: its deadline too near for a
batch to start it) is sent again, at most N times, each after a jittered
exponential backoff, never past its own deadline (the first attempt's: a
retry does not extend it), and only while the client's token bucket allows:
each request adds one unit, a retry costs RETRY_COST units, and the bucket
holds at most BURST retries' worth (it starts full). So of a client's sends
at most BURST + requests / RETRY_COST are retries, however overloaded the
engine: its clients cannot multiply its load by N + 1. A retry that is not
allowed (N reached, a backoff that would end at or past the deadline, an
empty bucket) raises the refusal at once; nothing else (InvalidInput,
BackendError, a timeout while queued or computed) is ever retried.

Which calls retry: infer() and infer_async() (refusals and unstarted
expiries), submit() (refusals at enqueue, backed off in the caller's thread;
its Future is tied to its slot, so an unstarted expiry it reports is not
sent again: that leaves less than one batch's fixed cost before the deadline,
too little for a retry anyway), and stream()/open_stream_async() of a one-shot
engine, which are submit()/infer_async(). Not retried: an iterative engine's
streams (a stream's chunks may already be the caller's), infer_many() (a
bulk call: a retry would resend what was answered) and request() (a lent
slot: the caller decides what to do without one).
"""
import asyncio
import os
import random
import threading
import time
import weakref
from typing import Any, Optional, Protocol

from engine.client import ticket
from engine.client.handle import Handle
from engine.errors import QueueFull, RequestTimeout
from engine.shm import ring

# The backoff before retry k (k = 0, 1, ...) is uniform in [step/2, step),
# step = min(CAP_S, BASE_S * 2**k). A refusal clears as batches finish (a few
# ms for most models): sooner than BASE_S / 2 a retry finds the queue it left;
# the random half spreads the clients one full queue refused at once. CAP_S:
# past it a client is waiting, not backing off (and deadlines are shorter).
BASE_S = 0.010
CAP_S = 1.0
# A retry costs RETRY_COST requests' deposit: at most 1 / RETRY_COST of the
# requests are retries, plus BURST (a few refusals in a quiet time all retry).
RETRY_COST = 10
BURST = 10

_policies: "weakref.WeakSet[Retrying]" = weakref.WeakSet()


class Sender(Handle, Protocol):
    """A Client as the retries see it: a Handle that can enqueue."""

    def _enqueue(self, x: Any, deadline: Optional[int], priority: int = 0,
                 max_steps: Optional[int] = None, out: Any = None) -> tuple:
        ...


def policy(retries: int) -> "Optional[Retrying]":
    """The retry policy of Client(retries=...); None for 0 (no retry, no cost)."""
    if type(retries) is not int or retries < 0:
        raise ValueError(f"retries: expected an int >= 0, got {retries!r}")
    return Retrying(retries) if retries else None


def retryable(error: BaseException) -> bool:
    """Refused at enqueue, or failed by the engine before it computed it."""
    return isinstance(error, QueueFull) or (isinstance(error, RequestTimeout)
                                             and getattr(error, "unstarted", False))


def backoff_s(attempt: int) -> float:
    """The jittered wait before retry number attempt + 1 (see BASE_S)."""
    step_s = min(CAP_S, BASE_S * (1 << min(attempt, 30)))
    return step_s * (0.5 + 0.5 * random.random())  # random: reseeded in a forked child


class Retrying:
    """One client's retries: at most `retries` a request, within its budget."""

    def __init__(self, retries: int) -> None:
        self.retries = retries
        self.lock = threading.Lock()
        self.units = BURST * RETRY_COST  # the token bucket, in requests' deposits
        self.retries_total = 0  # retries sent
        self.denied_total = 0  # retries the budget did not allow
        _policies.add(self)

    def sent(self) -> None:
        """A new request (not a retry): its deposit into the bucket."""
        with self.lock:
            if self.units < BURST * RETRY_COST:
                self.units += 1

    def delay_s(self, error: BaseException, attempt: int, deadline: Optional[int]
                ) -> Optional[float]:
        """The backoff before retry attempt + 1 of a request that failed with
        error, its token spent; None when it is not to be retried."""
        if attempt >= self.retries or not retryable(error):
            return None
        wait_s = backoff_s(attempt)
        if deadline is not None and ring.now_ns() + int(wait_s * 1e9) >= deadline:
            return None
        with self.lock:
            if self.units < RETRY_COST:
                self.denied_total += 1
                return None
            self.units -= RETRY_COST
            self.retries_total += 1
        return wait_s

    # -- the calls that retry ---------------------------------------------------
    def infer(self, client: Sender, x, timeout: Optional[float], priority: int,
              max_steps: Optional[int], out) -> Any:
        deadline = ticket.deadline_ns(timeout)
        self.sent()
        attempt = 0
        while True:
            try:
                seg, slot, gen, outs = client._enqueue(x, deadline, priority, max_steps, out)
                return ticket.await_answer(client, seg, slot, gen, deadline, timeout, outs)
            except (QueueFull, RequestTimeout) as error:
                wait_s = self.delay_s(error, attempt, deadline)
                if wait_s is None:
                    raise
            time.sleep(wait_s)
            attempt += 1

    def enqueue(self, client: Sender, x, deadline: Optional[int], priority: int,
                max_steps: Optional[int] = None, out=None) -> tuple:
        """client._enqueue(...), its refusals retried (submit())."""
        self.sent()
        attempt = 0
        while True:
            try:
                return client._enqueue(x, deadline, priority, max_steps, out)
            except QueueFull as error:
                wait_s = self.delay_s(error, attempt, deadline)
                if wait_s is None:
                    raise
            time.sleep(wait_s)
            attempt += 1

    async def infer_async(self, client: Sender, x, timeout: Optional[float], priority: int,
                          max_steps: Optional[int]) -> Any:
        deadline = ticket.deadline_ns(timeout)
        self.sent()
        attempt = 0
        while True:
            try:
                return await _answer_async(client, x, deadline, timeout, priority, max_steps)
            except (QueueFull, RequestTimeout) as error:
                wait_s = self.delay_s(error, attempt, deadline)
                if wait_s is None:
                    raise
            await asyncio.sleep(wait_s)
            attempt += 1


async def _answer_async(client: Sender, x, deadline: Optional[int], timeout: Optional[float],
                        priority: int, max_steps: Optional[int]) -> Any:
    """One attempt of infer_async(), after its deadline."""
    seg, slot, gen, _ = client._enqueue(x, deadline, priority, max_steps)
    return await ticket.answer_of(client.completer(), seg, slot, gen, deadline, timeout)


def _after_fork_in_child() -> None:
    # a lock another thread of the parent held at the fork would stay held here
    for p in list(_policies):
        p.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
