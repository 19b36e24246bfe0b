"""How the HTTP worker writes a response: its head and a small body in one write.

uvicorn's send writes a response's head and its body apart, two send()s of
the socket for a small answer. HeadWithBody wraps a request's send so that
the head of a response that says its length is held and written with the
body, and lends the app a writer of a streamed body's next bytes
(scope["extensions"][WRITE_BODY]) that writes at once, with no coroutine.

A request a route answers from its whole body (the front's whole(), an
infer) skips the ASGI messages altogether: answer_whole() awaits its
answer and writes it as uvicorn's send would (uvicorn's default headers,
the body's length, `connection: close` when the connection ends after it),
then completes the request's cycle as send does, so uvicorn's protocol
goes on to the next request of the connection (or closes it) as after any
other.
"""
import asyncio
import logging
from typing import Optional

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from engine.http.asgi import WholeAnswer

log = logging.getLogger("shmbatch")

COALESCE_BYTES = 1 << 16  # a body up to this size is written with its response's head
# a request's body read whole before its route runs: uvicorn reads at most this
# much ahead of an app (its high-water mark)
WHOLE_BYTES = 1 << 16
# uvicorn's own answer to an app that failed
FAILED = (500, b"Internal Server Error",
          [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")])


class HeadWithBody:
    """A request's ASGI send (uvicorn's, wrapped): the head of a response that
    says its length is held and written with the body's first bytes, in one
    write, so that a small answer is one send() of the socket, not two. While
    the connection's writing is paused (its caller reads slowly) or a body is
    large, uvicorn's send writes as it does."""

    __slots__ = ("cycle", "send", "head", "passing")

    def __init__(self, cycle) -> None:
        self.cycle, self.send = cycle, cycle.send  # uvicorn's, bound
        self.head: Optional[bytes] = None
        self.passing = False  # the head is written: the rest is uvicorn's send's

    def __call__(self, message):
        if self.passing:  # uvicorn's own coroutine: no frame of ours per message
            return self.send(message)
        return self._send(message)

    async def _send(self, message) -> None:
        # uvicorn's send awaits only while writing is paused: otherwise the
        # transport set here is the one it writes to, and set back before any await
        cycle = self.cycle
        if cycle.flow.write_paused or cycle.disconnected:
            self._release()
            return await self.send(message)
        if self.head is None:
            self.passing = True
            if message["type"] != "http.response.start" or cycle.response_started or \
                    not any(name.lower() == b"content-length" for name, _ in
                            message.get("headers", ())):
                return await self.send(message)
            real, cycle.transport = cycle.transport, _Held(cycle.transport)
            try:
                await self.send(message)
            finally:
                self.head, cycle.transport = cycle.transport.data, real
            self.passing = self.head is None
            return
        if len(message.get("body", b"")) > COALESCE_BYTES:  # not worth its copy
            self._release()
            return await self.send(message)
        real, cycle.transport = cycle.transport, _Held(cycle.transport, self.head)
        self.head, self.passing = None, True
        try:
            await self.send(message)
        finally:
            held, cycle.transport = cycle.transport, real
            if held.data:  # nothing was written (a HEAD request, an error)
                real.write(held.data)

    def write_body(self, body: bytes) -> bool:
        """WRITE_BODY: a streamed (chunked) response's next body
        bytes written now, as uvicorn's send writes them; False while its
        writing is paused or the response is not a stream in progress."""
        cycle = self.cycle
        if cycle.flow.write_paused or cycle.disconnected or not cycle.chunked_encoding \
                or cycle.response_complete or not self.passing:
            return False
        if body:
            cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
        return True

    def _release(self) -> None:
        self.passing = True
        if self.head is not None:
            head, self.head = self.head, None
            self.cycle.transport.write(head)


class _Held:
    """A transport whose first write is held (data: what it held) or, given
    a head, written after it in one write; the rest is the transport's."""

    __slots__ = ("transport", "data")

    def __init__(self, transport, head: Optional[bytes] = None) -> None:
        self.transport, self.data = transport, head

    def write(self, data: bytes) -> None:
        if self.data is None:
            self.data = data
            return
        head, self.data = self.data, b""
        self.transport.write(head + data)

    def close(self) -> None:
        # uvicorn closes a Connection: close response once its body is sent, which
        # for a HEAD request writes nothing: the held head goes out first
        if self.data:
            self.transport.write(self.data)
            self.data = b""
        self.transport.close()

    def __getattr__(self, name: str):
        return getattr(self.transport, name)


def reads_whole(headers) -> bool:
    """Whether the request says its body's length (a Content-Length, no
    Transfer-Encoding) and it is at most WHOLE_BYTES."""
    length = None
    for name, value in headers:
        if name == b"content-length" and length is None:
            length = value
        elif name == b"transfer-encoding":
            return False
    return length is not None and length.isdigit() and int(length) <= WHOLE_BYTES


async def answer_whole(protocol, cycle, answer: WholeAnswer) -> None:
    """The cycle's request answered by answer(its body) once the body has come
    whole, written in one write as uvicorn's send writes a response that says
    its length; then the cycle completes as send completes it. A caller gone
    meanwhile gets nothing. A fault of the front's own, or the task cancelled
    (a drain past its grace), is answered as uvicorn answers an app that
    failed: 500, closed."""
    try:
        while cycle.more_body and not cycle.disconnected:  # as uvicorn's receive() waits
            cycle.flow.resume_reading()
            await cycle.message_event.wait()
            cycle.message_event.clear()
        if cycle.disconnected:  # gone, or timed out reading (answered 408)
            return
        raw, cycle.body = bytes(cycle.body), bytearray()
        status, body, headers = await answer(raw)
    except asyncio.CancelledError:
        _write(protocol, cycle, *FAILED)
        raise
    except Exception as e:  # the front answers its routes' errors: this is none of them
        log.error("%s %s failed", cycle.scope["method"], cycle.scope["path"], exc_info=e)
        status, body, headers = FAILED
    if cycle.flow.write_paused and not cycle.disconnected:
        await cycle.flow.drain()
    _write(protocol, cycle, status, body, headers)


def _write(protocol, cycle, status: int, body: bytes, headers) -> None:
    if cycle.disconnected or cycle.response_started:
        return
    if protocol.transport.is_closing():  # closed for a later request of the connection
        cycle.disconnected = True  # (uvicorn marks only the last one read)
        return
    head = [STATUS_LINE[status]]
    for name, value in protocol.server_state.default_headers:
        head += [name, b": ", value, b"\r\n"]
    closes = False
    for name, value in headers:
        if name == b"connection":  # the routes' one: close
            cycle.keep_alive, closes = False, True
        head += [name, b": ", value, b"\r\n"]
    if not cycle.keep_alive and not closes:
        head.append(b"connection: close\r\n")
    head += [b"content-length: %d\r\n\r\n" % len(body), body]
    cycle.response_started = True
    protocol.transport.write(b"".join(head))
    cycle.response_complete = True
    cycle.message_event.set()
    if not cycle.keep_alive:
        protocol.transport.close()
    cycle.on_response()
