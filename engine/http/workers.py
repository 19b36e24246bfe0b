"""The HTTP worker processes of `shmbatch serve --http-port`: uvicorn on one shared socket.

serve binds the listening socket before any engine starts (a port in use
fails the start with nothing created) and starts the workers once its
engines serve. A worker is a fresh interpreter, as a batcher is, running
uvicorn on that socket with engine.http.openinference's app and one Client per
engine: the kernel hands each connection to one worker, and the requests of
every worker batch together in the engines' queues. A worker is ready once
its Clients attached; it dies with serve (parent-death signal), and serve
starts a new one in place of one that died. stop() is uvicorn's graceful
shutdown: no new connection, the requests in progress answered (for at most
the engines' drain timeout), then the worker exits.
"""
import logging
import math
import signal
import socket
import subprocess
import sys
from typing import Dict, List, Optional

from engine import launch

log = logging.getLogger("shmbatch")

START_TIMEOUT_S = 60.0
BACKLOG = 2048


def bind(host: str, port: int) -> socket.socket:
    """The listening socket; OSError naming the address if it cannot listen."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
            flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise OSError(f"--http-host {host}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise OSError(f"--http-port {port}: cannot listen on {host}:{port} "
                      f"({e.strerror or e})") from None
    return sock


class Workers:
    """`count` worker processes serving the engines `configs` ({name: the
    config's JSON}) on `sock`."""

    def __init__(self, sock: socket.socket, count: int, configs: Dict[str, bytes], *,
                 timeout_s: float, max_body_bytes: int, graceful_s: float,
                 log_level: str = "INFO") -> None:
        if count < 1:
            raise ValueError(f"http_workers must be >= 1, got {count}")
        self.sock, self.count = sock, count
        self.graceful_s = graceful_s
        self._args = dict(configs=configs, timeout_s=timeout_s, max_body_bytes=max_body_bytes,
                          graceful_s=max(1, math.ceil(graceful_s)), log_level=log_level.lower(),
                          fd=sock.fileno())
        self.procs: List[Optional[launch.Child]] = [None] * count

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs if p is not None]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Starts every worker; returns once all are ready. RuntimeError (every
        worker stopped) if one is not."""
        launched = []
        try:
            for i in range(self.count):
                launched.append(self._launch())
                self.procs[i] = launched[-1][0]
            for i, (proc, reader) in enumerate(launched):
                _await_ready(i, proc, reader, timeout_s)
        finally:
            for _, reader in launched:
                reader.close()  # each is read once; closing twice is harmless

    def replace_dead(self) -> None:
        """Starts a new worker in place of each one that exited."""
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is None:
                continue
            log.warning("HTTP worker %d (pid %d) exited (code %s); starting another", i,
                        proc.pid, proc.returncode)
            proc.close()
            self.procs[i] = None
            new, reader = self._launch()
            self.procs[i] = new
            try:
                _await_ready(i, new, reader, START_TIMEOUT_S)
            except RuntimeError as e:
                log.error("%s; trying again in a second", e)
            finally:
                reader.close()

    def stop(self) -> None:
        """Graceful shutdown of every worker (SIGTERM); those still running
        after graceful_s + 10 s are killed."""
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

    def _launch(self):
        return launch.launch("engine.http.workers", self._args, pass_fds=(self.sock.fileno(),))


def _await_ready(i: int, proc: launch.Child, reader, timeout_s: float) -> None:
    try:
        launch.await_ready(proc, reader, timeout_s, f"HTTP worker {i}", died="WorkerDied")
    except launch.ChildFailed as e:
        launch.kill(proc)
        raise RuntimeError(f"HTTP worker {i} did not start: {e.kind}: {e.message}") from None


def _entry() -> None:
    """A worker process (engine.launch): uvicorn with the protocol's app on the
    socket serve passed."""
    from engine.shm import liveness
    liveness.die_with_parent()
    args, ready = launch.child_args()
    logging.basicConfig(level=args["log_level"].upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = None
    try:
        import uvicorn

        from engine.config import EngineConfig
        from engine.http import openinference
        # rebuilt from the fd, the socket's protocol is read from it: asyncio sets
        # TCP_NODELAY on accepted connections only when it is IPPROTO_TCP (a
        # socket rebuilt with proto 0 leaves Nagle's algorithm on, and a
        # keep-alive request then waits ~40 ms for the client's delayed ACK)
        sock = socket.socket(fileno=args["fd"])
        configs = {name: EngineConfig.from_json(blob) for name, blob in args["configs"].items()}
        app = openinference.App(configs, args["timeout_s"], args["max_body_bytes"],
                                on_ready=lambda: launch.tell_ready(ready))
        # uvicorn's own lines at INFO (four per worker start and stop) say what
        # serve's one line says already
        level = max(logging.getLevelName(args["log_level"].upper()), logging.WARNING)
        server = uvicorn.Server(uvicorn.Config(
            app, lifespan="on", log_level=level, access_log=False,
            timeout_graceful_shutdown=args["graceful_s"]))
        server.run(sockets=[sock])
    except BaseException as e:
        launch.tell_failed(ready, e)
        raise
    if app is not None and app.startup_error is not None:
        launch.tell_failed(ready, launch.ChildFailed("StartFailed", app.startup_error))
        sys.exit(1)
