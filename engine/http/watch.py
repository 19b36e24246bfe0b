"""A request's caller watched while its answer is computed: its disconnect and its deadline.

disconnected() is the one watcher of a caller's disconnect: it returns once
receive() says `http.disconnect` (after the body, receive() says nothing
else). Watch stands over a request answered in one piece: a caller that
disconnects, or a request still at work CLOSING_S past its deadline (its
caller reads nothing), cancels the request's task, whose engine requests
are then withdrawn. One task and one timer per request, nothing per chunk.
"""
import asyncio
from typing import Optional, Sequence

from engine.http.asgi import Receive
from engine.http.engines import answers_of

CLOSING_S = 5.0  # an answer's last bytes may take this long past its deadline


async def disconnected(receive: Receive) -> None:
    """Returns once the caller disconnected."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Watch:
    """Cancels the current task when its caller disconnects (why = "gone") or
    when it is still at work CLOSING_S past deadline_s from now (why = "slow":
    its caller stopped reading). close() once the answer is written."""

    def __init__(self, receive: Receive, deadline_s: float) -> None:
        self.task = asyncio.current_task()
        self.why: Optional[str] = None
        self._watcher = asyncio.ensure_future(self._disconnect(receive))
        self._timer = asyncio.get_running_loop().call_later(deadline_s + CLOSING_S, self._cut,
                                                            "slow")

    async def _disconnect(self, receive: Receive) -> None:
        await disconnected(receive)
        self._cut("gone")

    def _cut(self, why: str) -> None:
        if self.why is None and self.task is not None:
            self.why = why
            self.task.cancel()

    def close(self) -> None:
        self._watcher.cancel()
        self._timer.cancel()

    def ours(self) -> bool:
        """Whether a CancelledError is this watch's doing (then it is taken
        back: the task goes on to end quietly)."""
        if self.why is None or self.task is None:
            return False
        self.task.uncancel()
        return True


async def watched_answers(client, rows: Sequence, timeout_s: float, priority: int,
                          receive: Receive) -> Optional[list]:
    """answers_of(client, rows, ...) under a Watch: None if its caller left
    (the requests are then withdrawn)."""
    watch = Watch(receive, timeout_s)
    try:
        return await answers_of(client, rows, timeout_s, priority)
    except asyncio.CancelledError:
        if watch.ours():
            return None
        raise
    finally:
        watch.close()
