"""The batcher processes as the supervisor sees them: start, readiness, environment.

A batcher is a child started by engine.launch, ready once its backend factory
ran. The loop it then runs is engine.batching's; this module never imports it
(the child does). Its readiness pipe stays open while it serves: an exception
that ends its loop is reported there before it dies (reported()).
"""
import logging
import multiprocessing.connection
import os
import time
from typing import Callable, Optional, Tuple

from engine import launch, logfmt
from engine.errors import BackendError

log = logging.getLogger("shmbatch")


BatcherProcess = launch.Child  # the handle of a batcher process
kill = launch.kill


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


def spawn(engine: str, index: int, backend, backend_args: dict, cpus, gpu, epoch: int):
    """Starts batcher `index` of engine `engine`, with this backend, its CPU
    affinity and GPU, waiting for `epoch`; returns (process, the reader of its
    readiness pipe). BackendError if the backend cannot be pickled."""
    args = dict(name=engine, instance=index, backend=backend, backend_args=backend_args,
                cpus=cpus, gpu=gpu, epoch=epoch)
    try:
        # a batcher serves one engine: each of its log lines is about it
        env = {**batcher_env(cpus), logfmt.ENGINE_VAR: engine}
        return launch.launch("engine.batching.batcher", args, env=env)
    except launch.ChildFailed as e:
        raise BackendError(e.kind, f"cannot pass the backend to a batcher process: "
                           f"{e.message}") from None


def await_ready(engine: str, index: int, proc: BatcherProcess, reader,
                timeout_s: Optional[float] = None,
                waiting: Optional[Callable[[], float]] = None) -> None:
    """Waits for the readiness message; BackendError unless ready. waiting(),
    if given, is called as the wait begins and again after each of the
    seconds it returns."""
    if waiting is not None and timeout_s is not None:
        end_s = time.monotonic() + timeout_s
        while (left_s := end_s - time.monotonic()) > 0 and not reader.poll(
                min(left_s, waiting())):
            pass
        timeout_s = max(0.0, end_s - time.monotonic())
    try:
        launch.await_ready(proc, reader, timeout_s, f"batcher {index}", died="BatcherDied")
    except launch.ChildFailed as e:
        log.error("engine %s: batcher %d failed to start: %s: %s", engine, index, e.kind,
                  e.message)
        log.debug("batcher %d traceback:\n%s", index, e.trace)
        raise BackendError(e.kind, e.message) from None


def start(engine: str, index: int, backend, backend_args: dict, cpus, gpu, epoch: int,
          timeout_s: float, waiting: Optional[Callable[[], float]] = None
          ) -> Tuple[BatcherProcess, multiprocessing.connection.Connection]:
    """Starts batcher `index` (as spawn()) and waits until it serves (or its
    factory fails): (process, its pipe, for reported()). BackendError, with the
    process killed, unless ready within timeout_s."""
    proc, reader = spawn(engine, index, backend, backend_args, cpus, gpu, epoch)
    try:
        await_ready(engine, index, proc, reader, timeout_s, waiting)
        return proc, reader
    except BaseException:
        kill(proc)
        reader.close()
        raise


def reported(reader) -> Optional[str]:
    """What a dead batcher reported on its pipe before it died ("raised
    TYPE: message"), or None (it said nothing: a signal, os._exit; or no pipe)."""
    if reader is None:
        return None
    try:
        if not reader.poll(0):
            return None
        msg = reader.recv()
    except (EOFError, OSError):
        return None
    if not (isinstance(msg, tuple) and len(msg) == 4 and msg[0] == "error"):
        return None
    log.debug("the batcher's traceback:\n%s", msg[3])
    return f"raised {msg[1]}: {msg[2]}"


def thread_pools(instances) -> list:
    """The thread pools of each instance's live batcher, as it reported them
    once its model loaded (engine.batching.threads.report), with its batcher
    number and pid."""
    pools = []
    for b in list(instances):  # the monitor thread may replace the list meanwhile
        proc = b.proc
        if proc is not None and proc.ready_info is not None:
            pools.append({"batcher": b.index, "pid": proc.pid, **proc.ready_info})
    return pools


def figures(instances) -> dict:
    """stats()'s figures of the live batchers: their thread pools ("threads",
    as thread_pools()) and "warmup_ms", the slowest one's warmup (warmup=True;
    None without; each batcher's own is in its "threads" entry). The start
    waited for their sum: batchers start one after another."""
    pools = thread_pools(instances)
    return {"threads": pools, "warmup_ms": slowest_warmup_ms(pools)}


def slowest_warmup_ms(pools) -> Optional[float]:
    """The slowest batcher's warmup among thread_pools()' entries (as stats()
    and `shmbatch status --json` give it), or None: none warmed up."""
    warmed = [p["warmup_ms"] for p in pools if p.get("warmup_ms") is not None]
    return max(warmed) if warmed else None
