"""The Engine: creates the segment, runs and watches the batchers, reaps, stops.

It lives in the process that calls Engine.start(). One monitor thread per
engine spawns the batcher processes (each dies with that thread, by the
kernel's parent-death signal, so nothing outlives a killed supervisor) and
then wakes on any batcher's exit or every REAP_INTERVAL_S:

- a new batcher takes a dead one's instance number. With isolate_failures
  (the default) it first retries the dead one's batch, each request alone:
  one that kills a batcher again then fails as poison (BackendError
  "BatcherDied"), its batch mates are answered. Without, or on an engine
  that answers in place (its inputs may hold answers already), it fails.
  The requests still queued are served by it or by the other instances;
- the slots of dead clients are reclaimed: their owner is named in each
  slot's control word, and death is judged by pid + start time.

reload() starts new batchers (new backend args or weights, or a new backend)
beside the old ones and hands the ring over by the header's epoch word; the
monitor thread runs it step by step (engine.serving.reloading says how, and
when old and new overlap). `shmbatch reload NAME` reaches a running engine
through its control socket (engine.serving.control). The batcher processes
themselves (launch, readiness) are engine.serving.processes', the restart
policy engine.serving.restarts'.

stop() refuses new requests (EngineUnavailable), serves what is queued,
stops the batchers and unlinks the segment.
"""
import atexit
import dataclasses
import logging
import multiprocessing.connection
import os
import threading
import weakref
from typing import Any, Dict, Optional, Union

from engine import spec
from engine.config import REAP_INTERVAL_S, EngineConfig, EngineOptions, per_instance
from engine.errors import BackendError, EngineUnavailable
from engine.segment import Segment
from engine.serving import control, metrics, processes, reloading, restarts
from engine.serving.admission_log import AdmissionLog
from engine.serving.reloading import Reload
from engine.serving.restarts import Instance
from engine.shm import codes, liveness, reaper, ring

log = logging.getLogger("shmbatch")

CORRUPT_LOG_INTERVAL_S = 10.0  # a writer into the segment is logged at most this often
_live_engines: "weakref.WeakSet[Engine]" = weakref.WeakSet()


# Every keyword Engine(...) takes, in order: the segment's knobs, then the engine's own.
KNOBS = tuple(dataclasses.fields(EngineConfig)) + tuple(dataclasses.fields(EngineOptions))


class Engine:
    """A dynamic batching engine serving one backend.

    Engine(name, **knobs): the knobs are the fields of EngineConfig and
    EngineOptions (see KNOBS), each with its default and what it does."""

    def __init__(self, name: str, **knobs: Any) -> None:
        config_keys = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(knobs) - {f.name for f in KNOBS})
        if unknown:
            raise TypeError(f"Engine() got unknown knob(s) {', '.join(unknown)}; expected some of "
                            f"{', '.join(f.name for f in KNOBS if f.name != 'name')}")
        self.config = EngineConfig(name=name, **{k: v for k, v in knobs.items() if k in config_keys})
        self.options = EngineOptions(**{k: v for k, v in knobs.items() if k not in config_keys})
        instances = self.config.instances
        self.cpus = [None if c is None else ([c] if isinstance(c, int) else list(c))
                     for c in per_instance(self.options.cpus, instances, "cpus")]
        self.gpus = per_instance(self.options.gpus, instances, "gpus")
        self._seg: Optional[Segment] = None
        self._instances = [Instance(i, i) for i in range(instances)]
        self._epoch = 0  # the header's W_EPOCH, as this engine last set it
        self._reload: Optional[Reload] = None  # the reload the monitor thread is running
        self._reload_posted: Optional[Reload] = None  # posted by reload(), for the monitor
        self._reload_lock = threading.Lock()  # one reload() at a time
        # posting a reload and the monitor's end exclude each other: a reload
        # posted once the monitor has ended would wait for nobody
        self._post_lock = threading.Lock()
        self._monitor_ended = False
        self._control: Optional[control.Server] = None
        self._monitor: Optional[threading.Thread] = None
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._stopping = threading.Event()
        self._wake_r: Optional[int] = None
        self._wake_w: Optional[int] = None

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
        seg = self._seg
        pid = os.getpid()
        seg.own_word(codes.W_ENGINE_STATE, codes.ENGINE_STARTING)
        seg.own_word(codes.W_SUPERVISOR_START, liveness.start_ticks(pid) or 0)
        seg.own_word(codes.W_SUPERVISOR_PID, pid)
        seg.own_word(codes.W_NETNS, liveness.netns())  # where asyncio wakes reach (wakes.py)
        seg.own_word(codes.W_INSTANCES, self.config.instances)
        self._epoch = 0
        seg.own_word(codes.W_EPOCH, 0)
        self._started_ns = ring.now_ns()  # no batch the watchdog sees starts before it
        self._corrupt_logged, self._corrupt_log_at_ns = 0, 0
        self._admission_log = AdmissionLog(self.name, seg.ring, self._started_ns)
        self._unserved = restarts.Unserved(seg, self.options.start_timeout_s)
        self._instances = [Instance(i, i) for i in range(self.config.instances)]
        self._seg.set_batch_limit(self.config.max_batch_size)  # AIMD moves it, with slo_ms
        self._wake_r, self._wake_w = os.pipe()
        self._stopping.clear()
        self._started.clear()
        self._monitor_ended = False
        self._start_error = None
        # the batchers are spawned by the monitor thread: they die with it
        self._monitor = threading.Thread(target=self._monitor_main, daemon=True,
                                         name=f"shmbatch-supervisor-{self.name}")
        self._monitor.start()
        if not self._started.wait(self.options.start_timeout_s * self.config.instances + 10):
            self._start_error = BackendError("StartTimeout", "batchers did not start in time")
        if self._start_error is not None:
            raise self._start_error
        seg.own_word(codes.W_ENGINE_STATE, codes.ENGINE_RUNNING)
        try:
            self._control = control.Server(self.name, lambda request: reloading.control_request(
                request, self._reload_with, lambda: processes.thread_pools(self._instances)))
        except OSError as e:  # the engine serves; only `shmbatch reload` cannot reach it
            log.warning("engine %s: no control socket (%s); `shmbatch reload %s` will not "
                        "reach this engine", self.name, e, self.name)
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
        seg.own_word(codes.W_ENGINE_STATE, codes.ENGINE_STOPPING)
        r.wake_work()  # a batcher waiting for a deadline flushes now
        self._drain(self.options.drain_timeout_s)
        self._teardown()
        log.info("engine %s stopped", self.name)

    def _drain(self, timeout_s: float) -> None:
        r = self._seg.ring
        deadline = ring.now_ns() + int(timeout_s * 1e9)
        while ring.now_ns() < deadline:
            seen = r.done_seq()
            if not reaper.Census(r, self._seg.capacity).count(codes.WRITING, codes.READY,
                                                              codes.CLAIMED):
                return
            # a reload's new batchers count: they serve once the old ones have left
            reload = self._reload
            serving = self._instances + (reload.new if reload is not None else [])
            alive = any(b.proc is not None and b.proc.is_alive() for b in serving)
            if not alive:
                log.error("engine %s: no batcher left to drain the queue", self.name)
                return
            r.wait_done_seq(seen, int(REAP_INTERVAL_S * 1e9))
        log.warning("engine %s: drain timed out after %.1f s", self.name, timeout_s)

    def _teardown(self) -> None:
        self._stopping.set()
        if self._control is not None:
            self._control.close()  # no new request; one in progress is answered
        self._seg.own_word(codes.W_ENGINE_STATE, codes.ENGINE_STOPPED)
        self._seg.ring.wake_work()  # batchers see STOPPED and exit once idle
        if self._wake_w is not None:
            os.write(self._wake_w, b"x")
        if self._monitor is not None:
            self._monitor.join(timeout=30)  # it ends a reload in progress (kills its new batchers)
        if self._control is not None:
            self._control.join(timeout=10)
            self._control = None
        for b in self._instances:
            b.drop_reports()
            proc, b.proc = b.proc, None
            if proc is None:
                continue
            proc.join(timeout=10)
            if proc.is_alive():
                log.warning("engine %s: batcher pid %d did not stop; killing it", self.name, proc.pid)
                processes.kill(proc)
            else:
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

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- figures -------------------------------------------------------------
    def stats(self) -> Dict[str, Any]:
        """The engine's figures, read from its segment, and its batchers' thread
        pools (as `shmbatch status NAME --json`) and warmup (processes.figures)."""
        if self._seg is None:
            raise EngineUnavailable(f"engine {self.name!r} is not running")
        return {**metrics.read_stats(self._seg), **processes.figures(self._instances)}

    # -- reload -------------------------------------------
    def reload(self, backend: Union[None, str, spec.Factory] = None,
               backend_args: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """Starts new batchers beside the old ones, with `backend` (MOD:FACTORY
        or a picklable callable; None keeps the current one) and `backend_args`
        (they REPLACE the current ones; None keeps them: with neither, the same
        factory runs again, e.g. to read new weights). Once every new batcher
        is ready, the old ones finish the batch they hold and exit, then the
        new ones take the queue: no request is lost, refused or answered twice,
        and every request the old batchers answer was claimed before any the
        new ones answer. Later restarts of a crashed batcher use the new ones.

        Returns {"epoch": ..., "batcher_pids": [...]} once the new batchers
        serve. BackendError when a new batcher fails to start (the old ones
        keep serving); ValueError for a malformed spec or more than 16
        instances; EngineUnavailable when the engine is not running.
        (`shmbatch reload NAME --backend-arg K=V` merges its args instead.)"""
        return self._reload_with(backend, backend_args, merge=False)

    def _reload_with(self, backend, backend_args: Optional[dict], merge: bool) -> dict:
        options = reloading.options_for(self.options, self.config.instances, backend,
                                           backend_args, merge)
        with self._reload_lock:
            if self._seg is None or self._stopping.is_set():
                raise EngineUnavailable(f"engine {self.name!r} is not running")
            request = Reload(options)
            with self._post_lock:
                if self._monitor_ended:
                    raise EngineUnavailable(f"engine {self.name!r} is stopping")
                self._reload_posted = request
                try:
                    os.write(self._wake_w, b"r")  # the monitor thread runs it
                except (OSError, TypeError):  # the wake pipe is gone: torn down meanwhile
                    self._reload_posted = None
                    raise EngineUnavailable(f"engine {self.name!r} is not running") from None
            # the monitor may first finish a restart, then starts (start_timeout_s) and retires
            bound = (2 * request.options.start_timeout_s + 10
                     + reloading.retire_bound_s(self.options, self.config.iterative))
            if not request.done.wait(bound):
                if self._reload_posted is request:
                    self._reload_posted = None
                raise BackendError("ReloadTimeout", f"the reload of engine {self.name!r} did "
                                   f"not finish within {bound:g} s")
            if request.error is not None:
                raise request.error
            return dict(request.result)

    def _begin_reload(self, request: Reload) -> None:
        self._reload = request
        try:
            request.begin(self._seg, self.name, self._epoch, self.cpus, self.gpus)
        except BaseException as e:
            self._abort_reload(e)

    def _step_reload(self) -> None:
        """Moves the reload on, if it can (Reload.step); once the new batchers
        serve, they are the engine's."""
        request = self._reload
        bound_s = reloading.retire_bound_s(self.options, self.config.iterative)
        if request.step(self._seg, self.name, self._instances, bound_s,
                        self.options.batch_timeout_s, self._set_epoch):
            self._instances, self.options = request.new, request.options
            self._reload = None
            request.finish(self.name)
        elif request.done.is_set():  # aborted: the old batchers keep serving
            self._reload = None

    def _abort_reload(self, error: BaseException) -> None:
        request, self._reload = self._reload, None
        request.abort(self._seg, self.name, error)

    def _set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._seg.own_word(codes.W_EPOCH, epoch)
        self._seg.ring.wake_work()  # sleeping batchers look at the word now

    # -- the monitor thread --------------------------------------------------
    def _spawn(self, b: Instance) -> None:
        """Starts b's batcher (current options and epoch) and waits until it serves
        (or its factory fails)."""
        o, began_ns = self.options, self._unserved.starting(self._instances)
        b.proc, b.reports = processes.start(self.name, b.index, o.backend, o.backend_args,
                                            self.cpus[b.position], self.gpus[b.position],
                                            self._epoch, o.start_timeout_s,
                                            self._unserved.waiting_s)
        self._unserved.served(began_ns)

    def _monitor_main(self) -> None:
        try:
            for b in self._instances:
                self._spawn(b)
        except BaseException as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        try:
            self._watch()
        finally:
            if self._reload is not None:
                self._abort_reload(EngineUnavailable(f"engine {self.name!r} stopped during "
                                                     f"the reload"))
            with self._post_lock:
                self._monitor_ended = True
                posted, self._reload_posted = self._reload_posted, None
            if posted is not None:
                posted.error = EngineUnavailable(f"engine {self.name!r} is stopping")
                posted.done.set()

    def _watch(self) -> None:
        """The monitor's loop: restarts dead batchers, kills hung ones, reaps dead
        clients' slots, runs a posted reload step by step."""
        while not self._stopping.is_set():
            waitables = [b.proc.sentinel for b in self._instances if b.proc is not None]
            if self._reload is not None and self._reload.phase == "start":
                waitables += [b.proc.sentinel for b in self._reload.new if b.proc is not None]
                waitables += list(self._reload.readers.values())
            waitables.append(self._wake_r)
            ready = multiprocessing.connection.wait(waitables,
                                                    timeout=self.options.reap_interval_s)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)  # readable: does not block
            if self._stopping.is_set():
                break
            if self._reload is None and self._reload_posted is not None:
                request, self._reload_posted = self._reload_posted, None
                self._begin_reload(request)
            if self._reload is not None:
                self._step_reload()
            retiring = self._reload is not None and self._reload.phase == "retire"
            if retiring and self.config.iterative:  # the new batchers serve already
                self._reload.watch_new(self._seg, self.name, self.options.batch_timeout_s,
                                       self._kill_if_hung)
            for b in self._instances:
                if b.proc is None or not b.proc.is_alive():
                    if not retiring:  # a retiring batcher's exit is the reload's to handle
                        self._replace(b)
                elif self.options.batch_timeout_s is not None:
                    self._kill_if_hung(b)
            self._reap_clients()
            self._guard_segment()
            self._admission_log.tick(ring.now_ns())

    def _kill_if_hung(self, b: Instance) -> None:
        timeout_s = self.options.batch_timeout_s
        if restarts.hung(self._seg.batch_started_ns(b.index), ring.now_ns(), self._started_ns,
                         timeout_s):
            log.error("engine %s: batcher %d (pid %d) ran one batch over batch_timeout_s=%g; "
                      "killing it", self.name, b.index, b.proc.pid, timeout_s)
            b.hung = True
            b.proc.kill()  # the next pass sees it dead: its batch fails, a new one starts

    def _replace(self, b: Instance) -> None:
        r, i, proc = self._seg.ring, b.index, b.proc
        if proc is not None:
            proc.join(0)
            why = restarts.why_died(b, proc.exitcode, self.options.batch_timeout_s)
            self._seg.mark_batch(i, 0)
            # an engine that answers in place may have written answers over the
            # batch's inputs before its batcher died: never retried
            retry = self.config.isolate_failures and not self._seg.in_place
            retried = r.word(codes.W_RETRIED)
            failed, kept = r.reap_batcher(i, *restarts.reap_terms(b, proc.pid, why, retried,
                                                                  retry),
                                          restarts.begun_stream(b, proc.pid, why))
            b.kept, b.retried_at_keep = kept, retried
            self._unserved.starting(self._instances)  # said before serves() turns false
            r.set_word(codes.W_BATCHER_PID + i, 0)
            r.add_word(codes.W_RESTARTS)
            b.died_ns, b.failed_starts = ring.now_ns(), 0
            log.warning("engine %s: batcher %d (pid %d) died (%s); failed %d claimed "
                        "request(s), kept %d to retry alone; restarting", self.name, i,
                        proc.pid, why, failed, kept)
            proc.close()
            b.proc = None
        if ring.now_ns() < b.restart_at_ns:
            return
        try:
            self._spawn(b)
            b.backoff_s = 0.0
        except Exception as e:
            # no successor to retry what the dead one kept: those fail now
            failed, _ = r.reap_batcher(i, restarts.no_successor(b, e))
            b.kept = 0
            if not isinstance(e, BackendError):
                raise
            backoff = restarts.back_off(b)
            b.restart_at_ns = ring.now_ns() + int(backoff * 1e9)
            self._unserved.failed(b.restart_at_ns)
            log.error("engine %s: batcher %d did not restart (%s); failed %d kept request(s); "
                      "next try in %.1f s", self.name, i, e, failed, backoff)
            return
        if b.died_ns:  # a warning, as the death was: a log filtered to warnings shows both
            log.warning("engine %s: %s", self.name, restarts.ready_again(b, ring.now_ns()))

    def _guard_segment(self) -> None:
        """Puts back what this process alone writes in the segment, and says
        (at most every CORRUPT_LOG_INTERVAL_S) when values in it failed their
        checks: another process of the user writes into it. The engine goes
        on: each such value was refused where it was read."""
        self._seg.restore()
        total, now_ns = self._seg.ring.corrupt_total(), ring.now_ns()
        if total > self._corrupt_logged and now_ns >= self._corrupt_log_at_ns:
            log.warning("engine %s: %d value(s) in its segment failed their checks (%d in "
                        "all): another process writes into /dev/shm/shmbatch-%s; the engine "
                        "restored what it owns and failed the requests it could not trust",
                        self.name, total - self._corrupt_logged, total, self.name)
            self._corrupt_logged = total
            self._corrupt_log_at_ns = now_ns + int(CORRUPT_LOG_INTERVAL_S * 1e9)

    def _reap_clients(self) -> None:
        """Frees the slots of clients that died (pid gone, or reused by another)."""
        census = reaper.Census(self._seg.ring, self._seg.capacity)
        for slot, pid in reaper.reap_dead_clients(self._seg.ring, census):
            log.info("engine %s: reclaimed slot %d of dead client pid %d", self.name, slot, pid)


@atexit.register
def _stop_live_engines() -> None:
    # runs before multiprocessing's own exit handler, which would join the batchers
    for engine in list(_live_engines):
        engine.stop()
