"""What a caller of the OpenAI API gets: answers, events, errors in OpenAI's shape.

An error is {"error": {"message", "type", "param", "code"}}, with the Open
Inference Protocol front's statuses: 400 a bad request (InvalidInput too),
404 an unknown model or route, 405, 413 a body over its limit, 503
QueueFull / Overloaded / EngineUnavailable with Retry-After, 504
RequestTimeout, 500 BackendError. `code` names the engine's error.

Watch stands over one request's connection while its answer is computed: a
caller that disconnects, or one that reads nothing until past its deadline,
cancels the request's task (whose engine stream is then closed, which
withdraws the request). One task and one timer per request, nothing per chunk.
"""
import asyncio
import json
from typing import Optional

from engine.errors import (
    BackendError,
    EngineError,
    EngineUnavailable,
    InvalidInput,
    QueueFull,
    RequestTimeout,
)
from engine.http import oip_body

# the first class an error is an instance of decides its status and type
KINDS = ((InvalidInput, 400, "invalid_request_error"), (QueueFull, 503, "server_error"),
         (EngineUnavailable, 503, "server_error"), (RequestTimeout, 504, "server_error"),
         (BackendError, 500, "server_error"), (EngineError, 500, "server_error"))
TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
         413: "invalid_request_error"}
CLOSING_S = 5.0  # a stream's last events may take this long past its deadline
JSON = (b"content-type", b"application/json")
DONE = b"data: [DONE]\n\n"


class OpenAIError(Exception):
    """A refusal: its status, and the error object's fields."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: Optional[str] = None, headers=()) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.kind = kind or TYPES.get(status, "server_error")
        self.headers = list(headers)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def of_engine(error: EngineError, param: Optional[str] = None, retry_after_s: int = 1
              ) -> OpenAIError:
    """The OpenAI error of an engine's error (param: the request field an
    InvalidInput is about)."""
    status, kind = next((s, k) for cls, s, k in KINDS if isinstance(error, cls))
    name = type(error).__name__
    headers = [(b"retry-after", str(retry_after_s).encode())] if status == 503 else []
    return OpenAIError(status, f"{name}: {error}", param if status == 400 else None, name, kind,
                       headers)


async def send_json(send, status: int, value, headers=()) -> None:
    await send_bytes(send, status, json.dumps(value).encode(), headers)


async def send_bytes(send, status: int, body: bytes, headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [JSON, (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def send_error(send, error: OpenAIError) -> None:
    await send_json(send, error.status, error.body(), error.headers)


async def refuse_too_large(scope, receive, send, error: oip_body.TooLarge) -> None:
    """The 413, written before the rest of the body is read and dropped (as
    engine.http.oip_body.refuse does, in OpenAI's shape)."""
    body = json.dumps(OpenAIError(413, str(error)).body()).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [JSON, (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    expects = (oip_body.header(scope, b"expect") or "").lower() == "100-continue"
    if expects and not error.started:  # it waits for a 100 Continue that never comes
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await oip_body.drain(receive, oip_body.DRAIN_BYTES, oip_body.DRAIN_S)
    await send({"type": "http.response.body", "body": b""})


class Watch:
    """Cancels the current task when its caller disconnects (why = "gone") or
    when it is still at work CLOSING_S past deadline_s from now (why = "slow":
    its caller stopped reading). close() once the answer is written."""

    def __init__(self, receive, deadline_s: float) -> None:
        self.task = asyncio.current_task()
        self.why: Optional[str] = None
        self._watcher = asyncio.ensure_future(self._disconnect(receive))
        self._timer = asyncio.get_running_loop().call_later(deadline_s + CLOSING_S, self._cut,
                                                            "slow")

    async def _disconnect(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
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
