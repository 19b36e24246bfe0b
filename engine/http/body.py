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

A body with a Content-Encoding (gzip, deflate) is decoded as it comes
(engine.http.encoding): its limit is the decoded body's, its compressed bytes
bounded near it; a coding not taken is refused (415) and a stream that does
not decode (400) as a large body is: answered, then drained.
"""
import asyncio

from engine.http import encoding
from engine.http.asgi import JSON, Receive, Scope, Send, header
from engine.http.errors import BadRequest, Disconnected

# what a body holds beside its tensors' data or its tokens' text (names, shapes,
# parameters), in the limit each route derives from its engines
HEADER_BYTES = 64 << 10
# the most JSON a derived limit allows; a larger tensor travels as binary data
MAX_JSON_BYTES = 64 << 20
DRAIN_BYTES = 64 << 20
DRAIN_S = 10.0
ACCEPTED = ((b"accept-encoding", b"gzip, deflate"),)  # what a 415 says is taken (RFC 7694)


class Refused(BadRequest):
    """A body refused as it comes (413, 415, or 400 for one that does not
    decode): answered, then the rest drained; started: whether some of it
    was read."""

    def __init__(self, message: str, status: int, started: bool,
                 headers: tuple = ()) -> None:
        super().__init__(message, status, headers)
        self.started = started


class TooLarge(Refused):
    """A body over its limit (413)."""

    def __init__(self, message: str, started: bool) -> None:
        super().__init__(message, 413, started)


async def read(scope: Scope, receive: Receive, limit: int, why: str) -> bytes:
    """The request's body, decoded from its Content-Encoding; TooLarge if it
    is over `limit` bytes (`why` says what the limit is made of), Refused for
    a coding not taken (415) or bytes that do not decode (400)."""
    try:
        coding = encoding.coding_of(header(scope, b"content-encoding"))
    except encoding.Unsupported as e:
        raise Refused(str(e), 415, started=False, headers=ACCEPTED) from None
    wire = limit if coding is None else encoding.wire_limit(limit)
    what = "a body" if coding is None else f"a {coding} body"
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > wire:
        raise TooLarge(f"expected {what} of at most {wire} bytes ({why}), got "
                       f"Content-Length {declared}", started=False)
    inflater = None if coding is None else encoding.Inflater(coding, limit)
    chunks: list = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > wire:
            raise TooLarge(f"expected {what} of at most {wire} bytes ({why}), got more",
                           started=True)
        if inflater is None:
            chunks.append(chunk)
        else:
            await _inflate(inflater, chunk, chunks, limit, why)
        if not message.get("more_body", False):
            if inflater is not None:
                _finish(inflater)
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def whole_within(scope: Scope, limit: int) -> bool:
    """Whether read() takes this body as it comes and refuses none of it
    before it has: it says its length, at most `limit`, and has no
    Content-Encoding (a coded body is counted as it decodes)."""
    try:
        if encoding.coding_of(header(scope, b"content-encoding")) is not None:
            return False
    except encoding.Unsupported:
        return False
    declared = header(scope, b"content-length")
    return declared is not None and declared.isdigit() and int(declared) <= limit


async def _inflate(inflater: encoding.Inflater, chunk: bytes, into: list, limit: int,
                   why: str) -> None:
    """chunk's decoded bytes onto `into`, a step at a time, the event loop
    free between steps."""
    steps = inflater.feed(chunk)
    while True:
        try:
            out = next(steps, None)
        except encoding.OverLimit:
            raise TooLarge(f"expected a body of at most {limit} bytes ({why}) once decoded "
                           f"from {inflater.coding}, got more", started=True) from None
        except encoding.Undecodable as e:
            raise _undecodable(inflater, e) from None
        if out is None:
            return
        into.append(out)
        await asyncio.sleep(0)


def _finish(inflater: encoding.Inflater) -> None:
    try:
        inflater.finish()
    except encoding.Undecodable as e:
        raise _undecodable(inflater, e) from None


def _undecodable(inflater: encoding.Inflater, e: encoding.Undecodable) -> Refused:
    return Refused(f"Content-Encoding {inflater.coding}: expected {e}", 400, started=True)


async def refuse(scope: Scope, receive: Receive, send: Send, body: bytes,
                 error: BadRequest) -> None:
    """Answers `error` (a Refused body, or a refusal made before any of the
    body was read; body: its JSON, in the protocol's shape), then reads what
    the caller still sends (bounded) before the connection closes."""
    await send({"type": "http.response.start", "status": error.status,
                "headers": [JSON, *error.headers, (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    started = isinstance(error, Refused) and error.started
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
