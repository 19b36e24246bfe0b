"""The owner of a node's engine: one Ray actor per application and node.

Every replica of an application on a node attaches to the same owner (a
named actor, created by the first of them, pinned to the node). The owner
starts the engine (engine.ray.node_engine: a supervisor process of its own)
when its first replica attaches, and stops it when its last one leaves:
detached, or dead (each replica is registered by pid and start time, and
checked every POLL_S, since a replica can be killed without a word). A
supervisor that dies is restarted, after RESTART_BACKOFF_S at first, longer
if it keeps dying; meanwhile the replicas' clients raise EngineUnavailable,
and re-attach by themselves once it serves again.

The actor is detached, so that it outlives the replica that created it; it
ends itself once its engine has stopped with no replica left. A replica that
finds it ending ("closing") asks again, and creates the next owner.
"""
import contextlib
import logging
import threading
import time
from typing import Dict, Optional, Tuple

import ray

from engine import launch
import engine.ray.node_engine as node_engine
from engine.errors import EngineAlreadyRunning
from engine.segment import remove_if_dead
from engine.shm import liveness

log = logging.getLogger("shmbatch")

NAMESPACE = "shmbatch"
POLL_S = 0.1  # how often replicas and the supervisor are checked
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)  # before restart n (the last repeats)
STOP_GRACE_S = 15.0  # a supervisor gets drain_timeout_s and this to stop; then SIGKILL
FIRST_ATTACH_S = 60.0  # an owner no replica attaches to within this ends
END_WAIT_S = 2.0  # calls in flight are answered before the actor ends, for this long at most

IDLE, STARTING, RUNNING, CLOSING = "idle", "starting", "running", "closing"


def backoff_s(restarts: int) -> float:
    """The wait before restart number `restarts` (1, 2, ...)."""
    return RESTART_BACKOFF_S[min(restarts, len(RESTART_BACKOFF_S)) - 1]


def actor_name(engine_name: str) -> str:
    return f"shmbatch-owner-{engine_name}"


@ray.remote(num_cpus=0, max_concurrency=64, max_restarts=0)
class NodeOwner:
    """The engine `name` of this node, for the replicas that attach."""

    def __init__(self, name: str, knobs: dict) -> None:
        self.name, self.knobs = name, knobs
        self.replicas: Dict[str, Tuple[int, int]] = {}  # key -> (pid, start ticks)
        self.state = IDLE
        self.error: Optional[str] = None  # why the first start failed
        self.proc: Optional[launch.Child] = None
        self.restarts = 0
        self.calls = 0  # calls in flight: answered before the actor ends
        self.stopped = False  # the engine has stopped for good: the actor ends
        self.created = time.monotonic()
        self.cond = threading.Condition()
        self.start_timeout_s = float(knobs.get("start_timeout_s", 120.0)) * \
            int(knobs.get("instances", 1)) + 30.0
        self.stop_timeout_s = float(knobs.get("drain_timeout_s", 30.0)) + STOP_GRACE_S
        # the supervisor's parent-death signal follows this thread: it lives as the actor does
        threading.Thread(target=self._run, daemon=True, name=f"shmbatch-owner-{name}").start()

    # -- what replicas call ------------------------------------------------------
    def attach(self, key: str, pid: int, ticks: int) -> str:
        """Registers a replica; at the engine's first start waits until it
        serves. Returns "running" (or "starting": a restart, the replica
        answers 503 until it serves), or "closing" (this owner is ending: ask
        the next one). RuntimeError if the engine's first start failed."""
        with self._call():
            if self.state == CLOSING:
                return CLOSING
            self.replicas[key] = (pid, ticks)
            self.cond.notify_all()
            deadline = time.monotonic() + self.start_timeout_s
            while self.state in (IDLE, STARTING) and not self.restarts and self.error is None \
                    and key in self.replicas and time.monotonic() < deadline:
                self.cond.wait(POLL_S)
            if self.error is not None:
                raise RuntimeError(self.error)
            return self.state

    def detach(self, key: str) -> None:
        """Unregisters a replica; the last one waits until the engine has stopped."""
        with self._call():
            self.replicas.pop(key, None)
            self.cond.notify_all()
            deadline = time.monotonic() + self.stop_timeout_s
            while not self.replicas and not self.stopped and time.monotonic() < deadline:
                self.cond.wait(POLL_S)

    def status(self) -> dict:
        with self.cond:
            proc = self.proc
            return {"engine": self.name, "state": self.state, "replicas": len(self.replicas),
                    "supervisor_pid": proc.pid if proc is not None else None,
                    "restarts": self.restarts}

    # -- the monitor thread ------------------------------------------------------
    def _run(self) -> None:
        start_at = 0.0  # monotonic time of the next start, while there is no supervisor
        while True:
            with self.cond:
                self._forget_dead_replicas()
                idle = not self.replicas and (self.state != IDLE or
                                              time.monotonic() > self.created + FIRST_ATTACH_S)
                if idle or self.error is not None:
                    self.state = CLOSING  # from here an attach asks the next owner
                    self.cond.notify_all()
                    break
                proc = self.proc
            if proc is not None and proc.poll() is not None:
                log.warning("engine %s: supervisor pid %d died (exit code %s); restarting",
                            self.name, proc.pid, proc.returncode)
                proc.close()
                self._set(STARTING, proc=None, restarts=self.restarts + 1)
                start_at = time.monotonic() + backoff_s(self.restarts)
                proc = None
            if proc is None and time.monotonic() >= start_at and not self._start():
                self._set(STARTING, restarts=self.restarts + 1)
                start_at = time.monotonic() + backoff_s(self.restarts)
            with self.cond:
                self.cond.wait(POLL_S)
        self._stop()
        self._set(CLOSING, stopped=True)
        self._end()

    def _forget_dead_replicas(self) -> None:
        for key, (pid, ticks) in list(self.replicas.items()):
            if not liveness.is_alive(pid, ticks):
                log.info("engine %s: replica %s (pid %d) is gone", self.name, key, pid)
                del self.replicas[key]

    def _start(self) -> bool:
        """Starts the supervisor; whether it serves. A first start that fails
        fails the replicas waiting for it; a restart is tried again later."""
        self._set(STARTING)
        try:
            self._remove_leftover()
            proc = node_engine.start(self.name, self.knobs, self.start_timeout_s)
        except Exception as e:
            if self.restarts == 0:
                self._set(STARTING, error=f"engine {self.name!r} did not start: {e}")
            else:
                log.error("engine %s: restart failed: %s", self.name, e)
            return False
        self._set(RUNNING, proc=proc)
        return True

    def _remove_leftover(self) -> None:
        """Removes a dead supervisor's segment; waits (bounded) for one that
        still drains: a previous owner's, killed with its actor."""
        deadline = time.monotonic() + self.stop_timeout_s
        while True:
            try:
                remove_if_dead(self.name)
                return
            except EngineAlreadyRunning:
                if time.monotonic() > deadline:
                    raise
                time.sleep(POLL_S)

    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()  # the supervisor drains, then removes its segment
            proc.join(self.stop_timeout_s)
        if proc.poll() is None:
            log.warning("engine %s: supervisor pid %d did not stop; killing it", self.name,
                        proc.pid)
            launch.kill(proc)
        else:
            proc.close()
        try:
            remove_if_dead(self.name)  # what a killed supervisor left
        except Exception as e:  # another owner's engine of that name: not ours to remove
            log.warning("engine %s: %s", self.name, e)

    def _end(self) -> None:
        deadline = time.monotonic() + END_WAIT_S
        with self.cond:
            while self.calls and time.monotonic() < deadline:
                self.cond.wait(POLL_S)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def _set(self, state: str, **changes) -> None:
        with self.cond:
            self.state = state
            for attr, value in changes.items():
                setattr(self, attr, value)
            self.cond.notify_all()

    @contextlib.contextmanager
    def _call(self):
        """Holds the lock for a replica's call (waits release it), counted."""
        with self.cond:
            self.calls += 1
            try:
                yield
            finally:
                self.calls -= 1
                self.cond.notify_all()
