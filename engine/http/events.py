"""A stream followed on an HTTP worker's loop at the engine's pace: whole, or as server-sent events.

The stream is one a Client opened (open_stream_async). The Client's
completion thread wakes the worker's event loop once per engine step for
all its streams (engine.client.loops); each stream then takes every chunk
come since in one call (AsyncStream.ready), and EventStream writes them as
one HTTP chunk. Under the HTTP worker, whose connections lend a writer of
streamed bodies (WRITE_BODY), that happens in the wake's callback itself:
per chunk no coroutine is resumed, and no task, future or timer is made.
Elsewhere each wake resumes the writing coroutine through one future. Per
request there is one task watching for the caller's disconnect and one
timer bounding its sends.

EventStream is protocol-neutral: a protocol subclasses it and says how its
events are written (events(), end(), error_event(), error_body()); its
run() does the rest. A caller that disconnects withdraws its request: its
stream is closed, and the batcher drops the request at its next step. The
request's timeout bounds the caller's reading too: a send still pending at
the deadline (or SEND_MIN_S after it began, if later) ends the stream and
closes the connection; the last events, after the stream's end, get
CLOSING_S.
"""
import asyncio
import json
import logging
from typing import Optional

from engine.errors import EngineError, EngineUnavailable
from engine.http.asgi import WRITE_BODY, Receive, Scope, Send
from engine.http.watch import CLOSING_S, disconnected

log = logging.getLogger("shmbatch")

SHUTDOWN = "the server is shutting down; this request was not completed"
CUT = "the answer ended before it completed"
SEND_MIN_S = 1.0
EMPTY = object()  # an answer of no chunk


class Finished(Exception):
    """Raised by EventStream.events() to end the answer there (a stop string
    found, say): body, its last events, is written, then end(finish_reason),
    and the request is withdrawn if it runs on."""

    def __init__(self, body: bytes, finish_reason: str) -> None:
        super().__init__(finish_reason)
        self.body, self.finish_reason = body, finish_reason


class Failed(Exception):
    """Raised by EventStream.events() when a chunk cannot be written (its
    token cannot be decoded, say): body, the events of the chunks before it,
    is written, then the error_event of error."""

    def __init__(self, body: bytes, error: Exception) -> None:
        super().__init__(str(error))
        self.body, self.error = body, error


class Follower:
    """An opened stream and its caller's disconnect, followed together."""

    def __init__(self, chunks, receive: Receive) -> None:
        self.chunks = chunks
        self.gone = asyncio.ensure_future(disconnected(receive))
        self.gone.add_done_callback(self._woken)
        self.read = False  # all that came was read: what comes next wakes the stream

    def _woken(self, _) -> None:
        self.chunks.wake()

    async def next(self):
        """The chunks come since the last call, stacked (AsyncStream.ready),
        waiting for one at least; None once the caller went away.
        StopAsyncIteration at the end; the request's error after its chunks."""
        chunks = self.chunks
        if self.read and not self.gone.done():
            await chunks.wait()
        while not self.gone.done():  # checked first: chunks may come on forever
            got = chunks.ready()
            if got is not None:
                self.read = True
                return got
            await chunks.wait()
        return None

    async def close(self) -> None:
        """Withdraws the request unless it ended."""
        self.gone.cancel()
        await self.chunks.aclose()


async def collect(chunks, receive: Receive) -> Optional[list]:
    """Every chunk of the stream, in blocks as they came (AsyncStream.ready);
    None (the request withdrawn) once its caller disconnected. The request's
    error is raised."""
    follower = Follower(chunks, receive)
    got: list = []
    try:
        while True:
            more = await follower.next()
            if more is None:
                return None
            got.append(more)
    except StopAsyncIteration:
        return got
    finally:
        await follower.close()


class EventStream:
    """One request's answer written as server-sent events through an ASGI
    send, as its chunks come. Subclass it and define events(); then

        await MyEvents(chunks, scope, receive, send, timeout_s).run()

    Without the server's writer (WRITE_BODY) each block is sent through send.

    An error before the first chunk is raised (answer it as any error); one
    after, the engine's or the protocol's own (events() raising, or raising
    Failed with the events of the chunks before the one it cannot write),
    ends the stream with error_event(). events() may end the answer
    early (Finished): its request is then withdrawn. A stream cut short
    ends with the error_event of EngineUnavailable(CUT); one cut by the
    server's shutdown with that of EngineUnavailable(SHUTDOWN), or a 503 of
    its error_body before it began."""

    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    def __init__(self, chunks, scope: Scope, receive: Receive, send: Send,
                 timeout_s: float) -> None:
        self.chunks, self.receive, self.send = chunks, receive, send
        # the server's writer of a streamed body, where it has one (the HTTP
        # worker's connections): the chunks are then written in the stream's
        # wakes themselves (_pump), with no coroutine resumed
        self.write_body = scope.get("extensions", {}).get(WRITE_BODY)
        self.handed: Optional[asyncio.Future] = None  # what the pump hands to run()
        self.follower: Optional[Follower] = None
        self.loop = asyncio.get_running_loop()
        self.limit = self.loop.time() + timeout_s  # sends begun before it end by it
        self.send_until = self.limit
        self.sending = False
        self.slow = False  # the bound cut a send: its caller stopped reading
        self.task: Optional[asyncio.Task] = None
        self.timer: Optional[asyncio.TimerHandle] = None

    # -- what a protocol defines ---------------------------------------------------
    def events(self, chunks, finish_reason: Optional[str]) -> bytes:
        """The events of chunks: those come since the last call, stacked
        (AsyncStream.ready: one output (n, *chunk_shape), or a dict of them);
        finish_reason is the last one's: "stop" or "length" when it ends a
        complete answer, else None. Finished ends the answer early."""
        raise NotImplementedError

    def end(self, finish_reason: str) -> bytes:
        """What follows the last chunk of a complete answer."""
        return b""

    def error_event(self, error: EngineError) -> bytes:
        """The last event of a stream that failed after it began."""
        return event(self.error_body(error))

    def error_body(self, error: EngineError) -> bytes:
        """The JSON body of the 503 of a stream the server's shutdown cut before it began."""
        return json.dumps({"error": f"{type(error).__name__}: {error}"}).encode()

    # -- the writing -------------------------------------------------------------------
    async def run(self) -> None:
        task = asyncio.current_task()
        assert task is not None  # a coroutine runs in a task
        self.task = task
        follower = Follower(self.chunks, self.receive)
        started = False
        try:
            try:
                got = await follower.next()  # an EngineError here is an ordinary error response
            except StopAsyncIteration:  # an empty answer
                got = EMPTY
            if got is None:
                return
            self.timer = self.loop.call_at(self.limit, self._check)
            await self._send({"type": "http.response.start", "status": 200,
                              "headers": self.headers})
            started = True
            while got is not EMPTY:
                reason = self.chunks.finish_reason
                try:
                    body = self.events(got, reason)
                except Finished as e:
                    return await self._finish(e.body + self.end(e.finish_reason))
                # the last chunk, its finish_reason known: ended here if its slot
                # settled already (StopAsyncIteration), else its settle's wake ends it
                if reason is not None:
                    try:
                        self.chunks.ready()
                    except StopAsyncIteration:
                        return await self._finish(body + self.end(reason))
                    except EngineError as e:
                        return await self._finish(body + self.error_event(e))
                await self._send({"type": "http.response.body", "body": body, "more_body": True})
                try:
                    got = await self._next(follower)
                except StopAsyncIteration:
                    break
                except EngineError as e:
                    return await self._finish(self.error_event(e))
                except Finished as e:  # the pump's events() ended it
                    return await self._finish(e.body + self.end(e.finish_reason))
                if got is None:
                    return
            reason = self.chunks.finish_reason  # ended: a clean end is never short
            await self._finish(self.end(reason) if reason is not None
                               else self.error_event(EngineUnavailable(CUT)))
        except asyncio.CancelledError:
            if self.slow:  # the bound cut a send: the request ends here
                task.uncancel()
                log.warning("a stream's caller read nothing until its deadline; closed")
            elif not started:  # the server stops (its drain ran out)
                await self.send({"type": "http.response.start", "status": 503,
                                 "headers": [(b"content-type", b"application/json")]})
                await self.send({"type": "http.response.body",
                                 "body": self.error_body(EngineUnavailable(SHUTDOWN))})
            else:
                await self.send({"type": "http.response.body",
                                 "body": self.error_event(EngineUnavailable(SHUTDOWN))})
        except Exception as e:
            if not started:
                raise  # answered as any error of the route is
            await self._failed(e)
        finally:
            if self.timer is not None:
                self.timer.cancel()
            await follower.close()  # withdraws the request unless it ended

    async def _failed(self, error: Exception) -> None:
        """A stream that began, ended by an error of the server's own (its
        tokenizer's, say) or the engine's: its last event says so, after
        those of the chunks before it (Failed)."""
        body = b""
        if isinstance(error, Failed):
            body, error = error.body, error.error
        if not isinstance(error, EngineError):
            log.error("a stream failed after it began", exc_info=error)
            error = EngineError(f"{type(error).__name__}: {error}")
        await self._finish(body + self.error_event(error))

    async def _next(self, follower: Follower):
        """What run() writes next: the next block (follower.next). With the
        server's writer, the blocks are written by the pump as they come, and
        this returns only what the pump hands back: the last block (its
        finish_reason known), None once the caller went away; StopAsyncIteration
        or the request's error. A body the connection did not take at once
        (its caller reads slowly) is sent from here."""
        if self.write_body is None:
            return await follower.next()
        while True:
            self.handed, self.follower = self.loop.create_future(), follower
            self.chunks.on_wake = self._pump
            try:
                self._pump()  # what came since the last block
                handed = await self.handed
            finally:
                self.chunks.on_wake, self.handed = None, None
            if type(handed) is _Raise:
                raise handed.error
            if type(handed) is not bytes:
                return handed
            await self._send({"type": "http.response.body", "body": handed, "more_body": True})

    def _pump(self) -> None:
        """The stream's waker while run() waits in _next: writes every block
        come, in this callback, while the connection takes it."""
        handed, chunks, follower = self.handed, self.chunks, self.follower
        if handed is None or handed.done() or follower is None:
            return
        try:
            while not follower.gone.done():
                got = chunks.ready()
                if got is None:
                    return
                if chunks.finish_reason is not None:  # the last block: run()'s to end
                    return handed.set_result(got)
                body = self.events(got, None)
                if not self.write_body(body):
                    return handed.set_result(body)
            handed.set_result(None)
        except BaseException as e:  # the end, or the request's error: run()'s to write
            handed.set_result(_Raise(e))

    async def _finish(self, body: bytes) -> None:
        """The last events and the response's end, within CLOSING_S."""
        self.limit = self.loop.time() + CLOSING_S
        if self.timer is not None and self.timer.when() > self.limit:
            self.timer.cancel()
            self.timer = self.loop.call_at(self.limit, self._check)
        await self._send({"type": "http.response.body", "body": body})

    async def _send(self, message: dict) -> None:
        self.send_until = max(self.limit, self.loop.time() + SEND_MIN_S)
        self.sending = True
        try:
            await self.send(message)
        finally:
            self.sending = False

    def _check(self) -> None:
        """The timer: cuts a send past its bound, else looks again when one could be."""
        now = self.loop.time()
        if self.sending and now >= self.send_until:
            self.slow, self.timer = True, None
            if self.task is not None:
                self.task.cancel()
            return
        self.timer = self.loop.call_at(self.send_until if self.sending else now + SEND_MIN_S,
                                       self._check)


class _Raise:
    """An exception the pump hands to run(), to be raised there."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def event(data: bytes) -> bytes:
    """One server-sent event of data (a line of JSON, say)."""
    return b"data: " + data + b"\n\n"


def _json_maker():
    """json.dumps(value) for a value of JSON types, as json.dumps writes it,
    without the encoder json.dumps makes at each call."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # no C accelerator
        return json.dumps
    encode = make(None, None, json.encoder.encode_basestring_ascii, None, ": ", ", ",
                  False, False, True)
    return lambda value: "".join(encode(value, 0))


dumps = _json_maker()
