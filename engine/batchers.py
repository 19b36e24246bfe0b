"""The batcher processes as the supervisor sees them: handles, launch, readiness.

A batcher is a fresh interpreter (`python -c "from engine.batcher import
_entry; _entry()"`, so the user's __main__ is never re-run) that reads
sys.path and its arguments, pickled, from stdin and answers once on a pipe:
"ready" once its backend factory ran, or ("error", type, message,
traceback). The loop it then runs is engine.batcher.Batcher; this module
never imports it (the child does).
"""
import dataclasses
import logging
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
from typing import Optional

from engine.errors import BackendError

log = logging.getLogger("shmbatch")


@dataclasses.dataclass
class Instance:
    """One of the engine's instances: its batcher number in the ring `index`
    (position + instances * bank, the bank flipping on each reload), its
    `position` (which cpus/gpus entry it takes), its batcher process (None
    between a death and the restart) and its restart state."""
    index: int
    position: int
    proc: Optional["BatcherProcess"] = None
    restart_at_ns: int = 0  # no restart before this (backoff after failed starts)
    backoff_s: float = 0.0
    hung: bool = False  # killed by the watchdog (batch_timeout_s), not crashed
    # a dead batcher's batch kept for its successor, and the engine's retry
    # count then: a successor that dies before it retries anything has not helped
    kept: int = 0
    retried_at_keep: int = 0
    futile_restarts: int = 0


def reap_terms(b: Instance, pid: int, why: str, retried_total: int, isolate: bool):
    """(message, retry) for reaping b's dead batcher (ring.reap_batcher).
    With isolate (isolate_failures, on an engine whose answers do not
    overwrite its inputs) its batch is kept for the successor to retry, each
    request alone (one then being retried alone fails, as poison), unless the
    last two successors died before they retried anything (retried_total,
    the engine's count, did not move: a batcher that dies on start); then the
    batch fails."""
    futile = b.kept and retried_total == b.retried_at_keep
    b.futile_restarts = b.futile_restarts + 1 if futile else 0
    head = f"batcher {b.index} (pid {pid}) died ({why})"
    if not isolate:
        return f"{head} while serving this request".encode(), False
    if b.futile_restarts >= 2:
        return (f"{head}; its batch was kept for a retry, but {b.futile_restarts} successors "
                f"died before retrying it: failed").encode(), False
    return (f"{head} while retrying this request alone, after its batch had lost a "
            f"batcher: failed as poison").encode(), True


class BatcherProcess(subprocess.Popen):
    """The handle of a batcher process (the loop it runs is batcher.Batcher),
    with the few multiprocessing.Process names used here."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sentinel = os.pidfd_open(self.pid)  # readable once the process exits

    def is_alive(self) -> bool:
        return self.poll() is None

    @property
    def exitcode(self):
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


def kill(proc: BatcherProcess) -> None:
    """SIGKILL, reaped (within 10 s) and its handle closed."""
    proc.kill()
    proc.join(10)
    proc.close()


def launch(engine: str, b: Instance, backend, backend_args: dict, cpus, gpu, epoch: int):
    """Starts b's batcher process for engine `engine`, with this backend, its
    CPU affinity and GPU, waiting for `epoch`; returns (process, the reader
    of its readiness pipe). BackendError if the backend cannot be pickled."""
    read_fd, write_fd = os.pipe()
    reader = multiprocessing.connection.Connection(read_fd, writable=False)
    proc = None
    try:
        args = dict(name=engine, instance=b.index, backend=backend, backend_args=backend_args,
                    cpus=cpus, gpu=gpu, ready_fd=write_fd, epoch=epoch)
        try:
            payload = pickle.dumps(list(sys.path)) + pickle.dumps(args)
        except Exception as e:
            raise BackendError(type(e).__name__, f"cannot pass the backend to a "
                               f"batcher process: {e}") from None
        proc = BatcherProcess([sys.executable, "-c",
                               "from engine.batcher import _entry; _entry()"],
                              stdin=subprocess.PIPE, pass_fds=(write_fd,),
                              # its own process group: a terminal's Ctrl-C reaches the
                              # supervisor alone, which drains, then stops the batchers
                              process_group=0)
        os.close(write_fd)
        write_fd = None
        try:
            proc.stdin.write(payload)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: the recv says so
        return proc, reader
    except BaseException:
        reader.close()
        if proc is not None:
            kill(proc)
        raise
    finally:
        if write_fd is not None:
            os.close(write_fd)


def await_ready(engine: str, b: Instance, proc: BatcherProcess, reader) -> None:
    """Reads the readiness message (there is one, or EOF); BackendError unless ready."""
    try:
        msg = reader.recv()
    except EOFError:
        proc.join(10)
        msg = ("error", "BatcherDied", f"batcher {b.index} exited during start "
               f"(exit code {proc.exitcode})", "")
    if msg[0] != "ready":
        log.error("engine %s: batcher %d failed to start: %s: %s", engine, b.index,
                  msg[1], msg[2])
        log.debug("batcher %d traceback:\n%s", b.index, msg[3])
        raise BackendError(msg[1], msg[2])


def start(engine: str, b: Instance, backend, backend_args: dict, cpus, gpu, epoch: int,
          timeout_s: float) -> BatcherProcess:
    """Starts b's batcher (as launch()) and waits until it serves (or its factory
    fails); BackendError, with the process killed, unless ready within timeout_s."""
    proc, reader = launch(engine, b, backend, backend_args, cpus, gpu, epoch)
    try:
        if not reader.poll(timeout_s):
            raise BackendError("StartTimeout", f"batcher {b.index} not ready within "
                               f"{timeout_s} s")
        await_ready(engine, b, proc, reader)
        return proc
    except BaseException:
        kill(proc)
        raise
    finally:
        reader.close()
