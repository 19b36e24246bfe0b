"""A Ray Serve replica: a Client of its node's engine.

At its start a replica attaches to its node's owner (engine.ray.owner),
which starts the engine with the node's first replica; at its end
(Serve calls __del__) it detaches, and the node's last replica stops the
engine. Its Client is lazy: while the engine restarts, requests are refused
with EngineUnavailable (HTTP 503) at once, and it re-attaches by itself.

HTTP: the route's POST takes an Open Inference Protocol infer body and is
answered as /v2/models/NAME/infer is, by the HTTP front's own application
(engine.http.front: the same parsing, limits, errors and statuses); GET answers the
model's metadata, GET .../ready and .../config as the protocol's routes do.
Each answer names the engine that served it (header shmbatch-engine).
The handle: infer(x) takes one request's array (or dict of named arrays)
and returns its answer, raising the engine's errors.
"""
import hashlib
import logging
import os
import re
import time
from typing import Any, Optional

import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from engine.client.client import Client
from engine.errors import BackendError, EngineError
from engine.http.front import Front
import engine.ray.owner as owner
from engine.ray.scaling import PREDICTED_WAIT, QUEUE_WAIT, RecentQueueWait
from engine.serving.supervisor import Engine
from engine.shm import liveness

log = logging.getLogger("shmbatch")

ATTACH_TIMEOUT_S = 300.0  # an owner that is ending is asked again until then
DETACH_TIMEOUT_S = 60.0
NODE_ID_CHARS = 10  # of the node id's hex, in the engine's name
MAX_NAME = 64
ENGINE_HEADER = b"shmbatch-engine"


def engine_name(app: str, deployment: str, node_id: str) -> str:
    """The engine of `deployment` of application `app` on node `node_id`:
    nodes may share a host and its /dev/shm, so the node is in the name."""
    prefix = app if deployment in (app, "") else f"{app}.{deployment}"
    prefix = re.sub(r"[^A-Za-z0-9_.-]", "-", prefix)
    room = MAX_NAME - NODE_ID_CHARS - 1
    if len(prefix) > room:  # cut, with a digest so that two long names stay apart
        digest = hashlib.sha1(prefix.encode()).hexdigest()[:8]
        prefix = f"{prefix[:room - 9]}-{digest}"
    return f"{prefix}-{node_id[:NODE_ID_CHARS]}"


class Replica:
    """The deployment's class (engine.ray.deployment binds it)."""

    def __init__(self, model: str, knobs: dict, timeout_s: float) -> None:
        context = serve.get_replica_context()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.engine = engine_name(context.app_name, context.deployment, self.node_id)
        self.key = str(context.replica_id.unique_id)
        self.knobs, self.timeout_s = knobs, timeout_s
        self.owner: Any = None
        self._closed = True  # until attached: nothing to detach
        self._attach()
        self._closed = False
        self.client = Client(self.engine, lazy=True)
        config = Engine(self.engine, **knobs).config  # (no engine is started by this)
        self.app = Front({model: config}, timeout_s=timeout_s, clients={model: self.client})
        self.model = model
        self.queue_wait = RecentQueueWait()

    def _attach(self) -> None:
        """Attaches to the node's owner (created by the node's first replica);
        one that is ending is asked again once it has ended."""
        pid = os.getpid()
        ticks = liveness.start_ticks(pid) or 0
        deadline = time.monotonic() + ATTACH_TIMEOUT_S
        while True:
            handle = owner.NodeOwner.options(
                name=owner.actor_name(self.engine), namespace=owner.NAMESPACE,
                get_if_exists=True, lifetime="detached",
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
            ).remote(self.engine, self.knobs)
            try:
                state = ray.get(handle.attach.remote(self.key, pid, ticks))
            except ray.exceptions.RayActorError:
                state = owner.CLOSING  # it ended meanwhile
            if state != owner.CLOSING:
                self.owner = handle
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {self.engine!r}: its owner kept ending for "
                                   f"{ATTACH_TIMEOUT_S:g} s")
            time.sleep(owner.POLL_S)

    # -- the handle ------------------------------------------------------------------
    async def infer(self, x, timeout_s: Optional[float] = None):
        """One request's answer; the engine's errors as they are raised."""
        try:
            return await self.client.infer_async(x, self.timeout_s if timeout_s is None
                                                 else timeout_s)
        except BackendError as e:  # its arguments are not its message: rebuilt to travel
            raise _Portable(e.exc_type, e.message) from None

    # -- HTTP ----------------------------------------------------------------------
    async def __call__(self, request):
        from starlette.responses import Response
        scope = request.scope
        path = scope["path"]
        root = scope.get("root_path", "")
        rest = path[len(root):] if root and path.startswith(root) else path
        rest = rest.rstrip("/")
        if rest == "" and scope["method"] == "POST":
            rest = "/infer"
        target = f"/v2/models/{self.model}{rest}"
        inner = dict(scope, path=target, raw_path=target.encode(), root_path="")
        sent = {"status": 500, "headers": [], "body": []}

        async def send(message):
            if message["type"] == "http.response.start":
                sent["status"], sent["headers"] = message["status"], list(message["headers"])
            elif message["type"] == "http.response.body":
                sent["body"].append(message.get("body", b""))

        await self.app(inner, request.receive, send)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in sent["headers"]
                   if k != b"content-length"}
        headers[ENGINE_HEADER.decode()] = self.engine
        return Response(b"".join(sent["body"]), status_code=sent["status"], headers=headers)

    # -- Serve's hooks -------------------------------------------------------------
    def record_autoscaling_stats(self) -> dict:
        """The node engine's recent queue wait and predicted wait, in ms (none
        while it does not serve)."""
        try:
            predicted_ms = self.client.predicted_wait_s() * 1e3
            seg = self.client.attached
        except EngineError:
            return {}
        if seg is None:
            return {}
        return {QUEUE_WAIT: self.queue_wait.read_ms(seg), PREDICTED_WAIT: predicted_ms}

    def check_health(self) -> None:
        """Re-attaches if the node's owner is gone (killed): a new one starts
        the engine again."""
        try:
            ray.get(self.owner.status.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            log.warning("engine %s: its owner is gone; attaching to a new one", self.engine)
            self._attach()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            if self.owner is not None:
                ray.get(self.owner.detach.remote(self.key), timeout=DETACH_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            pass  # the owner ended: its engine stopped first
        except Exception as e:
            log.warning("engine %s: detach failed: %s", self.engine, e)
        finally:
            app = getattr(self, "app", None)
            if app is not None:
                app.close()


class _Portable(BackendError):
    """A BackendError that pickles (its message and kind are its arguments)."""

    def __reduce__(self):
        return BackendError, (self.exc_type, self.message)
