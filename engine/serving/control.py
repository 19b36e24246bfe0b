"""The engine's control socket: how `shmbatch reload NAME` reaches a running engine.

An engine runs in whatever process started it (`shmbatch serve`, or a user's
own `Engine(...).start()`), so the Engine itself listens, in one thread, on a
Linux abstract-namespace UNIX stream socket named "\\0shmbatch-control-NAME":
no file is created, and the name goes with the socket when it is closed or
its process dies. An abstract socket has no file permissions, so the server
reads each peer's credentials (SO_PEERCRED) and serves only its own uid.

One request per connection: one JSON line in, one JSON line out; every
socket operation has a timeout, so a stuck peer cannot hold the thread.
The peer must share the engine's network namespace (abstract names live
there).
"""
import json
import logging
import os
import select
import socket
import struct
import threading
import time
import weakref
from typing import Callable, Optional

from engine.errors import EngineUnavailable

log = logging.getLogger("shmbatch")

PREFIX = "\0shmbatch-control-"
MAX_LINE_BYTES = 1 << 16
IO_TIMEOUT_S = 5.0  # the server's bound on reading a request and sending its answer


_servers = weakref.WeakSet()


def _close_in_child() -> None:
    # a forked child has no server thread: holding the listener would keep the
    # name bound, and queue connections nobody accepts, after the engine is gone
    for server in list(_servers):
        server._sock.close()
        for fd in (server._wake_r, server._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


os.register_at_fork(after_in_child=_close_in_child)


def address(name: str) -> str:
    return PREFIX + name


def _read_line(sock: socket.socket, timeout_s: float) -> bytes:
    """One line (without its newline) within timeout_s (TimeoutError); ValueError if too long."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_LINE_BYTES:
            raise ValueError(f"request longer than {MAX_LINE_BYTES} bytes")
    return data.split(b"\n", 1)[0]


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message, default=str).encode() + b"\n")


class Server:
    """Serves handle(request: dict) -> dict on the engine's control socket (or
    on the abstract address `at`), one connection at a time, in a daemon
    thread; close() then join() stop it."""

    def __init__(self, name: str, handle: Callable[[dict], dict], at: Optional[str] = None):
        self.name = name
        self._handle = handle
        self._pid = os.getpid()  # a forked copy has closed its fds: close() and join() skip them
        self._closed = threading.Event()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._sock.bind(at or address(name))  # EADDRINUSE: another engine of this name has it
            self._sock.listen(8)
            self._sock.setblocking(False)
        except OSError:
            self._sock.close()
            raise
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)  # close() wakes the thread
        _servers.add(self)
        self._thread = threading.Thread(target=self._main, daemon=True,
                                        name=f"shmbatch-control-{name}")
        self._thread.start()

    def close(self) -> None:
        """Stops accepting; a request in progress is answered."""
        self._closed.set()
        if self._pid == os.getpid():
            os.write(self._wake_w, b"x")

    def join(self, timeout: float) -> None:
        if self._pid != os.getpid():
            return
        self._thread.join(timeout)
        if not self._thread.is_alive():
            _servers.discard(self)
            self._sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _main(self) -> None:
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._closed.is_set():
            poller.poll()
            if self._closed.is_set():
                break
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                continue  # the peer gave up before we took it
            with conn:
                try:
                    self._serve(conn)
                except (OSError, ValueError) as e:
                    log.warning("engine %s: control request failed: %s", self.name, e)
                except Exception:  # the thread must outlive one bad request
                    log.exception("engine %s: control request failed", self.name)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT_S)
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        if uid != os.getuid():
            log.warning("engine %s: refused a control request from pid %d (uid %d, not %d)",
                        self.name, pid, uid, os.getuid())
            _send(conn, {"ok": False, "error": f"refused: uid {uid} is not the engine's "
                                               f"uid {os.getuid()}"})
            return
        try:
            request = json.loads(_read_line(conn, IO_TIMEOUT_S))
            if not isinstance(request, dict):
                raise ValueError("a request is a JSON object")
        except ValueError as e:
            _send(conn, {"ok": False, "error": f"bad request: {e}"})
            return
        log.info("engine %s: control request from pid %d: %s", self.name, pid, request)
        reply = self._handle(request)
        conn.settimeout(IO_TIMEOUT_S)
        _send(conn, reply)


def request(name: str, message: dict, timeout_s: float, at: Optional[str] = None) -> dict:
    """Sends one request to engine `name`'s control socket (or to the abstract
    address `at`, `name` naming its server) and returns its answer. EngineUnavailable when no engine of that name listens (here, in
    this network namespace); TimeoutError when none comes within timeout_s."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(at or address(name))
        except (ConnectionRefusedError, FileNotFoundError):
            raise EngineUnavailable(f"no engine named {name!r} answers (none running, or not "
                                    f"in this network namespace)") from None
        try:
            try:
                _send(sock, message)
            except (BrokenPipeError, ConnectionResetError):
                pass  # answered (a refusal) and closed before reading: the answer is here
            line = _read_line(sock, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"engine {name!r} did not answer within {timeout_s:g} s") from None
        if not line:
            raise EngineUnavailable(f"engine {name!r} closed the connection without an answer "
                                    f"(stopping?)")
        return json.loads(line)
