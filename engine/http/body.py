"""A request's body under its limit, and the 413 that refuses one over it.

read() refuses a body over its limit from its Content-Length, before any of
it is read, and otherwise as soon as what came is over. The 413 is answered
so that the caller reads it: a client that sends its whole body before it
reads (urllib, requests, http.client) would get a connection reset, not the
answer, if the connection closed on unread data. So the answer is written
first, then the rest of the body is read and discarded (at most DRAIN_BYTES,
for at most DRAIN_S: a caller still sending after that is cut off), then the
connection closes. A caller that sent `Expect: 100-continue` and no byte yet
is answered and closed at once: it sends nothing more. refuse() answers any
refusal made before the body is read (the front's 401) the same way.
"""
import asyncio

from engine.http.asgi import JSON, Receive, Scope, Send, header
from engine.http.errors import BadRequest, Disconnected

# what a body holds beside its tensors' data or its tokens' text (names, shapes,
# parameters), in the limit each route derives from its engines
HEADER_BYTES = 64 << 10
# the most JSON a derived limit allows; a larger tensor travels as binary data
MAX_JSON_BYTES = 64 << 20
DRAIN_BYTES = 64 << 20
DRAIN_S = 10.0


class TooLarge(BadRequest):
    """A body over its limit (413); started: whether some of it was read."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message, 413)
        self.started = started


async def read(scope: Scope, receive: Receive, limit: int, why: str) -> bytes:
    """The request's body; TooLarge if it is over `limit` bytes (`why` says
    what the limit is made of)."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"expected a body of at most {limit} bytes ({why}), got "
                       f"Content-Length {declared}", started=False)
    chunks: list = []
    size = 0
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


async def refuse(scope: Scope, receive: Receive, send: Send, body: bytes,
                 error: BadRequest) -> None:
    """Answers `error` (a 413 TooLarge, or a refusal made before any of the
    body was read; body: its JSON, in the protocol's shape), then reads what
    the caller still sends (bounded) before the connection closes."""
    await send({"type": "http.response.start", "status": error.status,
                "headers": [JSON, *error.headers, (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    started = isinstance(error, TooLarge) and error.started
    expects = (header(scope, b"expect") or "").lower() == "100-continue"
    if expects and not started:  # it waits for a 100 Continue that never comes
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await drain(receive, DRAIN_BYTES, DRAIN_S)
    await send({"type": "http.response.body", "body": b""})


async def drain(receive: Receive, max_bytes: int, max_s: float) -> None:
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
