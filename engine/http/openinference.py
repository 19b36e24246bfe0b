"""The Open Inference Protocol (KServe v2 REST, as Triton serves it) for the engines of a serve.

An ASGI application, run by each HTTP worker process of `shmbatch serve
--http-port` (engine.http.workers) and usable under any ASGI server. Each
engine is a model of its own name, reached through one Client per worker
process, so the requests of every worker batch together in its queue. The
routes: GET /v2/health/live, /v2/health/ready, /v2, /v2/models/NAME (also
under /versions/1), .../ready, .../config; POST .../infer, and Triton's
generate extension, .../generate and .../generate_stream (engine.http.oip_generate);
POST /v2/repository/index.

As Triton does for a model with max_batch_size > 0, a tensor's first dim
counts requests: an infer of shape [k, *shape] is k engine requests, its
answers stacked in order, and metadata shows that dim as -1. A single-array
engine's tensors are INPUT and OUTPUT. Request parameters take Triton's
meanings: `timeout` in microseconds (0 or absent: the server's default),
`priority` 1 the most urgent, k the engine's level k - 1, 0 or absent the
default (level 0).

A k-row infer is k requests enqueued from the event loop, each through
the priority shares and admission as a single one is; a refusal of any
withdraws those already enqueued. Its timeout counts from the request's
arrival: the time its body took to come and be parsed is part of it.

Ready (/v2/health/ready, .../ready, the repository index) means that every
engine (that engine) runs and has a live batcher that has loaded its model
(Segment.serves): not while a replacement still loads it.

Every refusal is {"error": "..."}, naming what was expected and what came:
400 a bad body (tensors, datatypes, shapes, sizes, names) or InvalidInput,
checked before its data is converted (engine.http.oip_request); 404 no such
model or route; 413 a body over the limit, derived from the engine unless
http_max_body_bytes sets one (refused from its Content-Length, before it is
read; engine.http.oip_body); 503 QueueFull / Overloaded / EngineUnavailable,
or not ready, with Retry-After (whole seconds, at least 1: the engine's
predicted wait); 504 RequestTimeout; 500 BackendError.
"""
import asyncio
import json
import logging
import math
import time
from typing import Dict, List, Optional

import numpy as np

from engine.client import tracing
from engine.client.client import Client
from engine.config import EngineConfig
from engine.errors import (
    BackendError,
    EngineError,
    EngineUnavailable,
    InvalidInput,
    Overloaded,
    QueueFull,
    RequestTimeout,
)
from engine.http import oip_body, oip_generate, oip_request, oip_tensors, openai_app, parsing
from engine.http.oip_tensors import BadRequest, datatype_of

log = logging.getLogger("shmbatch")

DEFAULT_TIMEOUT_S = 30.0
VERSION = "1"  # every engine is one model of one version
RESPONSE_INLINE_VALUES = 4096  # a response of more values in JSON is written in a thread
EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository", "generate")

# the first class an error is an instance of decides its status
STATUS = ((InvalidInput, 400), (QueueFull, 503), (EngineUnavailable, 503),
          (RequestTimeout, 504), (BackendError, 500), (EngineError, 500))


class NotFound(BadRequest):
    def __init__(self, message: str) -> None:
        super().__init__(message, 404)


class Model:
    """One engine as the protocol shows it: its tensors by their protocol
    names, and its requests."""

    def __init__(self, name: str, config: EngineConfig, client: Client) -> None:
        self.name, self.config, self.client = name, config, client
        self.inputs = [(spec.name or "INPUT", spec) for spec in config.input_specs]
        self.outputs = [(spec.name or "OUTPUT", spec) for spec in config.output_specs]
        self.spec = oip_request.spec_of(name, config)  # ValueError for a dtype the protocol lacks
        self.json_limits: Dict[tuple, tuple] = {}  # (rows, explicit) -> a JSON body's limit

    def metadata(self) -> dict:
        def tensor(name, spec):
            return {"name": name, "datatype": datatype_of(spec.dtype),
                    "shape": [-1] + [-1 if d is None else d for d in spec.shape]}
        return {"name": self.name, "versions": [VERSION], "platform": "shmbatch",
                "inputs": [tensor(*t) for t in self.inputs],
                "outputs": [tensor(*t) for t in self.outputs]}

    def triton_config(self) -> dict:
        """The model configuration as Triton's client tools read it; a scalar
        per request is dims [1] reshaped to [], as Triton writes it."""
        def tensor(name, spec):
            entry = {"name": name, "data_type": "TYPE_" + datatype_of(spec.dtype),
                     "dims": [-1 if d is None else d for d in spec.shape] or [1]}
            if not spec.shape:
                entry["reshape"] = {"shape": []}
            return entry
        c = self.config
        return {"name": self.name, "platform": "shmbatch", "max_batch_size": c.max_batch_size,
                "input": [tensor(*t) for t in self.inputs],
                "output": [tensor(*t) for t in self.outputs],
                "dynamic_batching": {"max_queue_delay_microseconds": int(c.max_delay_ms * 1000),
                                     "priority_levels": c.priority_levels}}

    async def infer(self, arrays, k: int, timeout_s: float, priority: int) -> List[np.ndarray]:
        """The k requests' answers, each output stacked [k, *shape], in spec
        order. Each request is enqueued here, on the event loop, as a single
        one is (priority shares, admission); if one is refused, those
        enqueued before it are withdrawn."""
        c = self.client
        if k == 1 and not self.config.named:  # the common case, without a stack
            return [(await c.infer_async(arrays[0][0], timeout_s, priority=priority))[None]]
        specs = [spec for _, spec in self.inputs]
        if self.config.named:
            rows = [{s.name: a[i] for s, a in zip(specs, arrays)} for i in range(k)]
        else:
            rows = list(arrays[0])
        if k == 1:
            answers = [await c.infer_async(rows[0], timeout_s, priority=priority)]
        else:
            sent = []
            try:
                for row in rows:
                    sent.append(c.submit(row, timeout_s, priority=priority))
                answers = await asyncio.gather(*(asyncio.wrap_future(f) for f in sent))
            except BaseException:
                for f in sent:
                    f.cancel()  # withdrawn, unless a batch answered it already
                raise
        if not self.config.named:
            return [np.stack(answers)]
        return [np.stack([a[spec.name] for a in answers]) for _, spec in self.outputs]

    def engine_priority(self, triton_priority) -> int:
        return oip_request.engine_priority(self.spec, triton_priority)

    def body_limit(self, header_length: Optional[str], rows: int, explicit: Optional[int]):
        """(the most bytes a body may have, what the limit is made of); a JSON
        body's worked out once."""
        if header_length is not None:
            return oip_request.body_limit(self.spec, header_length, rows, explicit)
        limit = self.json_limits.get((rows, explicit))
        if limit is None:
            limit = self.json_limits[(rows, explicit)] = oip_request.body_limit(
                self.spec, None, rows, explicit)
        return limit

    def retry_after_s(self, error: EngineError, priority: int = 0) -> int:
        """A 503's Retry-After: the engine's predicted wait, whole seconds, >= 1."""
        wait_s = 1.0
        if isinstance(error, Overloaded) and error.predicted_wait_ms:
            wait_s = error.predicted_wait_ms / 1000
        elif isinstance(error, QueueFull):
            try:
                wait_s = self.client.predicted_wait_s(priority)
            except EngineError:
                pass
        return max(1, math.ceil(wait_s))


class App:
    """The ASGI application of one HTTP worker: the protocol's routes for
    the engines `configs` names. Its Clients attach at the lifespan's startup
    (or at the first request, under a server without lifespan events)."""

    def __init__(self, configs: Dict[str, EngineConfig], timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_body_bytes: Optional[int] = None, on_ready=None,
                 openai: Optional[Dict[str, dict]] = None) -> None:
        self.configs, self.timeout_s = configs, timeout_s
        # None: each model's limit derived from its engine (engine.http.oip_request)
        self.max_body_bytes = max_body_bytes
        # /v1/...: the OpenAI API, for the engines that have an openai table
        self.openai = openai_app.OpenAIApp(self, openai) if openai else None
        self.on_ready = on_ready
        self.parser = parsing.Parser()
        self.models: Dict[str, Model] = {}
        self.startup_error: Optional[str] = None  # why the lifespan's startup failed

    def open(self) -> None:
        """A Client of each engine (EngineUnavailable if one is not running)."""
        if not self.models:
            self.models = {name: Model(name, config, Client(name))
                           for name, config in self.configs.items()}

    def close(self) -> None:
        models, self.models = self.models, {}
        for model in models.values():
            model.client.close()
        self.parser.close()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return  # websockets are not served
        token = tracing.continued(scope["headers"])  # the caller's traceparent, when tracing
        try:
            return await self._http(scope, receive, send)
        finally:
            if token is not None:
                tracing.detach(token)

    async def _http(self, scope, receive, send) -> None:
        if self.openai is not None and scope["path"].startswith("/v1/"):
            return await self.openai(scope, receive, send)
        headers = []
        try:
            answered = await self._route(scope, receive, send)
            if answered is None:  # a stream, written as it came
                return
            status, body, headers = answered
        except oip_body.Disconnected:
            return
        except oip_body.TooLarge as e:  # answered, then the rest of its body read and dropped
            return await oip_body.refuse(scope, receive, send, e)
        except BadRequest as e:
            status, body = e.status, _error(str(e))
        except EngineError as e:
            status = next(code for kind, code in STATUS if isinstance(e, kind))
            body = _error(f"{type(e).__name__}: {e}")
            if status == 503:
                seconds = getattr(e, "retry_after_s", 1)
                headers = [(b"retry-after", str(seconds).encode())]
        except parsing.ParseFailed as e:
            log.warning("%s %s: %s", scope["method"], scope["path"], e)
            status, body = 500, _error(f"ParseFailed: {e}")
        except Exception as e:
            log.exception("%s %s failed", scope["method"], scope["path"])
            status, body = 500, _error(f"{type(e).__name__}: {e}")
        if not any(name == b"content-type" for name, _ in headers):
            headers.append((b"content-type", b"application/json"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.open()
                except Exception as e:
                    self.startup_error = f"{type(e).__name__}: {e}"
                    await send({"type": "lifespan.startup.failed",
                                "message": self.startup_error})
                    return
                await send({"type": "lifespan.startup.complete"})
                if self.on_ready is not None:
                    self.on_ready()
            elif message["type"] == "lifespan.shutdown":
                self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, scope, receive, send):
        """(status, body, headers) of the request; None once a route has
        written its answer itself."""
        method, path = scope["method"], scope["path"]
        parts = path.strip("/").split("/")
        if parts[0] != "v2":
            raise NotFound(f"no route {path}: expected /v2/...")
        parts = parts[1:]
        if parts == []:
            return _get(method, self._server_metadata)
        if parts == ["health", "live"]:
            return _get(method, lambda: {"live": True})
        if parts == ["health", "ready"]:
            return _get(method, self._server_ready)
        if parts == ["repository", "index"]:
            return _allowed(method, "POST") or _json(self._index())
        if len(parts) < 2 or parts[0] != "models":
            raise NotFound(f"no route {path}")
        model, rest = self._model(parts[1]), parts[2:]
        try:
            return await self._model_route(model, rest, method, scope, receive, send)
        except (QueueFull, EngineUnavailable) as e:  # 503: when to try again
            if not hasattr(e, "retry_after_s"):
                e.retry_after_s = model.retry_after_s(e)
            raise

    async def _model_route(self, model: Model, rest: List[str], method: str, scope, receive,
                           send):
        path = scope["path"]
        if rest[:1] == ["versions"]:
            if rest[1:2] != [VERSION]:
                raise NotFound(f"model {model.name!r}: expected version {VERSION}, got "
                               f"{'/'.join(rest[1:2]) or 'none'}")
            rest = rest[2:]
        if rest == []:
            return _get(method, model.metadata)
        if rest == ["ready"]:
            return _get(method, lambda: self._model_ready(model))
        if rest == ["config"]:
            return _get(method, model.triton_config)
        if rest == ["infer"]:
            return _allowed(method, "POST") or await self._infer(model, scope, receive)
        if rest in (["generate"], ["generate_stream"]):
            refused = _allowed(method, "POST")
            if refused:
                return refused
            body = await oip_body.read(scope, receive,
                                       *model.body_limit(None, 1, self.max_body_bytes))
            if rest == ["generate"]:
                return await oip_generate.generate(model, body, self.timeout_s, receive)
            return await oip_generate.generate_stream(model, body, self.timeout_s, scope, receive,
                                                      send)
        raise NotFound(f"no route {path}")

    def _model(self, name: str) -> Model:
        self.open()
        model = self.models.get(name)
        if model is None:
            raise NotFound(f"unknown model {name!r}; this server has {sorted(self.models)}")
        return model

    def _server_metadata(self) -> dict:
        from importlib import metadata
        try:
            version = metadata.version("shmbatch")
        except metadata.PackageNotFoundError:
            version = "unknown"
        return {"name": "shmbatch", "version": version, "extensions": list(EXTENSIONS)}

    def _server_ready(self) -> dict:
        self.open()
        for model in self.models.values():
            self._model_ready(model)
        return {"ready": True}

    @staticmethod
    def _model_ready(model: Model) -> dict:
        """EngineUnavailable (503) unless the engine runs and a live batcher
        that has loaded its model serves it."""
        model.client.predicted_wait_s()  # attached (again, after a restart) and running
        seg = model.client.attached
        if seg is None or not seg.serves():
            raise EngineUnavailable(f"model {model.name!r} is not ready: expected a live "
                                    f"batcher that has loaded its model, got none (the engine "
                                    f"starts, or replaces a batcher)")
        return {"name": model.name, "ready": True}

    def _index(self) -> list:
        self.open()
        states = []
        for name, model in sorted(self.models.items()):
            try:
                self._model_ready(model)
                states.append({"name": name, "version": VERSION, "state": "READY"})
            except EngineUnavailable as e:
                states.append({"name": name, "version": VERSION, "state": "UNAVAILABLE",
                               "reason": str(e)})
        return states

    async def _infer(self, model: Model, scope, receive):
        arrived = time.monotonic()  # the request's timeout counts from here
        if model.config.iterative:  # answers of any length: no [k, ...] tensor holds them
            raise BadRequest(f"model {model.name!r} is iterative: expected POST "
                             f"/v2/models/{model.name}/generate or generate_stream, got infer")
        header_length = oip_body.header(scope, b"inference-header-content-length")
        limit, why = model.body_limit(header_length, model.spec.capacity, self.max_body_bytes)
        body = await oip_body.read(scope, receive, limit, why)
        parsed = await self.parser.parse(body, header_length, model.spec, self.timeout_s)
        del body
        left_s = parsed.timeout_s - (time.monotonic() - arrived)
        if left_s <= 0:
            raise RequestTimeout(f"expected an answer within {parsed.timeout_s:g} s of the "
                                 f"request's arrival, got none: its body took that long to "
                                 f"come and be read (nothing was enqueued)")
        try:
            answers = await model.infer(parsed.arrays, parsed.k, left_s, parsed.priority)
        except QueueFull as e:
            e.retry_after_s = model.retry_after_s(e, parsed.priority)
            raise
        outputs = [(name, answers[i], b) for i, name, b in parsed.wanted]
        if sum(a.size for _, a, b in outputs if not b) > RESPONSE_INLINE_VALUES:
            out, json_length = await asyncio.to_thread(
                oip_tensors.response, model.name, parsed.request_id, outputs)
        else:
            out, json_length = oip_tensors.response(model.name, parsed.request_id, outputs)
        if json_length is None:
            return 200, out, []
        return 200, out, [(b"content-type", b"application/octet-stream"),
                          (b"inference-header-content-length", str(json_length).encode())]


def _get(method: str, make):
    return _allowed(method, "GET") or _json(make())


def _allowed(method: str, allowed: str):
    """None when method is the route's, else the 405 answer."""
    if method == allowed:
        return None
    return 405, _error(f"expected {allowed}, got {method}"), [(b"allow", allowed.encode())]


def _json(value):
    return 200, json.dumps(value).encode(), []


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
