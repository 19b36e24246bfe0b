"""A reload's state machine: new batchers take over the ring from the old ones.

Engine.reload() starts new batchers (new backend args or weights, or a new
backend) beside the old ones and hands the ring over by the header's epoch
word. The new batchers start with epoch E+2 and wait; once every one of them
is ready the word goes to E+1. A one-shot engine's old batchers (epoch E)
finish their batch and exit, and when they are gone the word goes to E+2 and
the new ones serve: no overlap, every request the old weights answer is
claimed before any the new ones answer, and requests queue meanwhile. An
iterative engine's reload overlaps: from E+1 the new batchers join new
requests while the old ones finish their running streams and exit. The old
and new batchers of a reload hold different batcher numbers (two banks of
`instances`, flipping each reload, so reload needs instances <= 16).

The engine's monitor thread runs a Reload (it spawns every batcher: they die
with it), step by step between its other duties, and moves the epoch word
itself; a Reload launches, checks and retires batchers and answers the
caller. A reload whose new batchers fail to start kills them and leaves the
old ones serving.
"""
import dataclasses
import logging
import threading
from typing import Any, Callable, Optional

from engine.errors import BackendError, EngineError, EngineUnavailable
from engine.serving import processes, restarts
from engine.serving.restarts import Instance
from engine.shm import codes, ring

log = logging.getLogger("shmbatch")


def options_for(current, instances: int, backend, backend_args: Optional[dict],
                merge: bool):
    """The EngineOptions a reload runs with: `backend` (None: the current one)
    and `backend_args` (None: the current ones; else they replace them, or
    with merge are merged over them). ValueError for a malformed spec or more
    instances than two banks of batcher numbers hold."""
    limit = codes.MAX_INSTANCES // 2
    if instances > limit:
        raise ValueError(f"reload needs instances <= {limit} (the new batchers start beside "
                         f"the old ones, and the ring numbers at most {codes.MAX_INSTANCES} "
                         f"batchers); this engine has {instances}")
    if backend_args is not None and not isinstance(backend_args, dict):
        raise ValueError(f"backend_args must be a dict, got {type(backend_args).__name__}")
    args = current.backend_args
    if backend_args is not None:
        args = {**args, **backend_args} if merge else backend_args
    return dataclasses.replace(  # checks the spec (ValueError), copies the args
        current, backend=current.backend if backend is None else backend, backend_args=args)


def retire_bound_s(options, iterative: bool = False) -> float:
    """How long a retiring batcher may take to finish its batch (an iterative
    engine's: its running streams) before it is killed."""
    if iterative:
        return options.drain_timeout_s
    return min(t for t in (options.drain_timeout_s, options.batch_timeout_s) if t is not None)


def control_request(request: dict, reload_with: Callable[..., dict],
                    thread_pools: Callable[[], list]) -> dict:
    """One request of the control socket (engine.serving.control), as `shmbatch reload`
    sends it: {"op": "reload", "backend": None or "MOD:FACTORY", "backend_args":
    {...} merged over the current args}; reload_with(backend, args, merge) runs it.
    Or as `shmbatch status` sends it: {"op": "threads"}, answered thread_pools()."""
    if request.get("op") == "threads":
        return {"ok": True, "threads": thread_pools()}
    if request.get("op") != "reload":
        return {"ok": False, "error": f"unknown op {request.get('op')!r} (expected 'reload' "
                                      f"or 'threads')"}
    try:
        result = reload_with(request.get("backend"), request.get("backend_args"), merge=True)
    except (EngineError, ValueError, TypeError) as e:
        return {"ok": False, "error": str(e)}
    return {"ok": True, **result}


@dataclasses.dataclass(eq=False)
class Reload:
    """A reload: posted by reload(), run by the monitor thread, answered by `done`."""
    options: Any  # the EngineOptions the new batchers run with
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    phase: str = "start"  # "start": new batchers starting; "retire": old ones finishing
    epoch: int = 0  # the new batchers' epoch
    new: list = dataclasses.field(default_factory=list)  # their Instances
    readers: dict = dataclasses.field(default_factory=dict)  # index -> readiness pipe, until ready
    deadline_ns: int = 0  # of the current phase
    result: Optional[dict] = None
    error: Optional[BaseException] = None

    def begin(self, seg, engine: str, epoch: int, cpus: list, gpus: list) -> None:
        """Launches the new batchers, epoch E+2, numbered in the other bank: they
        wait, not claiming, until the epoch word reaches theirs. cpus and gpus
        hold one entry per instance. Raises if one cannot be launched (the
        caller aborts the reload)."""
        n = len(cpus)
        bank = (epoch // 2 + 1) % 2
        self.epoch = epoch + 2
        self.new = [Instance(bank * n + i, i) for i in range(n)]
        self.deadline_ns = ring.now_ns() + int(self.options.start_timeout_s * 1e9)
        log.info("engine %s: reload: starting batchers %s (epoch %d)", engine,
                 [b.index for b in self.new], self.epoch)
        for b in self.new:
            seg.mark_batch(b.index, 0)
            b.proc, self.readers[b.index] = processes.spawn(
                engine, b.index, self.options.backend, self.options.backend_args, cpus[b.position],
                gpus[b.position], self.epoch)

    def ready(self, engine: str) -> bool:
        """Phase "start": whether every new batcher is ready (reads the readiness
        messages that came). BackendError when one failed, died or is late."""
        for b in self.new:
            reader = self.readers.get(b.index)
            if reader is not None:
                if reader.poll(0):
                    del self.readers[b.index]
                    try:
                        processes.await_ready(engine, b.index, b.proc, reader)
                    except BaseException:
                        reader.close()
                        raise
                    b.reports = reader  # open while it serves (restarts.why_died reads it)
            elif not b.proc.is_alive():
                raise BackendError("BatcherDied", f"new batcher {b.index} (pid "
                                   f"{b.proc.pid}) exited (exit code "
                                   f"{b.proc.exitcode}) before it took over")
        if self.readers:
            if ring.now_ns() > self.deadline_ns:
                raise BackendError("StartTimeout", f"new batcher(s) "
                                   f"{sorted(self.readers)} not ready within "
                                   f"{self.options.start_timeout_s:g} s")
            return False
        return True

    def step(self, seg, engine: str, old: list, bound_s: float, batch_timeout_s,
             set_epoch: Callable[[int], None]) -> bool:
        """Moves the reload on, if it can: all new batchers ready -> the old
        ones retire (epoch E+1); all old ones gone -> the new ones serve (E+2):
        True then. A new batcher that failed to start aborts the reload (done
        is set, the old batchers keep serving)."""
        if self.phase == "start":
            try:
                if not self.ready(engine):
                    return False
            except BaseException as e:
                self.abort(seg, engine, e)
                return False
            self.retire(bound_s)
            set_epoch(self.epoch - 1)  # the old ones exit after the batch they hold
        if not self.retired(seg, engine, old, bound_s, batch_timeout_s):
            return False
        set_epoch(self.epoch)  # the new ones serve
        return True

    def retire(self, bound_s: float) -> None:
        """Enters phase "retire": the old batchers have bound_s to finish their batch
        (the caller moves the epoch word to E+1)."""
        self.phase = "retire"
        self.deadline_ns = ring.now_ns() + int(bound_s * 1e9)

    def retired(self, seg, engine: str, old: list, bound_s: float,
                batch_timeout_s: Optional[float]) -> bool:
        """Phase "retire": forgets the old batchers that exited; past the deadline,
        kills the rest. Whether none is left (then the new ones may serve)."""
        for b in old:
            if b.proc is not None and not b.proc.is_alive():
                _retire(seg, engine, b, bound_s, batch_timeout_s)
        stragglers = [b for b in old if b.proc is not None]
        if stragglers:
            if ring.now_ns() <= self.deadline_ns:
                return False
            for b in stragglers:
                b.proc.kill()
                b.proc.join(10)
                if b.proc.is_alive():  # still in the kernel (a driver call): a later pass
                    continue           # reaps it once it is gone, never while it may write
                _retire(seg, engine, b, bound_s, batch_timeout_s, overran=True)
        return all(b.proc is None for b in old)

    def watch_new(self, seg, engine: str, batch_timeout_s: Optional[float],
                  kill_if_hung: Callable) -> None:
        """Phase "retire" of an iterative engine, whose new batchers serve while
        the old ones finish their streams: one that died has its requests
        failed now (its number restarts once the reload ends); one that hangs
        is killed."""
        for b in self.new:
            if b.proc is None:
                continue
            if not b.proc.is_alive():
                _retire(seg, engine, b, 0.0, batch_timeout_s)
            elif batch_timeout_s is not None:
                kill_if_hung(b)

    def finish(self, engine: str) -> None:
        """Answers the caller: the new batchers serve (the epoch word is theirs)."""
        self.result = {"epoch": self.epoch,
                       "batcher_pids": [b.proc.pid for b in self.new if b.proc is not None]}
        log.info("engine %s reloaded: epoch %d, batcher pids %s", engine, self.epoch,
                 self.result["batcher_pids"])
        self.done.set()

    def abort(self, seg, engine: str, error: BaseException) -> None:
        """Kills the new batchers (they never claimed: the epoch never reached
        theirs) and answers the caller with why; the old ones keep serving."""
        for b in self.new:
            reader = self.readers.pop(b.index, None)
            if reader is not None:
                reader.close()
            b.drop_reports()
            if b.proc is not None:
                processes.kill(b.proc)
                b.proc = None
            seg.ring.set_word(codes.W_BATCHER_PID + b.index, 0)
        if isinstance(error, EngineUnavailable):
            self.error = error
        else:
            exc_type, message = ((error.exc_type, error.message) if isinstance(error, BackendError)
                                 else (type(error).__name__, str(error)))
            self.error = BackendError(exc_type, f"{message} (reload abandoned: the old "
                                      f"batchers keep serving)")
            log.error("engine %s: reload failed: %s", engine, self.error)
        self.done.set()


def _retire(seg, engine: str, b: Instance, bound_s: float, batch_timeout_s: Optional[float],
            overran: bool = False) -> None:
    """Forgets an old batcher that exited after a reload retired it; one that
    died holding a batch (or was killed for overrunning) has it failed."""
    r, proc = seg.ring, b.proc
    proc.join(0)
    why = None
    if overran:
        why = f"still in its last batch {bound_s:g} s after a reload retired it; killed"
    elif b.hung or proc.exitcode:
        why = restarts.why_died(b, proc.exitcode, batch_timeout_s)
    b.drop_reports()
    # a clean exit left nothing claimed (it exits between batches); reap in any case
    # a retired batcher has no successor: its batch fails (not retried)
    failed, _ = r.reap_batcher(b.index, f"batcher {b.index} (pid {proc.pid}) died "
                                        f"({why or 'exited'}) while serving this request"
                                        .encode())
    if why is not None:
        log.warning("engine %s: batcher %d (pid %d), in a reload, %s; failed %d claimed "
                    "request(s)", engine, b.index, proc.pid, why, failed)
    seg.mark_batch(b.index, 0)
    r.set_word(codes.W_BATCHER_PID + b.index, 0)
    proc.close()
    b.proc, b.hung = None, False
    if why is not None:  # a new batcher's number restarts when the reload ends
        b.died_ns = ring.now_ns()
