"""What submit()'s Future stands on of concurrent.futures.Future beyond its
public API, in one place.

A Request (engine.client.future) settles itself in the thread that asks
(result(), done()), and all the futures of one client share one Condition:
Future.__init__ makes one per future (~2 us, as much as the rest of
submit()), and the standard library only ever locks it around short updates
(Request never waits on it: result() and exception() are its own). So
SettledHere sets a Future's state itself instead of through Future.__init__
and set_result(), and learns that concurrent.futures.wait() or
as_completed() wait on it when they append to its waiter list. Those are
names the standard library does not promise; STATE and the states below
are all of them, and shape_changes() says which of them a Python no longer
has the way this module uses them (tests/test_future_seam.py holds it to
none), so a Python that moves them fails a test, not a request.
"""
import concurrent.futures
import threading
from concurrent.futures import _base
from typing import Any, Callable, List, Optional, Tuple

PENDING, FINISHED = _base.PENDING, _base.FINISHED

# what Future.__init__ sets, and SettledHere.__init__ sets instead
STATE = ("_condition", "_state", "_result", "_exception", "_waiters", "_done_callbacks")


class SettledHere(concurrent.futures.Future):
    """A Future its own code settles. A subclass gives:

    - _outcome(error) -> (settled, value, failure): its request's outcome
      now (with error: failed with it unless answered that instant), called
      under the shared lock while the future is pending;
    - _await(wait_s): waits up to wait_s (None: as long as its request
      lives) for the outcome, then settles (try_settle);
    - _watch(): someone waits without asking (a callback, wait(),
      as_completed()): hand the future to a thread that settles it;
    - _withdraw() -> bool: cancel()'s, whether the request was taken back;
    - _report(failure): once settled or cancelled, outside the lock, when
      _began is set (a span to record)."""

    _began: Any = None
    _waiter_list: Optional["_WatchOnAppend"]
    _done_callbacks: List[Callable[..., object]]

    def __init__(self, condition: threading.Condition, lock: "threading.RLock") -> None:
        # Future.__init__'s state (STATE), its Condition shared; lock is the
        # Condition's own lock, taken without the Condition's Python-level wrapper
        self._condition, self._settling = condition, lock
        self._state, self._result, self._exception = PENDING, None, None
        self._waiter_list, self._done_callbacks = None, []

    def pending(self) -> bool:
        return self._state == PENDING

    def result(self, timeout: Optional[float] = None) -> Any:
        if self._state == PENDING and not self.try_settle():
            self._await(timeout)
        if self._state == FINISHED and self._exception is None:
            return self._result  # what super().result() returns, without its lock
        return super().result(timeout=0)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if self._state == PENDING and not self.try_settle():
            self._await(timeout)
        return super().exception(timeout=0)

    def done(self) -> bool:
        if self._state == PENDING and not self.try_settle():
            self._await(0)
        return self._state != PENDING

    def cancel(self) -> bool:
        with self._condition:
            if self._state != PENDING or not self._withdraw():
                return False  # settled, or answered already (its answer is result()'s)
            cancelled = super().cancel()
        if self._began is not None:
            self._report(concurrent.futures.CancelledError())
        return cancelled

    def add_done_callback(self, fn: Callable[["concurrent.futures.Future[Any]"], object]) -> None:
        super().add_done_callback(fn)
        self._watch()

    # concurrent.futures.wait() and as_completed() wait on a future by appending
    # to its _waiters list: that is the moment it needs a thread to settle it
    @property
    def _waiters(self) -> "_WatchOnAppend":  # type: ignore[override]
        if self._waiter_list is None:
            self._waiter_list = _WatchOnAppend(self)
        return self._waiter_list

    def try_settle(self, error: Optional[BaseException] = None) -> bool:
        """Settles the future if its request is over (see _outcome); whether
        it is settled. One settler at a time: the asker or a thread that
        watches it."""
        with self._settling:
            if self._state != PENDING:
                return True
            settled, value, failure = self._outcome(error)
            if not settled:
                return False
            if failure is not None:
                self.set_exception(failure)
            elif not self._waiter_list and not self._done_callbacks:
                self._result, self._state = value, FINISHED  # set_result, when nobody waits
            else:
                self.set_result(value)
        if self._began is not None:  # outside the lock: an export may be slow
            self._report(failure)
        return True

    def _outcome(self, error: Optional[BaseException]
                 ) -> Tuple[bool, Any, Optional[BaseException]]:
        raise NotImplementedError

    def _await(self, wait_s: Optional[float]) -> None:
        raise NotImplementedError

    def _watch(self) -> None:
        raise NotImplementedError

    def _withdraw(self) -> bool:
        raise NotImplementedError

    def _report(self, failure: Optional[BaseException]) -> None:
        raise NotImplementedError


class _WatchOnAppend(list):
    """A future's waiter list that calls its _watch() when
    concurrent.futures.wait() or as_completed() appends a waiter."""

    def __init__(self, future: SettledHere) -> None:
        super().__init__()
        self.future = future

    def append(self, waiter: Any) -> None:
        super().append(waiter)
        self.future._watch()


def shape_changes() -> List[str]:
    """What of the above this Python's concurrent.futures does otherwise
    ([] when nothing): the states, the attributes Future.__init__ sets, and
    wait() reaching a future through _state and _waiters."""
    changes = []
    for name, value in (("PENDING", PENDING), ("FINISHED", FINISHED)):
        if getattr(_base, name, None) is not value:
            changes.append(f"concurrent.futures._base.{name} is gone or changed")
    plain: "concurrent.futures.Future[None]" = concurrent.futures.Future()
    if sorted(vars(plain)) != sorted(STATE):
        changes.append(f"Future.__init__ sets {sorted(vars(plain))}, expected {sorted(STATE)}")
    elif plain._state is not PENDING or not isinstance(plain._condition, threading.Condition):
        changes.append("a new Future is not PENDING under its own threading.Condition")
    if not isinstance(plain._waiters, list) or not isinstance(vars(plain).get("_done_callbacks"),
                                                               list):
        changes.append("a Future's _waiters or _done_callbacks is not a list")
    seen: List[Any] = []

    class Probe(concurrent.futures.Future):
        @property
        def _waiters(self) -> Any:
            return self._probe

        @_waiters.setter
        def _waiters(self, value: Any) -> None:
            self._probe = _Recorder(value, seen)

    probe = Probe()
    concurrent.futures.wait([probe], timeout=0)
    if not seen:
        changes.append("concurrent.futures.wait() no longer appends a waiter to _waiters")
    probe.set_result(None)
    if probe._state is not FINISHED or probe._result is not None:
        changes.append("set_result() no longer leaves _state FINISHED and _result the value")
    return changes


class _Recorder(list):
    def __init__(self, items: Any, seen: List[Any]) -> None:
        super().__init__(items)
        self.seen = seen

    def append(self, item: Any) -> None:
        self.seen.append(item)
        super().append(item)
