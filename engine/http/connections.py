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

A refused connection is half-closed after its answer and read (discarded)
for at most LINGER_S before it closes, so a caller still sending its
request reads the answer rather than a reset. And the worker's logs stay
bounded: asyncio logs every failed accept() (a worker out of descriptors)
with its traceback, up to the backlog's 2048 times a second; RateLimit lets
one line of a kind through per interval, saying how many it held back.
"""
import json
import logging
import os
import resource
import time

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

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


class Front:
    """What the connections of one worker share."""

    def __init__(self, read_timeout_s: float, max_connections: int) -> None:
        self.read_timeout_s, self.max_connections = read_timeout_s, max_connections
        self.draining = False
        self.lingering = 0
        self.refused = Tally(f"connections refused (503): {max_connections} open already "
                             f"(--http-max-connections)")
        self.timed_out = Tally(f"connections closed: no complete request within "
                               f"{read_timeout_s:g} s (--http-read-timeout-s)", logging.INFO)


def protocol(front: Front) -> type:
    """The protocol class for uvicorn.Config(http=...), its connections sharing front."""
    return type("GuardedProtocol", (GuardedProtocol,), {"front": front})


def answer(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 response: {"error": message}, then the connection closes."""
    body = json.dumps({"error": message}).encode()
    return (STATUS_LINE[status] + b"content-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class GuardedProtocol(HttpToolsProtocol):
    """One connection: refused at once when the worker drains or is at its
    cap, else served by uvicorn under the read timeout."""

    front: Front

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = None  # the read timeout's timer
        self._partial = False  # a request has begun and is not whole yet
        self._head_done = False  # ... and its head has come
        self._body_bytes = 0  # ... and this much of its body
        self._refused = False
        self._linger = None  # a refused connection's closing timer
        self._discarded = 0

    # -- a connection refused at once ------------------------------------------
    def connection_made(self, transport) -> None:  # type: ignore[override]
        front = self.front
        if front.draining:
            return self._refuse(transport, "the server is shutting down (draining its "
                                           "requests in progress): expected no new request")
        if len(self.connections) >= front.max_connections:
            front.refused.add()
            return self._refuse(transport, f"expected at most {front.max_connections} open "
                                           f"connections to this worker, got one more: try "
                                           f"again, or reuse a connection")
        super().connection_made(transport)
        self._arm()

    def _refuse(self, transport, message: str) -> None:
        self._refused, self.transport = True, transport
        transport.write(answer(503, message))
        if self.front.lingering >= MAX_LINGERING:
            transport.close()
            return
        self.front.lingering += 1
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
            self.front.lingering -= 1
        if self._refused:
            return
        super().connection_lost(exc)

    # -- the read timeout -------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._partial, self._head_done, self._body_bytes = True, False, 0
        if self._deadline is None:  # the first request's runs from the connection's opening
            self._arm()

    def on_headers_complete(self) -> None:
        self._head_done = True
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._partial = False
        self._disarm()
        super().on_message_complete()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.front.read_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        transport = self.transport
        if transport.is_closing():
            return
        if self.flow.read_paused:  # this server stopped reading (a pipelined request
            self._arm()  # waits, or the app has not read the body yet): not the caller's delay
            return
        self.front.timed_out.add()
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
                                        f"{self.front.read_timeout_s:g} s, got {got}"))
        transport.close()


class Server(uvicorn.Server):
    """uvicorn's server, whose graceful stop keeps accepting to refuse (503)."""

    def __init__(self, config: uvicorn.Config, front: Front) -> None:
        super().__init__(config)
        self.front = front

    async def shutdown(self, sockets=None) -> None:
        self.front.draining = True
        log.info("HTTP worker pid %d draining: new connections are refused (503)", os.getpid())
        servers, self.servers = self.servers, []
        try:
            await super().shutdown(sockets=None)
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
