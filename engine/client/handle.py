"""The typed interfaces inside the client side.

`Handle` is what a Client lends its helpers (ticket, future, streams,
bulk, lent, room, completion): the few fields and calls they use, and
nothing else of it. The Client is its own Handle: the fields are its plain
attributes, so the request path reads them without an extra hop.

`Item` is what the completion thread (completion.Completer) settles for an
owner that waits without asking. Its `kind` says how:

- ANSWER (future.Request, ticket.Awaited): over once its slot is answered
  or failed; the completer fails it at its deadline, or when the engine dies;
- CHUNKS (async_streams.AsyncStream): follows a stream's chunk word; the completer
  calls try_settle() on every pass to tell its event loop whether the word
  moved, and fails it at its deadline, or when the engine dies.

Protocols, so that this module imports neither client.py nor its helpers.
"""
import threading
import weakref
from typing import TYPE_CHECKING, Any, Dict, Literal, Optional, Protocol, Tuple, Union

from engine.errors import EngineError
from engine.shm.codes import CHUNKS_END

if TYPE_CHECKING:
    from engine.segment import Segment

ANSWER: Literal["answer"] = "answer"
CHUNKS: Literal["chunks"] = "chunks"


class Handle(Protocol):
    """A Client, as its helpers see it."""

    name: str
    # the process the client is bound to (rebound in a forked child): with
    # start_ticks, the owner the ring records for the slots it takes
    pid: int
    start_ticks: int
    # how long the next wait spins before it sleeps: ring.SPIN_NS if the last
    # wait ended within it, else 0. A hint, written by every waiter, unlocked.
    spin_ns: int
    # how long an asyncio caller's first look at its answer spins
    # (looks.answered): looks.ASYNC_SPIN_NS while its answers come soon, else 0
    async_spin_ns: int

    @property
    def lone_looks(self) -> "Backoff":
        """A lone asyncio caller's longer looks (looks.LoneLooks)."""
        ...

    attached: Optional["Segment"]  # the segment attached last; None once closed
    # slot -> weakref of its pending submit() Future, for room.sweep() when
    # the ring is full; guarded by futures_lock
    held: Dict[int, "weakref.ref[Any]"]
    # one lock for all of the client's Futures (engine.client.stdfuture says
    # why), and the Condition over it that they share
    futures_lock: "threading.RLock"
    futures_cond: threading.Condition

    def completer(self) -> "Completion":
        """The client's completion thread (completion.Completer), started on first use."""
        ...

    def validated(self, x: Any, many: bool = False, priority: int = 0,
                  max_steps: Optional[int] = None, out: Any = None,
                  deadline: Optional[int] = None
                  ) -> Tuple["Segment", tuple, tuple, Optional[tuple]]:
        """(segment, arrays, lengths, outs) of a request checked against the
        running engine's spec, before anything is enqueued; EngineUnavailable
        while no batcher serves and none is expected to before deadline."""
        ...


class Backoff(Protocol):
    """Chances taken or skipped by what came of the last ones (looks.LoneLooks)."""

    def due(self) -> bool:
        """Whether this chance is taken."""
        ...

    def found(self, hit: bool) -> None:
        """What the chance taken found."""
        ...


class Watched(Protocol):
    """What every item of the completion thread has: its ticket, and
    try_settle(error=None) -> whether it is over for the completer (with
    error: fail it with that, unless it was answered that instant)."""

    seg: "Segment"
    slot: int
    gen: int

    def try_settle(self, error: Optional[EngineError] = None) -> bool:
        ...


class AwaitsAnswer(Watched, Protocol):
    """An item of kind ANSWER: settled when its slot is over."""

    kind: Literal["answer"]
    deadline: Optional[int]  # ring.now_ns() clock; None: none
    timeout: Optional[float]  # as the caller gave it, for RequestTimeout's text


class FollowsChunks(Watched, Protocol):
    """An item of kind CHUNKS: a stream whose loop is woken as chunks come;
    the completer fails it at its deadline (not once its final count came:
    overdue), or when the engine dies."""

    kind: Literal["chunks"]
    deadline: Optional[int]
    timeout: Optional[float]
    seen: int  # its chunk word as the completer last saw it


Item = Union[AwaitsAnswer, FollowsChunks]


class Completion(Protocol):
    """The completion thread, as its items reach it."""

    def add(self, item: Item) -> None:
        ...


def deadline_of(item: Item) -> Optional[int]:
    """item's deadline while it bounds it: none once a stream's final count
    came (every chunk came in time; only its settle is still to come)."""
    if item.kind == CHUNKS and item.seen & CHUNKS_END:
        return None
    return item.deadline


def overdue(item: Item, now: int) -> bool:
    """Whether item's deadline (deadline_of) has passed; run for every pending
    item at each wake: the common answer (none, or not yet) is read first."""
    deadline = item.deadline
    return deadline is not None and now >= deadline and deadline_of(item) is not None

