"""A request's body under its limit, and the 413 that refuses one over it.

read() refuses a body over its limit from its Content-Length, before any of
it is read, and otherwise as soon as what came is over. The 413 is answered
so that the caller reads it: a client that sends its whole body before it
reads (urllib, requests, http.client) would get a connection reset, not the
answer, if the connection closed on unread data. So the answer is written
first, then the rest of the body is read and discarded (at most DRAIN_BYTES,
for at most DRAIN_S: a caller still sending after that is cut off), then the
connection closes. A caller that sent `Expect: 100-continue` and no byte yet
is answered and closed at once: it sends nothing more.
"""
import asyncio
import json
from typing import Optional

from engine.http.oip_tensors import BadRequest

DRAIN_BYTES = 64 << 20
DRAIN_S = 10.0


class TooLarge(BadRequest):
    """A body over its limit (413); started: whether some of it was read."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message, 413)
        self.started = started


class Disconnected(Exception):
    """The caller went away before its body came: nobody to answer."""


def header(scope, name: bytes) -> Optional[str]:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def read(scope, receive, limit: int, why: str) -> bytes:
    """The request's body; TooLarge if it is over `limit` bytes (`why` says
    what the limit is made of)."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"expected a body of at most {limit} bytes ({why}), got "
                       f"Content-Length {declared}", started=False)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"expected a body of at most {limit} bytes ({why}), got more",
                           started=True)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def refuse(scope, receive, send, error: TooLarge) -> None:
    """Answers the 413 of `error`, then reads what the caller still sends
    (bounded) before the connection closes."""
    body = json.dumps({"error": str(error)}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    expects = (header(scope, b"expect") or "").lower() == "100-continue"
    if expects and not error.started:  # it waits for a 100 Continue that never comes
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await drain(receive, DRAIN_BYTES, DRAIN_S)
    await send({"type": "http.response.body", "body": b""})


async def drain(receive, max_bytes: int, max_s: float) -> None:
    """Reads and discards the body until its end, the caller's disconnect,
    max_bytes or max_s, whichever comes first."""
    loop = asyncio.get_running_loop()
    deadline, got = loop.time() + max_s, 0
    while got <= max_bytes:
        left = deadline - loop.time()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect":
            return
        got += len(message.get("body", b""))
        if not message.get("more_body", False):
            return
