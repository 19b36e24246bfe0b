"""The Engine: creates the segment, runs and watches the batchers, reaps, stops.

It lives in the process that calls Engine.start(). One monitor thread per
engine spawns the batcher processes (each dies with that thread, by the
kernel's parent-death signal, so nothing outlives a killed supervisor) and
then wakes on any batcher's exit or every REAP_INTERVAL_S:

- a dead batcher's claimed slots are failed (BackendError "BatcherDied": its
  batch is NOT retried, since a request that crashed one batcher would crash
  the next) and a new batcher takes its instance number; the requests still
  queued are served by it or by the other instances;
- the slots of dead clients are reclaimed: their owner is named in each
  slot's control word, and death is judged by pid + start time.

stop() refuses new requests (EngineUnavailable), serves what is queued,
stops the batchers and unlinks the segment.
"""
import atexit
import dataclasses
import logging
import multiprocessing.connection
import os
import pickle
import subprocess
import sys
import threading
import weakref
from typing import Optional

from engine import backends, liveness, metrics, reaper, ring
from engine.errors import BackendError, EngineUnavailable
from engine.config import EngineConfig, knob
from engine.layout import Segment

log = logging.getLogger("shmbatch")

REAP_INTERVAL_S = 0.1
_RESTART_BACKOFF_MAX_S = 10.0
_live_engines = weakref.WeakSet()


def _per_instance(value, instances: int, what: str):
    if value is None:
        return [None] * instances
    value = list(value)
    if len(value) != instances:
        raise ValueError(f"{what} must give one entry per instance ({instances}), got {len(value)}")
    return value


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """The knobs only the engine's own process needs (the others are EngineConfig's)."""

    backend: object = knob("engine.backends:synthetic", "callable",
                           "MOD:FACTORY imported in each batcher, or a picklable callable")
    backend_args: dict = knob(None, "key_values", "keyword arguments for the factory")
    cpus: Optional[list] = knob(None, "cpus", "CPU affinity of each instance, e.g. [[0], [1]]")
    gpus: Optional[list] = knob(None, "gpus", "CUDA_VISIBLE_DEVICES of each instance, e.g. [0, 1]")
    start_timeout_s: float = knob(120.0, "float", "a batcher not serving by then fails start()")
    drain_timeout_s: float = knob(30.0, "float", "stop() answers what is queued for this long")
    batch_timeout_s: Optional[float] = knob(
        None, "float", "a batch running longer is a hung model: its batcher is killed and "
        "replaced, that batch fails (BatcherDied)")
    reap_interval_s: float = knob(REAP_INTERVAL_S, "float",
                                  "how often dead clients' slots are looked for (a client that "
                                  "finds the ring full reclaims them at once)")

    def __post_init__(self):
        backends.check_spec(self.backend)
        object.__setattr__(self, "backend_args", dict(self.backend_args or {}))
        if self.batch_timeout_s is not None and not self.batch_timeout_s > 0:
            raise ValueError(f"batch_timeout_s must be > 0 or None, got {self.batch_timeout_s}")
        if not self.reap_interval_s > 0:
            raise ValueError(f"reap_interval_s must be > 0, got {self.reap_interval_s}")


# Every keyword Engine(...) takes, in order: the segment's knobs, then the engine's own.
KNOBS = tuple(dataclasses.fields(EngineConfig)) + tuple(dataclasses.fields(EngineOptions))


class Engine:
    """A dynamic batching engine serving one backend (contract section 1).

    Engine(name, **knobs): the knobs are the fields of EngineConfig and
    EngineOptions (see KNOBS), each with its default and what it does."""

    def __init__(self, name: str, **knobs):
        config_keys = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(knobs) - {f.name for f in KNOBS})
        if unknown:
            raise TypeError(f"Engine() got unknown knob(s) {', '.join(unknown)}; expected some of "
                            f"{', '.join(f.name for f in KNOBS if f.name != 'name')}")
        self.config = EngineConfig(name=name, **{k: v for k, v in knobs.items() if k in config_keys})
        self.options = EngineOptions(**{k: v for k, v in knobs.items() if k not in config_keys})
        instances = self.config.instances
        self.cpus = [None if c is None else ([c] if isinstance(c, int) else list(c))
                     for c in _per_instance(self.options.cpus, instances, "cpus")]
        self.gpus = _per_instance(self.options.gpus, instances, "gpus")
        self._seg: Optional[Segment] = None
        self._instances = [_Instance(i) for i in range(instances)]
        self._monitor: Optional[threading.Thread] = None
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._stopping = threading.Event()
        self._wake_r = self._wake_w = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def segment(self) -> Segment:
        """The running engine's segment (for figures and metrics)."""
        if self._seg is None:
            raise EngineUnavailable(f"engine {self.name!r} is not running")
        return self._seg

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> "Engine":
        """Creates the segment, starts the batchers; returns once clients can attach."""
        if self._seg is not None:
            raise RuntimeError(f"engine {self.name!r} is already started")
        self._seg = Segment.create(self.config)  # SegmentTooLarge before allocating
        try:
            return self._start()
        except BaseException:
            if self._seg is not None:  # whatever failed: no segment, pipe or batcher is left
                self._teardown()
            raise

    def _start(self) -> "Engine":
        r = self._seg.ring
        pid = os.getpid()
        r.set_word(ring.W_SUPERVISOR_START, liveness.start_ticks(pid) or 0)
        r.set_word(ring.W_SUPERVISOR_PID, pid)
        r.set_word(ring.W_INSTANCES, self.config.instances)
        self._seg.set_batch_limit(self.config.max_batch_size)  # AIMD moves it, with slo_ms
        self._wake_r, self._wake_w = os.pipe()
        self._stopping.clear()
        self._started.clear()
        self._start_error = None
        # the batchers are spawned by the monitor thread: they die with it
        self._monitor = threading.Thread(target=self._monitor_main, daemon=True,
                                         name=f"shmbatch-supervisor-{self.name}")
        self._monitor.start()
        if not self._started.wait(self.options.start_timeout_s * self.config.instances + 10):
            self._start_error = BackendError("StartTimeout", "batchers did not start in time")
        if self._start_error is not None:
            raise self._start_error
        r.set_word(ring.W_ENGINE_STATE, ring.ENGINE_RUNNING)
        _live_engines.add(self)
        log.info("engine %s started: %d instance(s), batcher pids %s", self.name,
                 self.config.instances, [b.proc.pid for b in self._instances])
        return self

    def stop(self) -> None:
        """Stops accepting, answers what is queued, stops the batchers, unlinks."""
        seg = self._seg
        if seg is None:
            return
        _live_engines.discard(self)
        r = seg.ring
        r.set_word(ring.W_ENGINE_STATE, ring.ENGINE_STOPPING)
        r.wake_work()  # a batcher waiting for a deadline flushes now
        self._drain(self.options.drain_timeout_s)
        self._teardown()
        log.info("engine %s stopped", self.name)

    def _drain(self, timeout_s: float) -> None:
        r = self._seg.ring
        deadline = ring.now_ns() + int(timeout_s * 1e9)
        while ring.now_ns() < deadline:
            seen = r.done_seq()
            if not reaper.Census(r, self._seg.capacity).count(ring.WRITING, ring.READY,
                                                              ring.CLAIMED):
                return
            alive = any(b.proc is not None and b.proc.is_alive() for b in self._instances)
            if not alive:
                log.error("engine %s: no batcher left to drain the queue", self.name)
                return
            r.wait_done_seq(seen, int(REAP_INTERVAL_S * 1e9))
        log.warning("engine %s: drain timed out after %.1f s", self.name, timeout_s)

    def _teardown(self) -> None:
        self._stopping.set()
        self._seg.ring.set_word(ring.W_ENGINE_STATE, ring.ENGINE_STOPPED)
        self._seg.ring.wake_work()  # batchers see STOPPED and exit once idle
        if self._wake_w is not None:
            os.write(self._wake_w, b"x")
        if self._monitor is not None:
            self._monitor.join(timeout=30)
        for b in self._instances:
            proc, b.proc = b.proc, None
            if proc is None:
                continue
            proc.join(timeout=10)
            if proc.is_alive():
                log.warning("engine %s: batcher pid %d did not stop; killing it", self.name, proc.pid)
                proc.kill()
                proc.join(timeout=10)
            proc.close()
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None
        self._seg.unlink()
        self._seg.close()
        self._seg = None

    def __enter__(self) -> "Engine":
        return self if self._seg is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- figures -------------------------------------------------------------
    def stats(self) -> dict:
        if self._seg is None:
            raise EngineUnavailable(f"engine {self.name!r} is not running")
        return metrics.read_stats(self._seg)

    # -- the monitor thread --------------------------------------------------
    def _spawn(self, i: int) -> "BatcherProcess":
        """Starts batcher i and waits until it serves (or its factory fails)."""
        read_fd, write_fd = os.pipe()
        reader = multiprocessing.connection.Connection(read_fd, writable=False)
        proc = None
        try:
            args = dict(name=self.name, instance=i, backend=self.options.backend,
                        backend_args=self.options.backend_args, cpus=self.cpus[i],
                        gpu=self.gpus[i],
                        ready_fd=write_fd)
            try:
                payload = pickle.dumps(list(sys.path)) + pickle.dumps(args)
            except Exception as e:
                raise BackendError(type(e).__name__, f"cannot pass the backend to a "
                                   f"batcher process: {e}") from None
            proc = BatcherProcess([sys.executable, "-c", "from engine.batcher import _entry; _entry()"], stdin=subprocess.PIPE,
                            pass_fds=(write_fd,))
            os.close(write_fd)
            write_fd = None
            try:
                proc.stdin.write(payload)
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it died at once: the recv below says so
            if not reader.poll(self.options.start_timeout_s):
                raise BackendError("StartTimeout", f"batcher {i} not ready within "
                                   f"{self.options.start_timeout_s} s")
            try:
                msg = reader.recv()
            except EOFError:
                proc.join(10)
                msg = ("error", "BatcherDied", f"batcher {i} exited during start "
                       f"(exit code {proc.exitcode})", "")
            if msg[0] != "ready":
                log.error("engine %s: batcher %d failed to start: %s: %s", self.name, i,
                          msg[1], msg[2])
                log.debug("batcher %d traceback:\n%s", i, msg[3])
                raise BackendError(msg[1], msg[2])
            return proc
        except BaseException:
            if proc is not None:
                proc.kill()
                proc.join(10)
                proc.close()
            raise
        finally:
            reader.close()
            if write_fd is not None:
                os.close(write_fd)

    def _monitor_main(self) -> None:
        try:
            for i in range(self.config.instances):
                self._instances[i].proc = self._spawn(i)
        except BaseException as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        while not self._stopping.is_set():
            waitables = [b.proc.sentinel for b in self._instances if b.proc is not None]
            waitables.append(self._wake_r)
            multiprocessing.connection.wait(waitables, timeout=self.options.reap_interval_s)
            if self._stopping.is_set():
                break
            for b in self._instances:
                if b.proc is None or not b.proc.is_alive():
                    self._replace(b)
                elif self.options.batch_timeout_s is not None:
                    self._kill_if_hung(b)
            self._reap_clients()

    def _kill_if_hung(self, b: "_Instance") -> None:
        started_ns = self._seg.batch_started_ns(b.index)
        if started_ns and ring.now_ns() - started_ns > self.options.batch_timeout_s * 1e9:
            log.error("engine %s: batcher %d (pid %d) ran one batch over batch_timeout_s=%g; "
                      "killing it", self.name, b.index, b.proc.pid,
                      self.options.batch_timeout_s)
            b.hung = True
            b.proc.kill()  # the next pass sees it dead: its batch fails, a new one starts

    def _replace(self, b: "_Instance") -> None:
        r, i, proc = self._seg.ring, b.index, b.proc
        if proc is not None:
            proc.join(0)
            why = (f"killed by signal {-proc.exitcode}" if proc.exitcode and proc.exitcode < 0
                   else f"exit code {proc.exitcode}")
            if b.hung:
                why = f"hung: its batch ran over batch_timeout_s={self.options.batch_timeout_s:g}"
                b.hung = False
            self._seg.mark_batch(i, 0)
            failed = r.reap_batcher(i, f"batcher {i} (pid {proc.pid}) died ({why}) "
                                       f"while serving this request".encode())
            r.set_word(ring.W_BATCHER_PID + i, 0)
            r.add_word(ring.W_RESTARTS)
            log.warning("engine %s: batcher %d (pid %d) died (%s); failed %d claimed "
                        "request(s); restarting", self.name, i, proc.pid, why, failed)
            proc.close()
            b.proc = None
        if ring.now_ns() < b.restart_at_ns:
            return
        try:
            b.proc = self._spawn(i)
            b.backoff_s = 0.0
        except BackendError as e:
            backoff = b.backoff_s = min(_RESTART_BACKOFF_MAX_S, 2 * b.backoff_s or 0.5)
            b.restart_at_ns = ring.now_ns() + int(backoff * 1e9)
            log.error("engine %s: batcher %d did not restart (%s); next try in %.1f s",
                      self.name, i, e, backoff)

    def _reap_clients(self) -> None:
        """Frees the slots of clients that died (pid gone, or reused by another)."""
        census = reaper.Census(self._seg.ring, self._seg.capacity)
        for slot, pid in reaper.reap_dead_clients(self._seg.ring, census):
            log.info("engine %s: reclaimed slot %d of dead client pid %d", self.name, slot, pid)


@dataclasses.dataclass
class _Instance:
    """Instance `index` of the engine: its batcher process (None between a
    death and the restart) and its restart state."""
    index: int
    proc: Optional["BatcherProcess"] = None
    restart_at_ns: int = 0  # no restart before this (backoff after failed starts)
    backoff_s: float = 0.0
    hung: bool = False  # killed by the watchdog (batch_timeout_s), not crashed


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


@atexit.register
def _stop_live_engines() -> None:
    # runs before multiprocessing's own exit handler, which would join the batchers
    for engine in list(_live_engines):
        engine.stop()
