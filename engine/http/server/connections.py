"""The HTTP worker's connections, held against careless and hostile callers.

uvicorn's httptools protocol, subclassed, with what it lacks:

- a read timeout: a request's head and body must come within
  read_timeout_s of its first byte (of the connection's opening, for the
  first request); a connection that sent nothing by then is closed, one
  whose request is half-sent is answered 408 {"error": ...} and closed
  (uvicorn closes an idle keep-alive connection itself, after 5 s);
- a cap on open connections: beyond max_connections, a new connection is
  answered 503 {"error": ...} with `Connection: close` at once, and closed;
- a drain that refuses: once the worker stops (serve's SIGTERM), a new
  connection is answered 503 at once while the requests in progress finish
  (uvicorn stops accepting, and the kernel would queue new connections on
  the shared socket until serve closes it, then reset them).

Each request starts one of two ways (engine.http.server.writes writes
both answers). A request the front answers from its whole body (its
whole(): an infer of at most WHOLE_BYTES that says its length) is answered
by one task, once its body is whole, with no ASGI message; any other goes to the
app through ASGI, its send (HeadWithBody) writing the head of a response
that says its length with its body, in one write of the socket, and
lending the app a writer of a streamed body's next bytes
(scope["extensions"][WRITE_BODY]) that writes at once, with no coroutine.
Either way uvicorn's cycle of the request holds its state, so pipelining,
keep-alive, the drain and this read timeout treat both alike.

A refused connection is half-closed after its answer and read (discarded)
for at most LINGER_S before it closes, so a caller still sending its
request reads the answer rather than a reset. And the worker's logs stay
bounded: asyncio logs every failed accept() (a worker out of descriptors)
with its traceback, up to the backlog's 2048 times a second; RateLimit lets
one line of a kind through per interval, saying how many it held back.
"""
import asyncio
import json
import logging
import os
import resource
import time
from typing import Callable, Optional

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from engine.http.asgi import WRITE_BODY, Scope, WholeAnswer
from engine.http.server import writes

log = logging.getLogger("shmbatch")

DEFAULT_READ_TIMEOUT_S = 15.0
DEFAULT_MAX_CONNECTIONS = 1024
# descriptors kept clear of connections when the cap is sized from the fd
# limit: the app's (the engines' segments, its pipes) and the refusals' own
FD_RESERVE = 64
LINGER_S = 2.0
MAX_LINGERING = 16  # refused connections read at once; beyond, one closes at once
LINGER_BYTES = 1 << 16
LOG_INTERVAL_S = 10.0
OOM_SCORE_RAISE = 500  # a worker dies before a batcher when memory runs out


class Tally:
    """An event logged at most once per interval, with how many happened since."""

    def __init__(self, text: str, level: int = logging.WARNING) -> None:
        self.text, self.level = text, level
        self.count, self.next = 0, 0.0

    def add(self) -> None:
        self.count += 1
        now = time.monotonic()
        if now >= self.next:
            self.next = now + LOG_INTERVAL_S
            log.log(self.level, "HTTP worker pid %d: %s (%d since the last such line)",
                    os.getpid(), self.text, self.count)
            self.count = 0


class Guard:
    """What the connections of one worker share: their limits, the drain, the
    refusals' tallies."""

    def __init__(self, read_timeout_s: float, max_connections: int,
                 whole: Optional[Callable[[Scope], Optional[WholeAnswer]]] = None) -> None:
        self.read_timeout_s, self.max_connections = read_timeout_s, max_connections
        self.whole = whole  # the front's whole(): a request it answers from its whole body
        self.draining = False
        self.lingering = 0
        self.refused = Tally(f"connections refused (503): {max_connections} open already "
                             f"(--http-max-connections)")
        self.timed_out = Tally(f"connections closed: no complete request within "
                               f"{read_timeout_s:g} s (--http-read-timeout-s)", logging.INFO)


def protocol(guard: Guard) -> type:
    """The protocol class for uvicorn.Config(http=...), its connections sharing guard."""
    return type("GuardedProtocol", (GuardedProtocol,), {"guard": guard})


def answer(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response: {"error": message}, then the connection closes."""
    body = json.dumps({"error": message}).encode()
    return (STATUS_LINE[status] + b"content-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class GuardedProtocol(HttpToolsProtocol):
    """One connection: refused at once when the worker drains or is at its
    cap, else served by uvicorn under the read timeout."""

    guard: Guard

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the read timeout's one timer, armed while the connection lives: a
        # request only notes when its reading began, so a keep-alive
        # connection costs no timer per request
        self._deadline: Optional[asyncio.TimerHandle] = None
        self._fresh = True  # no request has begun: its reading began with the connection
        self._since = 0.0  # when the reading of the request (or connection) began
        self._partial = False  # a request has begun and is not whole yet
        self._head_done = False  # ... and its head has come
        self._body_bytes = 0  # ... and this much of its body
        self._refused = False
        self._linger: Optional[asyncio.TimerHandle] = None  # a refused connection's closing timer
        self._discarded = 0

    # -- a connection refused at once ------------------------------------------
    def connection_made(self, transport) -> None:
        guard = self.guard
        if guard.draining:
            return self._refuse(transport, "the server is shutting down (draining its "
                                           "requests in progress): expected no new request")
        if len(self.connections) >= guard.max_connections:
            guard.refused.add()
            return self._refuse(transport, f"expected at most {guard.max_connections} open "
                                           f"connections to this worker, got one more: try "
                                           f"again, or reuse a connection")
        super().connection_made(transport)
        self._since = self.loop.time()
        self._arm(self._since + guard.read_timeout_s)

    def _refuse(self, transport, message: str) -> None:
        self._refused, self.transport = True, transport
        transport.write(answer(503, message))
        if self.guard.lingering >= MAX_LINGERING:
            transport.close()
            return
        self.guard.lingering += 1
        transport.write_eof()  # then read what the caller still sends, for a while
        self._linger = self.loop.call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            return super().data_received(data)
        self._discarded += len(data)
        if self._discarded > LINGER_BYTES:
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
            self.guard.lingering -= 1
        if self._refused:
            return
        super().connection_lost(exc)

    # -- the read timeout -------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._partial, self._head_done, self._body_bytes = True, False, 0
        if not self._fresh:  # the first request's runs from the connection's opening
            self._since = self.loop.time()
        self._fresh = False

    def on_headers_complete(self) -> None:
        self._head_done = True
        super().on_headers_complete()

    def _start_asgi_task(self, cycle, app) -> None:
        """A request's start (its head has come, and no earlier request's
        answer is still being written): answered from its whole body where
        the front takes it so, else by the app through its ASGI messages."""
        whole = self.guard.whole
        answer = None
        if whole is not None and app is self.app and not cycle.waiting_for_100_continue and \
                writes.reads_whole(cycle.scope["headers"]):
            try:
                answer = whole(cycle.scope)
            except Exception:  # the app answers it as it answers its faults
                log.exception("%s %s: the front's whole() failed", cycle.scope["method"],
                              cycle.scope["path"])
        if answer is None:
            send = writes.HeadWithBody(cycle)
            cycle.send = send  # run_asgi looks it up when it runs
            extensions: dict = cycle.scope.setdefault("extensions", {})
            extensions[WRITE_BODY] = send.write_body
            return super()._start_asgi_task(cycle, app)
        task = self.loop.create_task(writes.answer_whole(self, cycle, answer))
        task.add_done_callback(self.tasks.discard)  # the server's drain awaits its tasks
        self.tasks.add(task)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._partial = False
        super().on_message_complete()

    def _arm(self, when: float) -> None:
        self._deadline = self.loop.call_at(when, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        transport = self.transport
        if transport.is_closing():
            return
        now, timeout_s = self.loop.time(), self.guard.read_timeout_s
        if not (self._partial or self._fresh):  # between requests, or the app's: not read
            return self._arm(now + timeout_s)
        if now < self._since + timeout_s:  # a later request's reading: its own time left
            return self._arm(self._since + timeout_s)
        if self.flow.read_paused:  # this server stopped reading (a pipelined request waits,
            return self._arm(now + timeout_s)  # or the app has not read the body yet)
        self.guard.timed_out.add()
        if not self._partial:  # not a byte of a request: closed quietly
            transport.close()
            return
        cycle = self.cycle if self._head_done else None
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() says http.disconnect
            cycle.message_event.set()
        previous_busy = not self._head_done and self.cycle is not None \
            and not self.cycle.response_complete  # a pipelined head behind an answer in progress
        if not previous_busy and (cycle is None or not cycle.response_started):
            got = (f"{self._body_bytes} bytes of its body" if cycle is not None
                   else "part of its head")
            transport.write(answer(408, f"expected a request's head and body within "
                                        f"{self.guard.read_timeout_s:g} s, got {got}"))
        transport.close()


class Server(uvicorn.Server):
    """uvicorn's server, whose graceful stop keeps accepting to refuse (503);
    on_drain: a coroutine function run beside that stop (the app's other
    servers draining)."""

    def __init__(self, config: uvicorn.Config, guard: Guard, on_drain=None) -> None:
        super().__init__(config)
        self.guard = guard
        self.on_drain = on_drain

    async def shutdown(self, sockets=None) -> None:
        self.guard.draining = True
        log.info("HTTP worker pid %d draining: new connections are refused (503)", os.getpid())
        servers, self.servers = self.servers, []
        others = [self.on_drain()] if self.on_drain is not None else []
        try:
            await asyncio.gather(super().shutdown(sockets=None), *others)
        finally:
            for server in servers:
                server.close()
            for sock in sockets or []:
                sock.close()


class RateLimit(logging.Filter):
    """At most one record of a kind (its message's first words) per interval;
    the one let through says how many it held back. A failed accept() is one
    line, its traceback dropped."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.kinds: dict = {}  # kind: [next time one passes, held back]

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        kind = text.split("\n", 1)[0].split("(", 1)[0].split("<", 1)[0][:80]
        now = time.monotonic()
        state = self.kinds.setdefault(kind, [0.0, 0])
        if now < state[0]:
            state[1] += 1
            return False
        held, state[:] = state[1], [now + self.interval_s, 0]
        if kind.startswith("socket.accept"):
            error = record.exc_info[1] if record.exc_info else None
            record.msg, record.args = "%s: %s (the worker is out of file descriptors?)", \
                (text.split("\n", 1)[0], error)
            record.exc_info = record.exc_text = None
        if held:
            record.msg, record.args = "%s [%d more like it in the last %g s held back]", \
                (record.getMessage(), held, self.interval_s)
        return True


def quiet_floods() -> None:
    """RateLimit on the loggers a caller can make write per connection."""
    for name in ("asyncio", "uvicorn.error"):
        logging.getLogger(name).addFilter(RateLimit())


def raise_nofile() -> int:
    """The open-file limit raised to its hard limit; the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            log.warning("HTTP worker: cannot raise the open-file limit to %d: %s", hard, e)
    return soft


def max_connections(asked, nofile: int) -> int:
    """The cap: asked (None: the default), kept FD_RESERVE below what the fd
    limit leaves beside the descriptors open now."""
    in_use = len(os.listdir("/proc/self/fd"))
    room = max(1, nofile - in_use - FD_RESERVE)
    if asked is None:
        return min(DEFAULT_MAX_CONNECTIONS, room)
    if asked > room:
        log.warning("HTTP worker pid %d: --http-max-connections %d lowered to %d: the open-file "
                    "limit is %d", os.getpid(), asked, room, nofile)
        return room
    return asked


def raise_oom_score() -> None:
    """This process's oom_score_adj raised OOM_SCORE_RAISE above what it
    inherited (raising needs no privilege): the kernel's OOM killer takes
    an HTTP worker before a batcher or serve."""
    try:
        with open("/proc/self/oom_score_adj", "r+") as f:
            now = int(f.read())
            f.seek(0)
            f.write(str(min(1000, now + OOM_SCORE_RAISE)))
    except (OSError, ValueError) as e:
        log.debug("HTTP worker: oom_score_adj not raised: %s", e)
