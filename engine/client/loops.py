"""Answers handed to asyncio event loops: one wake of a loop per completer pass.

The completion thread settles every request that finished in a batch (or an
iterative engine's step) in one pass. Each belongs to a coroutine on some
event loop. call_soon_threadsafe per request would write the loop's
self-pipe and wake it once each; instead the thread posts each to its
loop's Inbox, and the loop runs them all in one callback: the first post
after a drain schedules it, the others only append. Within `with
deferred():` (a pass) the loops are woken at its end, so that a loop does
not take the GIL back and forth with the pass that is still settling.
"""
import collections
import logging
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger("shmbatch")

_inboxes: "weakref.WeakKeyDictionary[Any, Inbox]" = weakref.WeakKeyDictionary()
_made = threading.Lock()
_local = threading.local()  # .held: the inboxes a deferred() pass is to wake, or None


class Inbox:
    """Calls posted from any thread, run on one event loop."""

    __slots__ = ("_loop", "_queue", "_scheduled")

    def __init__(self, loop) -> None:
        self._loop = weakref.ref(loop)  # the inbox must not keep its loop alive
        self._queue: "collections.deque[tuple]" = collections.deque()
        self._scheduled = False

    def post(self, fn: Callable[[Any], object], arg: Any) -> bool:
        """fn(arg) on the loop, soon; False when the loop is closed (nothing
        posted runs any more). fn must not raise."""
        loop = self._loop()
        if loop is None or loop.is_closed():
            return False
        self._queue.append((fn, arg))
        if not self._scheduled:
            # several threads may see it unset and each schedule a drain: harmless
            self._scheduled = True
            held = getattr(_local, "held", None)
            if held is not None:
                held.append(self)
            else:
                return self._schedule(loop)
        return True

    def _schedule(self, loop) -> bool:
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # closed meanwhile: what was posted is dropped with it
            self._queue.clear()
            self._scheduled = False
            return False
        return True

    def _drain(self) -> None:
        # unset before the queue is read: a post that finds it unset after this
        # schedules another drain, so nothing appended is left behind
        self._scheduled = False
        queue = self._queue
        while queue:
            fn, arg = queue.popleft()
            try:
                fn(arg)
            except Exception:  # one owner's fault: the others still get theirs
                log.exception("an answer could not be handed to its coroutine")


class _Deferred:
    def __enter__(self) -> None:
        _local.held = []

    def __exit__(self, *exc: object) -> None:
        held, _local.held = _local.held, None
        for box in held:
            loop = box._loop()
            if loop is not None:
                box._schedule(loop)
            else:  # gone: nothing posted to it runs
                box._queue.clear()
                box._scheduled = False


_DEFERRED = _Deferred()


def deferred() -> _Deferred:
    """Within it (not nested), this thread's posts wake their loops at its
    end, once each."""
    return _DEFERRED


def inbox(loop) -> Inbox:
    """The loop's Inbox (made at its first use)."""
    found = _inboxes.get(loop)
    if found is None:
        with _made:
            found = _inboxes.get(loop)
            if found is None:
                found = _inboxes[loop] = Inbox(loop)
    return found


def resolve(settled: tuple) -> None:
    """(future, value, error) posted: the future's outcome, unless it is done
    (its awaiter was cancelled)."""
    future, value, error = settled
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
