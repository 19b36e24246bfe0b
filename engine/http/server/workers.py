"""The HTTP worker processes of `shmbatch serve --http-port`: uvicorn on one shared socket.

serve binds the listening socket before any engine starts (a port in use
fails the start with nothing created) and starts the workers once its
engines serve. A worker is a fresh interpreter, as a batcher is, running
uvicorn on that socket with the front and one Client per engine
(engine.http.worker, each worker's entry): the kernel hands each
connection to one worker, and the requests of every worker batch together
in the engines' queues. Its arguments (the API key among them) travel on
its stdin, never on its command line. Every worker also inherits one small
anonymous file (a memfd, made here, gone with the last process holding
it) where the protocol keeps what must hold across workers: the system
shared-memory regions registered (engine.http.oip.regions). A worker is ready once
its Clients attached; it dies with serve (parent-death signal). serve's
loop calls watch() every second, which never waits: a worker that died is
replaced at once, and one that fails to start (or dies within STABLE_S of
its start) is tried again after 1, 2, 4 ... at most 10 s. stop() is
uvicorn's graceful shutdown: new connections refused (503), the requests in
progress answered (for at most the engines' drain timeout), then the worker
exits. A worker raises its open-file limit to the hard limit and its
oom_score_adj by 500, and holds its connections to a read timeout and a
cap (engine.http.server.connections).
"""
import logging
import math
import os
import signal
import socket
import subprocess
import time
from multiprocessing.connection import Connection
from typing import Any, Dict, List, Optional, Tuple

from engine import launch

log = logging.getLogger("shmbatch")

BACKLOG = 2048
FIRST_RETRY_S = 1.0  # a failed start's delay, doubled at each failure in a row
MAX_RETRY_S = 10.0
STABLE_S = 10.0  # a worker that served this long, then died, is replaced at once


def _socket(host: str, port: int, flag: str) -> Tuple[socket.socket, Any]:
    """A TCP socket for host:port and the address to bind; OSError naming --FLAG-host."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
            flags=socket.AI_PASSIVE)[0]
        return socket.socket(family, kind, proto), address
    except OSError as e:
        raise OSError(f"--{flag}-host {host}: {e.strerror or e}") from None


def _bound(host: str, port: int, flag: str, option: int, backlog: Optional[int]):
    """The socket bound to host:port with this SO_ option (listening with a
    backlog, if given); OSError naming --FLAG-port if it cannot."""
    sock, address = _socket(host, port, flag)
    try:
        sock.setsockopt(socket.SOL_SOCKET, option, 1)
        sock.bind(address)
        if backlog is not None:
            sock.listen(backlog)
    except OSError as e:
        sock.close()
        raise OSError(f"--{flag}-port {port}: cannot listen on {host}:{port} "
                      f"({e.strerror or e})") from None
    return sock


def bind(host: str, port: int) -> socket.socket:
    """The listening socket; OSError naming the address if it cannot listen."""
    return _bound(host, port, "http", socket.SO_REUSEADDR, BACKLOG)


def reserve(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT, never listening: it holds
    the port for the workers' gRPC servers (bound there with SO_REUSEPORT too;
    the kernel lets only the same user's sockets join) from before any engine
    starts, and says which port 0 chose. OSError naming the address if taken."""
    return _bound(host, port, "grpc", socket.SO_REUSEPORT, None)


class Workers:
    """`count` worker processes serving the engines `configs` ({name: the
    config's JSON}) on `sock`; with catalog_fd (engine.serving.catalog) and
    control_at (serve's control address), the engines serve's catalog holds
    now, loaded and unloaded through serve; with grpc_at (host, port: serve's
    reserve()d), each worker also serves gRPC there."""

    def __init__(self, sock: socket.socket, count: int, configs: Dict[str, bytes], *,
                 timeout_s: float, max_body_bytes: Optional[int], graceful_s: float,
                 read_timeout_s: float, max_connections: Optional[int] = None,
                 log_level: str = "INFO", openai: Optional[Dict[str, dict]] = None,
                 api_key: Optional[str] = None, catalog_fd: Optional[int] = None,
                 control_at: Optional[str] = None,
                 grpc_at: Optional[Tuple[str, int]] = None) -> None:
        if count < 1:
            raise ValueError(f"http_workers must be >= 1, got {count}")
        self.sock, self.count = sock, count
        self.graceful_s = graceful_s
        shared = os.memfd_create("shmbatch-http-shared", os.MFD_CLOEXEC)
        self.shared_fd: Optional[int] = shared
        self._args = dict(configs=configs, timeout_s=timeout_s, max_body_bytes=max_body_bytes,
                          graceful_s=max(1, math.ceil(graceful_s)), log_level=log_level.lower(),
                          fd=sock.fileno(), read_timeout_s=read_timeout_s,
                          max_connections=max_connections, openai=openai, api_key=api_key,
                          catalog_fd=catalog_fd, control_at=control_at,
                          regions_fd=shared, grpc_at=grpc_at)
        # --model-control explicit: the engines' catalog, read by each worker
        self._fds = (sock.fileno(), shared) + (() if catalog_fd is None else (catalog_fd,))
        self.procs: List[Optional[launch.Child]] = [None] * count
        # each slot's replacement not ready yet (its readiness pipe, its deadline),
        # when it became ready, no new start before, the next failure's delay
        self._starting: List[Optional[Tuple[Connection, float]]] = [None] * count
        self._ready_at = [0.0] * count
        self._retry_at = [0.0] * count
        self._backoff = [0.0] * count

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs if p is not None]

    def start(self, timeout_s: float = launch.START_TIMEOUT_S) -> None:
        """Starts every worker; returns once all are ready. RuntimeError (every
        worker stopped) if one is not."""
        launched = []
        try:
            for i in range(self.count):
                launched.append(self._launch())
                self.procs[i] = launched[-1][0]
            for i, (proc, reader) in enumerate(launched):
                _await_ready(i, proc, reader, timeout_s)
                self._ready_at[i] = time.monotonic()
        finally:
            for _, reader in launched:
                reader.close()  # each is read once; closing twice is harmless

    def watch(self) -> None:
        """One step, which never waits: a new worker in place of each one that
        exited, a replacement's readiness read if it came, a failed one retried
        once its delay is past."""
        now = time.monotonic()
        for i in range(self.count):
            starting = self._starting[i]
            if starting is not None:
                self._check_start(i, now, starting)
                continue
            proc = self.procs[i]
            if proc is not None and proc.poll() is not None:
                ran = now - self._ready_at[i]
                if ran >= STABLE_S:
                    self._backoff[i] = 0.0
                else:  # it died soon after it started: as a failed start
                    self._retry_at[i] = now + self._next_delay(i)
                later = self._retry_at[i] - now
                log.warning("HTTP worker %d (pid %d) exited (code %s) %.1f s after it started; "
                            "starting another%s", i, proc.pid, proc.returncode, ran,
                            f" in {later:g} s" if later > 0 else "")
                proc.close()
                self.procs[i] = None
            if self.procs[i] is None and now >= self._retry_at[i]:
                proc, reader = self._launch()
                self.procs[i], self._starting[i] = proc, (reader, now + launch.START_TIMEOUT_S)

    def _check_start(self, i: int, now: float, starting: Tuple[Connection, float]) -> None:
        reader, deadline = starting
        proc = self.procs[i]
        assert proc is not None  # a start in progress has its process
        if reader.poll(0):
            try:
                msg = reader.recv()
            except EOFError:
                msg = None
            if msg == launch.READY:
                reader.close()
                self._starting[i], self._ready_at[i] = None, now
                log.info("HTTP worker %d started again (pid %d)", i, proc.pid)
                return
            why = f"{msg[1]}: {msg[2]}" if msg else "it exited during start"
        elif proc.poll() is not None:
            why = f"it exited during start (code {proc.returncode})"
        elif now >= deadline:
            why = f"not ready within {launch.START_TIMEOUT_S:g} s"
        else:
            return
        reader.close()
        launch.kill(proc)
        self._starting[i], self.procs[i] = None, None
        delay = self._next_delay(i)
        self._retry_at[i] = now + delay
        log.error("HTTP worker %d did not start: %s; trying again in %g s", i, why, delay)

    def _next_delay(self, i: int) -> float:
        self._backoff[i] = min(MAX_RETRY_S, max(FIRST_RETRY_S, 2 * self._backoff[i]))
        return self._backoff[i]

    def stop(self) -> None:
        """Graceful shutdown of every worker (SIGTERM); those still running
        after graceful_s + 10 s are killed."""
        for i, starting in enumerate(self._starting):
            if starting is not None:
                starting[0].close()
                self._starting[i] = None
        procs = [p for p in self.procs if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(self.graceful_s + 10)
            except subprocess.TimeoutExpired:
                log.warning("HTTP worker pid %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait(10)
            proc.close()
        self.procs = [None] * self.count
        if self.shared_fd is not None:
            os.close(self.shared_fd)
            self.shared_fd = None

    def _launch(self):
        assert self.shared_fd is not None  # no worker starts after stop()
        return launch.launch("engine.http.worker", self._args, pass_fds=self._fds)


def _await_ready(i: int, proc: launch.Child, reader, timeout_s: float) -> None:
    try:
        launch.await_ready(proc, reader, timeout_s, f"HTTP worker {i}", died="WorkerDied")
    except launch.ChildFailed as e:
        launch.kill(proc)
        raise RuntimeError(f"HTTP worker {i} did not start: {e.kind}: {e.message}") from None
