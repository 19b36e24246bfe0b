"""Child processes: start, ready handshake, failure report.

Batchers and HTTP workers start the same way. A child is a fresh interpreter
that runs MODULE._entry(), so the user's __main__ is never re-run. The parent
pipes it sys.path and its arguments, pickled, on stdin, and passes the write
end of a readiness pipe (its fd the child's one command-line argument); the
child answers once on that pipe: ("ready",) once it serves, or ("ready", info)
where it says something of itself (the handle's ready_info), or ("error", type,
message, traceback). Each child runs in its own process group: a terminal's Ctrl-C
reaches the parent alone, which stops the children in its own order.
"""
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
import traceback
from typing import Any, Optional, Sequence, Tuple

from engine import logfmt

READY = ("ready",)
# how long a helper child (an HTTP worker, a parser process) may take to say it is ready
START_TIMEOUT_S = 60.0


class ChildFailed(Exception):
    """A child that did not become ready: its error's type name, message and traceback."""

    def __init__(self, kind: str, message: str, trace: str = ""):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message, self.trace = kind, message, trace


class Child(subprocess.Popen):
    """A child's handle, with the few multiprocessing.Process names its users need."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sentinel: Optional[int] = os.pidfd_open(self.pid)  # readable once it exits
        self.ready_info: Any = None  # what the child said of itself when ready

    def is_alive(self) -> bool:
        return self.poll() is None

    @property
    def exitcode(self) -> Optional[int]:
        return self.poll()

    def join(self, timeout: float) -> None:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


def kill(proc: Child) -> None:
    """SIGKILL, reaped (within 10 s) and its handle closed."""
    proc.kill()
    proc.join(10)
    proc.close()


def launch(module: str, args: dict, *, pass_fds: Sequence[int] = (),
           env: Optional[dict] = None) -> Tuple[Child, multiprocessing.connection.Connection]:
    """Starts `module`'s _entry() with `args`; returns (process, the reader of
    its readiness pipe). ChildFailed, before any process starts, if `args`
    cannot be pickled."""
    try:
        payload = pickle.dumps(list(sys.path)) + pickle.dumps(args)
    except Exception as e:
        raise ChildFailed(type(e).__name__, str(e)) from None
    read_fd, write_fd = os.pipe()
    reader = multiprocessing.connection.Connection(read_fd, writable=False)
    proc = None
    try:
        # sys.path first: the entry's own module may be one only the parent's path finds
        command = (f"import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
                   f"from {module} import _entry; _entry()")
        proc = Child([sys.executable, "-c", command, str(write_fd), str(os.getpid())],
                     stdin=subprocess.PIPE,
                     pass_fds=(write_fd, *pass_fds), env=env, process_group=0)
        os.close(write_fd)
        write_fd = None
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: the readiness wait says so
        return proc, reader
    except BaseException:
        reader.close()
        if proc is not None:
            kill(proc)
        raise
    finally:
        if write_fd is not None:
            os.close(write_fd)


def await_ready(proc: Child, reader, timeout_s: Optional[float], what: str, died: str) -> None:
    """Reads the child's one message; ChildFailed unless it is ready within
    timeout_s (None: as long as it lives), of kind `died` if it exited first.
    The reader stays open."""
    if timeout_s is not None and not reader.poll(timeout_s):
        raise ChildFailed("StartTimeout", f"{what} not ready within {timeout_s:g} s")
    try:
        msg = reader.recv()
    except EOFError:
        proc.join(10)
        raise ChildFailed(died, f"{what} exited during start "
                          f"(exit code {proc.exitcode})") from None
    if msg[:1] != READY:
        raise ChildFailed(*msg[1:4])
    proc.ready_info = msg[1] if len(msg) > 1 else None


def child_args() -> Tuple[dict, multiprocessing.connection.Connection]:
    """In the child: (its arguments, the readiness pipe's writer), as the
    parent's launch() passed them (sys.path is set already); its log set up
    as its parent's serve chose (engine.logfmt)."""
    logfmt.from_environment()
    args = pickle.load(sys.stdin.buffer)
    return args, multiprocessing.connection.Connection(int(sys.argv[1]), readable=False)


def parent_pid() -> int:
    """In the child: the pid of the process that launched it, which an
    orphan's os.getppid() no longer is."""
    return int(sys.argv[2])


def tell_ready(conn, info: Any = None) -> None:
    """Ready; `info` (picklable) reaches the parent as the handle's ready_info."""
    _tell(conn, READY if info is None else (*READY, info))


def tell_failed(conn, e: BaseException) -> None:
    if isinstance(e, ChildFailed):
        _tell(conn, ("error", e.kind, e.message, e.trace))
    else:
        _tell(conn, ("error", type(e).__name__, str(e), traceback.format_exc()))


def _tell(conn, msg) -> None:
    try:
        conn.send(msg)
    except OSError:
        pass  # the parent is gone, or stopped waiting
