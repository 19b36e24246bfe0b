"""The batcher processes as the supervisor sees them: handles, launch, readiness.

A batcher is a fresh interpreter (`python -c "from engine.batcher import
_entry; _entry()"`, so the user's __main__ is never re-run) that reads
sys.path and its arguments, pickled, from stdin and answers once on a pipe:
"ready" once its backend factory ran, or ("error", type, message,
traceback). The loop it then runs is engine.batcher.Batcher; this module
never imports it (the child does).
"""
import logging
import multiprocessing.connection
import os
import pickle
import subprocess
import sys

from engine.errors import BackendError
from engine.restarts import Instance

log = logging.getLogger("shmbatch")


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


# The thread pools of the numeric libraries a backend may use (OpenMP: torch and
# others; OpenBLAS and MKL: numpy), sized once, when they load.
THREAD_POOLS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def batcher_env(cpus) -> dict:
    """A batcher's environment: ours, and with a CPU affinity its numeric
    libraries' thread pools sized to those CPUs (unless set already): a pool
    sized to the machine's cores, pinned to fewer, spins its threads against
    each other (a decoder's 5 ms step took 30 ms so, pinned to one CPU)."""
    env = dict(os.environ)
    if cpus:
        for var in THREAD_POOLS:
            env.setdefault(var, str(len(cpus)))
    return env


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
                              env=batcher_env(cpus),
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
