"""The gRPC status each refusal answers with: the HTTP front's refusals, as status codes.

The same errors and texts as the Open Inference Protocol over HTTP
(engine.http.errors, engine.http.oip), each as the status code of its kind:

    400 BadRequest, InvalidInput          INVALID_ARGUMENT
    404 NotFound (no such model)          NOT_FOUND
    413 (over a size limit)               RESOURCE_EXHAUSTED
    503 QueueFull, Overloaded             RESOURCE_EXHAUSTED, with when to try again
    503 EngineUnavailable, not ready      UNAVAILABLE, with when to try again
    504 RequestTimeout                    DEADLINE_EXCEEDED
    500 BackendError, anything else       INTERNAL

When to try again (the engine's predicted wait, as HTTP's Retry-After) rides
in the trailing metadata twice: `grpc-retry-pushback-ms` (gRPC's own server
pushback, gRFC A6, which a client's retry policy obeys) and `retry-after`
(whole seconds, as HTTP's header).
"""
from typing import Tuple

import grpc

from engine.errors import EngineError, EngineUnavailable, QueueFull
from engine.http.errors import BadRequest, status_of

# an HTTP status of the front -> the gRPC status of the same refusal
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
         404: grpc.StatusCode.NOT_FOUND, 405: grpc.StatusCode.UNIMPLEMENTED,
         413: grpc.StatusCode.RESOURCE_EXHAUSTED, 415: grpc.StatusCode.INVALID_ARGUMENT,
         504: grpc.StatusCode.DEADLINE_EXCEEDED}
Metadata = Tuple[Tuple[str, str], ...]


def of(error: BaseException, retry_after_s: int = 1) -> Tuple[grpc.StatusCode, str, Metadata]:
    """(status code, details, trailing metadata) of a refusal; retry_after_s:
    when a refused caller should try again (QueueFull, EngineUnavailable)."""
    if isinstance(error, BadRequest):
        return CODES.get(error.status, grpc.StatusCode.INVALID_ARGUMENT), str(error), ()
    if not isinstance(error, EngineError):
        return grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}", ()
    details = f"{type(error).__name__}: {error}"
    if isinstance(error, (QueueFull, EngineUnavailable)):
        code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, QueueFull)
                else grpc.StatusCode.UNAVAILABLE)
        return code, details, retry_metadata(retry_after_s)
    return CODES.get(status_of(error), grpc.StatusCode.INTERNAL), details, ()


def retry_metadata(retry_after_s: int) -> Metadata:
    """The trailers that say when to try again."""
    return (("grpc-retry-pushback-ms", str(retry_after_s * 1000)),
            ("retry-after", str(retry_after_s)))
