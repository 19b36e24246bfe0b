"""What a caller of the OpenAI API gets: answers, events, errors in OpenAI's shape.

An error is {"error": {"message", "type", "param", "code"}}, with the
statuses of every protocol of the front (engine.http.errors): 400 a bad
request (InvalidInput too), 404 an unknown model or route, 405, 413 a body
over its limit, 503 QueueFull / Overloaded / EngineUnavailable with
Retry-After, 504 RequestTimeout, 500 BackendError. `code` names the
engine's error.
"""
import json
from typing import Optional

from engine.errors import EngineError
from engine.http.asgi import JSON, Headers, Send, send_whole
from engine.http.errors import retry_after, status_of

TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
         413: "invalid_request_error"}
DONE = b"data: [DONE]\n\n"


class OpenAIError(Exception):
    """A refusal: its status, and the error object's fields."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, kind: Optional[str] = None,
                 headers: Headers = ()) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.kind = kind or TYPES.get(status, "server_error")
        self.headers = list(headers)

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}

    def encoded(self) -> bytes:
        return json.dumps(self.body()).encode()


def bad(message: str, param: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def of_engine(error: EngineError, param: Optional[str] = None, retry_after_s: int = 1
              ) -> OpenAIError:
    """The OpenAI error of an engine's error (param: the request field an
    InvalidInput is about)."""
    status = status_of(error)
    kind = "invalid_request_error" if status == 400 else "server_error"
    name = type(error).__name__
    headers = retry_after(retry_after_s) if status == 503 else []
    return OpenAIError(status, f"{name}: {error}", param if status == 400 else None, name, kind,
                       headers)


async def send_json(send: Send, status: int, value, headers: Headers = ()) -> None:
    await send_whole(send, status, json.dumps(value).encode(), [JSON, *headers])


async def send_error(send: Send, error: OpenAIError) -> None:
    await send_json(send, error.status, error.body(), error.headers)
