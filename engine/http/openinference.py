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

Every refusal is {"error": "..."}, naming what was expected and what came:
400 a bad body (tensors, datatypes, shapes, sizes, names) or InvalidInput,
404 no such model or route, 413 a body over the limit (refused from its
Content-Length, before it is read), 503 QueueFull / Overloaded /
EngineUnavailable, 504 RequestTimeout, 500 BackendError.
"""
import asyncio
import functools
import json
import logging
from typing import Dict, List, Optional

import numpy as np

from engine.client.client import Client
from engine.config import EngineConfig
from engine.errors import (
    BackendError,
    EngineError,
    EngineUnavailable,
    InvalidInput,
    QueueFull,
    RequestTimeout,
)
from engine.http import oip_generate, oip_tensors
from engine.http.oip_tensors import BadRequest, datatype_of, json_text

log = logging.getLogger("shmbatch")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_BODY_BYTES = 64 << 20
VERSION = "1"  # every engine is one model of one version
EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository", "generate")

# the first class an error is an instance of decides its status
STATUS = ((InvalidInput, 400), (QueueFull, 503), (EngineUnavailable, 503),
          (RequestTimeout, 504), (BackendError, 500), (EngineError, 500))


class NotFound(BadRequest):
    def __init__(self, message: str) -> None:
        super().__init__(message, 404)


class _Disconnected(Exception):
    """The caller went away before its body came: nobody to answer."""


class Model:
    """One engine as the protocol shows it: its tensors by their protocol
    names, and its requests."""

    def __init__(self, name: str, config: EngineConfig, client: Client) -> None:
        self.name, self.config, self.client = name, config, client
        self.inputs = [(spec.name or "INPUT", spec) for spec in config.input_specs]
        self.outputs = [(spec.name or "OUTPUT", spec) for spec in config.output_specs]
        # ValueError for a dtype the protocol has none for
        self.datatypes = {name: datatype_of(spec.dtype) for name, spec in self.inputs + self.outputs}

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

    def requests(self, tensors: List[oip_tensors.Tensor]):
        """(k, the input arrays [k, *shape] in spec order) of the request's
        tensors, each checked against its engine tensor."""
        names = [name for name, _ in self.inputs]
        given = {t.name: t for t in tensors}
        if sorted(given) != sorted(names) or len(given) != len(tensors):
            raise BadRequest(f"model {self.name!r}: expected inputs {names}, got "
                             f"{[t.name for t in tensors]}")
        k, arrays = None, []
        for name, spec in self.inputs:
            t = given[name]
            want = self.datatypes[name]
            if t.datatype != want:
                raise BadRequest(f"input {name!r}: expected datatype {want}, got {t.datatype}")
            dims = zip(t.shape[1:], spec.shape, spec.max_shape)
            if len(t.shape) != len(spec.shape) + 1 or t.shape[0] < 1 or not all(
                    got == d if d is not None else 1 <= got <= bound for got, d, bound in dims):
                bounds = ", ".join(f"1..{b}" if d is None else str(d)
                                   for d, b in zip(spec.shape, spec.max_shape))
                raise BadRequest(f"input {name!r}: expected shape [k{', ' if bounds else ''}"
                                 f"{bounds}] (k >= 1 requests), got {list(t.shape)}")
            if k is not None and t.shape[0] != k:
                raise BadRequest(f"input {name!r}: expected {k} requests in its first dim, as "
                                 f"input {names[0]!r} has, got {t.shape[0]}")
            k = t.shape[0]
            arrays.append(t.array)
        if k > self.config.queue_capacity:
            raise BadRequest(f"expected at most {self.config.queue_capacity} requests (the "
                             f"engine's queue_capacity) in one infer, got {k}")
        return k, arrays

    def wanted(self, request: dict, binary_default: bool):
        """(output index, protocol name, binary) of each output asked for."""
        index = {name: i for i, (name, _) in enumerate(self.outputs)}
        asked = request.get("outputs")
        if asked is None:
            return [(i, name, binary_default) for name, i in index.items()]
        if not isinstance(asked, list):
            raise BadRequest(f"\"outputs\": expected a list of {{\"name\"}} objects, got "
                             f"{json_text(asked)}")
        out = []
        for obj in asked:
            name = obj.get("name") if isinstance(obj, dict) else None
            if name not in index:
                raise BadRequest(f"model {self.name!r}: expected outputs among "
                                 f"{list(index)}, got {json_text(name or obj)}")
            params = oip_tensors.parameters(obj, f"output {name!r}", ("binary_data",))
            binary = params.get("binary_data", binary_default)
            if not isinstance(binary, bool):
                raise BadRequest(f"output {name!r}: binary_data: expected true or false, got "
                                 f"{json_text(binary)}")
            out.append((index[name], name, binary))
        return out

    async def infer(self, arrays, k: int, timeout_s: float, priority: int) -> List[np.ndarray]:
        """The k requests' answers, each output stacked [k, *shape], in spec order."""
        c = self.client
        if not self.config.named:
            if k == 1:
                return [(await c.infer_async(arrays[0][0], timeout_s, priority=priority))[None]]
            bulk = functools.partial(c.infer_many, arrays[0], timeout_s, priority=priority)
            return [await asyncio.get_running_loop().run_in_executor(None, bulk)]
        specs = [spec for _, spec in self.inputs]
        answers = await asyncio.gather(
            *(c.infer_async({s.name: a[i] for s, a in zip(specs, arrays)}, timeout_s,
                           priority=priority)
              for i in range(k)), return_exceptions=True)
        for a in answers:
            if isinstance(a, BaseException):
                raise a
        return [np.stack([a[spec.name] for a in answers]) for _, spec in self.outputs]

    def engine_priority(self, triton_priority) -> int:
        levels = self.config.priority_levels
        if type(triton_priority) is not int or not 0 <= triton_priority <= levels:
            raise BadRequest(f"priority: expected 0 (the default) or 1..{levels} (1 the most "
                             f"urgent: model {self.name!r} has {levels} level(s)), got "
                             f"{json_text(triton_priority)}")
        return max(0, triton_priority - 1)


class App:
    """The ASGI application of one HTTP worker: the protocol's routes for
    the engines `configs` names. Its Clients attach at the lifespan's startup
    (or at the first request, under a server without lifespan events)."""

    def __init__(self, configs: Dict[str, EngineConfig], timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_ready=None) -> None:
        self.configs, self.timeout_s, self.max_body_bytes = configs, timeout_s, max_body_bytes
        self.on_ready = on_ready
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

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return  # websockets are not served
        headers = []
        try:
            answered = await self._route(scope, receive, send)
            if answered is None:  # a stream, written as it came
                return
            status, body, headers = answered
        except _Disconnected:
            return
        except BadRequest as e:
            status, body = e.status, _error(str(e))
            if e.status == 413:  # the rest of its body is not read: no next request on it
                headers = [(b"connection", b"close")]
        except EngineError as e:
            status = next(code for kind, code in STATUS if isinstance(e, kind))
            body = _error(f"{type(e).__name__}: {e}")
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
            body = await _read_body(scope, receive, self.max_body_bytes)
            if rest == ["generate"]:
                return await oip_generate.generate(model, body, self.timeout_s, receive)
            return await oip_generate.generate_stream(model, body, self.timeout_s, receive, send)
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
        # EngineUnavailable (503) unless a request could be enqueued now
        model.client.predicted_wait_s()
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
        if model.config.iterative:  # answers of any length: no [k, ...] tensor holds them
            raise BadRequest(f"model {model.name!r} is iterative: expected POST "
                             f"/v2/models/{model.name}/generate or generate_stream, got infer")
        body = await _read_body(scope, receive, self.max_body_bytes)
        request, binary = oip_tensors.split(body, _header(scope, b"inference-header-content-length"))
        params = oip_tensors.parameters(request, "request",
                                        ("timeout", "priority", "binary_data_output"))
        timeout_s = oip_tensors.timeout_s(params.get("timeout", 0), self.timeout_s)
        priority = model.engine_priority(params.get("priority", 0))
        binary_default = params.get("binary_data_output", False)
        if not isinstance(binary_default, bool):
            raise BadRequest(f"binary_data_output: expected true or false, got "
                             f"{json_text(binary_default)}")
        wanted = model.wanted(request, binary_default)
        k, arrays = model.requests(oip_tensors.read_inputs(request, binary))
        answers = await model.infer(arrays, k, timeout_s, priority)
        out, json_length = oip_tensors.response(
            model.name, request.get("id"), [(name, answers[i], b) for i, name, b in wanted])
        if json_length is None:
            return 200, out, []
        return 200, out, [(b"content-type", b"application/octet-stream"),
                          (b"inference-header-content-length", str(json_length).encode())]


def _header(scope, name: bytes) -> Optional[str]:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def _read_body(scope, receive, limit: int) -> bytes:
    """The request's body; 413 before reading it when its Content-Length is
    over the limit, and as soon as what came is."""
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"expected a body of at most {limit} bytes (http_max_body_bytes), "
                         f"got Content-Length {declared}", 413)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"expected a body of at most {limit} bytes (http_max_body_bytes), "
                             f"got more", 413)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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
