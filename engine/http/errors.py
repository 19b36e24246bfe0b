"""What the front refuses, and the status each engine error answers with.

Each protocol writes a refusal in its own shape (the Open Inference
Protocol's {"error": "..."}, OpenAI's error object) but with the same
status: BadRequest carries its own (400, 404, 405, 413); an EngineError's
is the first of ENGINE_STATUS it is an instance of.
"""
from typing import List, Tuple

from engine.errors import (
    BackendError,
    EngineError,
    EngineUnavailable,
    InvalidInput,
    QueueFull,
    RequestTimeout,
)

# the first class an error is an instance of decides its status
ENGINE_STATUS = ((InvalidInput, 400), (QueueFull, 503), (EngineUnavailable, 503),
                 (RequestTimeout, 504), (BackendError, 500), (EngineError, 500))


class BadRequest(Exception):
    """A request this server does not take: its status (400 unless said) and
    the headers its answer carries."""

    def __init__(self, message: str, status: int = 400,
                 headers: Tuple[Tuple[bytes, bytes], ...] = ()) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers


class NotFound(BadRequest):
    def __init__(self, message: str) -> None:
        super().__init__(message, 404)


class Disconnected(Exception):
    """The caller went away before its body came: nobody to answer."""


def status_of(error: EngineError) -> int:
    return next(code for kind, code in ENGINE_STATUS if isinstance(error, kind))


def allowed(method: str, allowed: str) -> None:
    """A 405 (BadRequest, with Allow) unless method is the route's."""
    if method != allowed:
        raise BadRequest(f"expected {allowed}, got {method}", 405,
                         ((b"allow", allowed.encode()),))


def retry_after(seconds: int) -> List[Tuple[bytes, bytes]]:
    """A 503's Retry-After header."""
    return [(b"retry-after", str(seconds).encode())]
