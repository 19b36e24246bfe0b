"""Client(retries=N): a refused request sent again, within a retry budget.

A request refused at enqueue (QueueFull, and Overloaded, its subclass) or
failed unstarted by the engine (STATUS_EXPIRED: its deadline too near for a
batch to start it) is sent again, at most N times, each after a jittered
exponential backoff, never past its own deadline (the first attempt's: a
retry does not extend it), and only while the retry budget allows. The
budget is one token bucket per process and engine name, shared by every
Client of that engine in the process (a Client made per request, or many
of them, would otherwise each bring a fresh bucket): each request adds one
unit, a retry costs RETRY_COST units, and the bucket starts at its burst,
BURST retries' worth, the most it holds. So over any run of a process's
requests at most BURST + requests / RETRY_COST of its sends are retries,
however overloaded the engine: its clients cannot multiply its load by
N + 1. A forked child starts its own budget, at its burst. A retry that is
not allowed (N reached, a backoff that would end at or past the deadline,
an empty bucket) raises the refusal at once; nothing else (InvalidInput,
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
from typing import Any, Dict, Optional, Protocol

from engine.client import sampled, ticket, wakes
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



class Budget:
    """The token bucket of one engine's retries in this process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.units = BURST * RETRY_COST  # in requests' deposits: its burst
        self.retries_total = 0  # retries it allowed
        self.denied_total = 0  # retries it did not allow

    def deposit(self) -> None:
        """A new request (not a retry): one unit, up to the burst."""
        with self.lock:
            if self.units < BURST * RETRY_COST:
                self.units += 1

    def spend(self) -> bool:
        """Whether a retry may be sent now; its cost taken if so."""
        with self.lock:
            if self.units < RETRY_COST:
                self.denied_total += 1
                return False
            self.units -= RETRY_COST
            self.retries_total += 1
            return True


# engine name -> its budget in this process; emptied in a forked child
_budgets: Dict[str, Budget] = {}
_budgets_lock = threading.Lock()
_policies: "weakref.WeakSet[Retrying]" = weakref.WeakSet()


def budget(name: str) -> Budget:
    """This process's retry budget for the engine called name."""
    with _budgets_lock:
        found = _budgets.get(name)
        if found is None:
            found = _budgets[name] = Budget()
        return found


class Sender(Handle, Protocol):
    """A Client as the retries see it: a Handle that can enqueue."""

    def _enqueue(self, x: Any, deadline: Optional[int], priority: int = 0,
                 max_steps: Optional[int] = None, out: Any = None, sampling: Any = None) -> tuple:
        ...


def policy(retries: int, name: str) -> "Optional[Retrying]":
    """The retry policy of Client(name, retries=...); None for 0 (no retry, no cost)."""
    if type(retries) is not int or retries < 0:
        raise ValueError(f"retries: expected an int >= 0, got {retries!r}")
    return Retrying(retries, name) if retries else None


def retryable(error: BaseException) -> bool:
    """Refused at enqueue, or failed by the engine before it computed it."""
    return isinstance(error, QueueFull) or (isinstance(error, RequestTimeout)
                                             and getattr(error, "unstarted", False))


def backoff_s(attempt: int) -> float:
    """The jittered wait before retry number attempt + 1 (see BASE_S)."""
    step_s = min(CAP_S, BASE_S * (1 << min(attempt, 30)))
    return step_s * (0.5 + 0.5 * random.random())  # random: reseeded in a forked child


class Retrying:
    """One client's retries: at most `retries` a request, within its
    process's budget for the engine."""

    def __init__(self, retries: int, name: str) -> None:
        self.retries = retries
        self.name = name
        self.lock = threading.Lock()
        self.retries_total = 0  # retries this client sent
        _policies.add(self)

    def sent(self) -> None:
        """A new request (not a retry): its deposit into the budget."""
        budget(self.name).deposit()

    def delay_s(self, error: BaseException, attempt: int, deadline: Optional[int]
                ) -> Optional[float]:
        """The backoff before retry attempt + 1 of a request that failed with
        error, its token spent; None when it is not to be retried."""
        if attempt >= self.retries or not retryable(error):
            return None
        wait_s = backoff_s(attempt)
        if deadline is not None and ring.now_ns() + int(wait_s * 1e9) >= deadline:
            return None
        if not budget(self.name).spend():
            return None
        with self.lock:
            self.retries_total += 1
        return wait_s

    # -- the calls that retry ---------------------------------------------------
    def infer(self, client: Sender, x, timeout: Optional[float], priority: int,
              max_steps: Optional[int], out, sampling=None) -> Any:
        deadline = ticket.deadline_ns(timeout)
        self.sent()
        attempt = 0
        while True:
            try:
                seg, slot, gen, outs = client._enqueue(x, deadline, priority, max_steps, out,
                                                       sampling)
                answer = ticket.await_answer(client, seg, slot, gen, deadline, timeout, outs)
                return sampled.cut(answer, sampled.k_of(seg, sampling))
            except (QueueFull, RequestTimeout) as error:
                wait_s = self.delay_s(error, attempt, deadline)
                if wait_s is None:
                    raise
            time.sleep(wait_s)
            attempt += 1

    def enqueue(self, client: Sender, x, deadline: Optional[int], priority: int,
                max_steps: Optional[int] = None, out=None, sampling=None) -> tuple:
        """client._enqueue(...), its refusals retried (submit())."""
        self.sent()
        attempt = 0
        while True:
            try:
                return client._enqueue(x, deadline, priority, max_steps, out, sampling)
            except QueueFull as error:
                wait_s = self.delay_s(error, attempt, deadline)
                if wait_s is None:
                    raise
            time.sleep(wait_s)
            attempt += 1

    async def infer_async(self, client: Sender, x, timeout: Optional[float], priority: int,
                          max_steps: Optional[int], sampling=None) -> Any:
        deadline = ticket.deadline_ns(timeout)
        self.sent()
        attempt = 0
        while True:
            try:
                return await _answer_async(client, x, deadline, timeout, priority, max_steps,
                                           sampling)
            except (QueueFull, RequestTimeout) as error:
                wait_s = self.delay_s(error, attempt, deadline)
                if wait_s is None:
                    raise
            await asyncio.sleep(wait_s)
            attempt += 1


async def _answer_async(client: Sender, x, deadline: Optional[int], timeout: Optional[float],
                        priority: int, max_steps: Optional[int], sampling=None) -> Any:
    """One attempt of infer_async(), after its deadline."""
    seg, slot, gen, _ = client._enqueue(x, deadline, priority, max_steps, None, sampling)
    answer = await wakes.answer_of(client, seg, slot, gen, deadline, timeout)
    return sampled.cut(answer, sampled.k_of(seg, sampling))


def _after_fork_in_child() -> None:
    # a process of its own: its own budgets, at their burst (and a lock
    # another thread of the parent held at the fork would stay held here)
    global _budgets_lock
    _budgets_lock = threading.Lock()
    _budgets.clear()
    for client_policy in list(_policies):
        client_policy.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
