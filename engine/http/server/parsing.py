"""Request bodies parsed off the HTTP worker's event loop.

A body whose JSON is at most INLINE_BYTES is parsed on the loop (it takes
well under a millisecond); up to PROCESS_BYTES, in a thread; a larger one in
the worker's parser process. What parses it is the protocol's: a function
of the body (a module's own, so that it pickles by name) that returns the
request read or raises BadRequest. json.loads holds the GIL for as long as it
parses (about 0.1 s a MiB of numbers, seconds for the largest bodies), so a
thread would not free the loop from it: the parser process parses and
converts the body and sends back the arrays, while the worker's loop serves
its other requests. It is one child of the worker (engine.launch, as a
batcher is), started at the first such body, parsing one body at a time; it
dies with the worker, and a parser that died (a body too large for memory)
fails its request with a 500 and is started again at the next.
"""
import asyncio
import socket
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional, cast

from engine import launch
from engine.http.errors import BadRequest

INLINE_BYTES = 8 << 10
PROCESS_BYTES = 1 << 20


class ParseFailed(Exception):
    """The parser process failed a body other than as a bad request: it
    died (a body too large for memory) or raised. The worker answers 500."""


class Parser:
    """parse(): a body read by a protocol's function, where its size says."""

    def __init__(self) -> None:
        self._proc: Optional[launch.Child] = None
        self._conn: Optional[Connection] = None
        self._lock: Optional[asyncio.Lock] = None

    async def parse(self, size: int, read: Callable[..., Any], body: bytes, *args: Any) -> Any:
        """read(body, *args), wherever a body of `size` bytes to parse is parsed."""
        if size <= INLINE_BYTES:
            return read(body, *args)
        if size <= PROCESS_BYTES:
            return await asyncio.to_thread(read, body, *args)
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one body at a time
            if self._proc is None or self._proc.poll() is not None:
                await self._start()
            try:
                reply = await asyncio.to_thread(_ask, cast(Connection, self._conn), body,
                                                (read, args))
            except (EOFError, OSError) as e:
                self.close()
                raise ParseFailed(f"the parser process exited while it parsed a body of "
                                  f"{len(body)} B ({type(e).__name__})") from None
            except BaseException:  # cancelled: the conversation is cut, the process
                self.close()  # ends (its thread then reads EOF) and the next starts anew
                raise
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "bad":
            raise BadRequest(reply[1], reply[2])
        raise ParseFailed(f"the parser process failed a body of {len(body)} B: {reply[1]}")

    async def _start(self) -> None:
        self.close()
        ours, theirs = socket.socketpair()
        try:
            # launched from the loop's thread: the child dies with it (parent-death signal)
            proc, reader = launch.launch("engine.http.server.parsing", {"fd": theirs.fileno()},
                                         pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        try:
            await asyncio.to_thread(launch.await_ready, proc, reader, launch.START_TIMEOUT_S,
                                    "the parser process", "ParserDied")
        except launch.ChildFailed as e:
            launch.kill(proc)
            ours.close()
            raise ParseFailed(f"the parser process did not start: {e}") from None
        except BaseException:
            launch.kill(proc)
            ours.close()
            raise
        finally:
            reader.close()
        self._proc, self._conn = proc, Connection(ours.detach())

    def close(self) -> None:
        """Ends the process (closing its pipe ends it; killed if it parses on)."""
        conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        if conn is not None:
            conn.close()
        if proc is not None:
            try:
                proc.wait(0.5)
            except Exception:
                pass
            if proc.poll() is None:
                launch.kill(proc)
            else:
                proc.close()


def _ask(conn: Connection, body: bytes, args: tuple):
    conn.send_bytes(body)
    conn.send(args)
    return conn.recv()


def _entry() -> None:
    """The parser process (engine.launch): parses each body it is sent,
    until its pipe closes."""
    from engine.shm import liveness
    liveness.die_with_parent(launch.parent_pid())
    args, ready = launch.child_args()
    conn = Connection(args["fd"])
    launch.tell_ready(ready)
    ready.close()
    while True:
        try:
            body = conn.recv_bytes()
            read, args = conn.recv()
        except (EOFError, OSError):
            return
        reply: tuple
        try:
            reply = ("ok", read(body, *args))
        except BadRequest as e:
            reply = ("bad", str(e), e.status)
        except Exception as e:  # MemoryError included: ParseFailed, a 500
            reply = ("error", f"{type(e).__name__}: {e}")
        del body
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("engine.http.server.parsing runs as the HTTP worker's child (engine.launch)")
