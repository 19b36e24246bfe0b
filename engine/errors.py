"""The errors shmbatch raises: one class per way a request can fail.

Every message names what was expected and what came, so a caller can act on
it without reading the engine's logs.
"""
from typing import Optional


class EngineError(Exception):
    """Base of every error shmbatch raises."""


class InvalidInput(EngineError, ValueError):
    """The input does not match the engine's input spec; nothing was enqueued."""


class QueueFull(EngineError):
    """queue_capacity requests are queued or in flight; nothing was enqueued."""


class Overloaded(QueueFull):
    """Refused at enqueue, at once: by the engine's own figures (the queue
    ahead, its measured service time) the request could not be answered
    before its deadline. Nothing was enqueued.

    ``predicted_wait_ms`` and ``deadline_left_ms`` say why (None when the
    error was made from a message alone)."""

    predicted_wait_ms: Optional[int] = None
    deadline_left_ms: Optional[float] = None

    @classmethod
    def predicted(cls, predicted_wait_ms: int, deadline_left_ms: float) -> "Overloaded":
        """The admission's refusal. Its message is written only when read: an
        overloaded engine answers mostly this, and most are never printed."""
        e = cls()
        e.predicted_wait_ms, e.deadline_left_ms = predicted_wait_ms, deadline_left_ms
        return e

    def __str__(self) -> str:
        if self.predicted_wait_ms is None:
            return super().__str__()
        return (f"predicted wait {self.predicted_wait_ms} ms exceeds the request's deadline "
                f"of {max(0.0, self.deadline_left_ms or 0.0):.1f} ms")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"

    def __reduce__(self):
        if self.predicted_wait_ms is None:
            return super().__reduce__()
        return type(self).predicted, (self.predicted_wait_ms, self.deadline_left_ms)


class RequestTimeout(EngineError, TimeoutError):
    """No answer came within the timeout; the request was abandoned."""


class BackendError(EngineError):
    """The backend raised or returned a malformed result, or its batcher died.

    ``exc_type`` is the name of the backend's exception type (or
    ``"BatcherDied"``) and ``message`` its message.
    """

    def __init__(self, exc_type: str, message: str) -> None:
        super().__init__(f"{exc_type}: {message}")
        self.exc_type = exc_type
        self.message = message


class EngineUnavailable(EngineError):
    """No running engine of that name, or it is stopping or gone."""


class EngineCorrupt(EngineUnavailable):
    """The segment holds a value no engine process writes: another process
    of the user wrote into it. Raised instead of acting on that value."""


class EngineAlreadyRunning(EngineError):
    """start() found a live engine of the same name."""


class SegmentTooLarge(EngineError):
    """The engine's segment would not fit in /dev/shm (or in the host's free
    memory) with a margin left; nothing was created."""
