"""The Open Inference Protocol (KServe v2 REST, as Triton serves it) for the engines of a serve.

The routes the front (engine.http.front) hands every path but /v1/'s. Each
engine is a model of its own name, reached through its worker's Client
(engine.http.engines). The routes: GET /v2/health/live, /v2/health/ready, /v2, /v2/models/NAME (also
under /versions/1), .../ready, .../config; POST .../infer, and Triton's
generate extension, .../generate and .../generate_stream (engine.http.oip.generate);
Triton's model repository extension, POST /v2/repository/index and
.../models/NAME/load and /unload (engine.http.oip.repository).
Triton's system shared-memory extension under /v2/systemsharedmemory/
(engine.http.oip.sysshm: an infer's inputs read from and outputs written to
registered regions).
Triton's statistics extension, GET .../stats and /v2/models/stats
(engine.http.oip.stats).

As Triton does for a model with max_batch_size > 0, a tensor's first dim
counts requests: an infer of shape [k, *shape] is k engine requests, its
answers stacked in order, and metadata shows that dim as -1. A single-array
engine's tensors are INPUT and OUTPUT. Request parameters take Triton's
meanings: `timeout` in microseconds (0 or absent: the server's default),
`priority` 1 the most urgent, k the engine's level k - 1, 0 or absent the
default (level 0).

An infer whose body comes whole (whole(): a Content-Length within its
limit, no Content-Encoding) is answered by the same route once the server
has read it, with no ASGI message; any other as an ASGI app.

A k-row infer is k requests enqueued from the event loop, each through
the priority shares and admission as a single one is; a refusal of any
withdraws those already enqueued. Its timeout counts from the request's
arrival: the time its body took to come and be parsed is part of it.

Ready (/v2/health/ready, .../ready, the repository index) means that every
engine (that engine) runs and has a live batcher that has loaded its model
(Segment.serves): not while a replacement still loads it.

Every refusal is {"error": "..."}, naming what was expected and what came:
400 a bad body (tensors, datatypes, shapes, sizes, names) or InvalidInput,
checked before its data is converted (engine.http.oip.request); 404 no such
model or route; 413 a body over the limit, derived from the engine unless
http_max_body_bytes sets one (refused from its Content-Length, before it is
read; engine.http.body); 503 QueueFull / Overloaded / EngineUnavailable,
or not ready, with Retry-After (whole seconds, at least 1: the engine's
predicted wait); 504 RequestTimeout; 500 BackendError.
"""
import asyncio
import functools
import json
import logging
import time
from importlib import metadata
from typing import Awaitable, Dict, List, Optional, Tuple, TypeVar

import numpy as np

from engine.batching.policy import FlushRule
from engine.client.client import Client
from engine.config import EngineConfig
from engine.errors import EngineError, EngineUnavailable, QueueFull, RequestTimeout
from engine.http import asgi, body
from engine.http.asgi import Receive, Scope, Send
from engine.http.engines import Engines, answers_of
from engine.http.errors import BadRequest, Disconnected, NotFound, allowed, retry_after, status_of
from engine.http.oip import generate, repository, request, stats, sysshm, tensors
from engine.http.oip.regions import Regions
from engine.http.oip.tensors import datatype_of
from engine.http.server import parsing

log = logging.getLogger("shmbatch")

VERSION = repository.VERSION
RESPONSE_INLINE_VALUES = 4096  # a response of more values in JSON is written in a thread
EXTENSIONS = ("binary_tensor_data", "model_configuration", "model_repository", "generate",
              "system_shared_memory", "statistics")

# a route's answer: status, body, headers
Answer = Tuple[int, bytes, List[Tuple[bytes, bytes]]]
T = TypeVar("T")


class Model:
    """One engine as the protocol shows it: its tensors by their protocol
    names, and its requests."""

    def __init__(self, name: str, config: EngineConfig, client: Client) -> None:
        self.name, self.config, self.client = name, config, client
        self.inputs = [(spec.name or "INPUT", spec) for spec in config.input_specs]
        self.outputs = [(spec.name or "OUTPUT", spec) for spec in config.output_specs]
        self.spec = request.spec_of(name, config)  # ValueError for a dtype the protocol lacks
        self.json_limits: Dict[tuple, tuple] = {}  # (rows, explicit) -> a JSON body's limit
        self.in_flight = 0  # requests awaiting the engine (infer)
        # a batcher woken early with nothing to claim sleeps again at once without its idle spin
        self.wakes_early = FlushRule.of(config).idle_spin_ns > 0

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
        order (engine.http.engines.answers_of: refused one, withdrawn all)."""
        c = self.client
        self.in_flight += 1
        try:
            if k == 1 and not self.config.named:  # the common case, without a stack
                return [(await c.infer_async(arrays[0][0], timeout_s, priority=priority))[None]]
            specs = [spec for _, spec in self.inputs]
            if self.config.named:
                rows = [{s.name: a[i] for s, a in zip(specs, arrays)} for i in range(k)]
            else:
                rows = list(arrays[0])
            if k == 1:
                answers: list = [await c.infer_async(rows[0], timeout_s, priority=priority)]
            else:
                answers = await answers_of(c, rows, timeout_s, priority)
        finally:
            self.in_flight -= 1
        if not self.config.named:
            return [np.stack(answers)]
        return [np.stack([a[spec.name] for a in answers]) for _, spec in self.outputs]

    def expect(self) -> None:
        """Wakes a sleeping batcher as a request begins to be read, when no
        other request of this worker awaits the engine: its wake-up (tens of
        µs on a VM) then overlaps the body's reading and parsing rather than
        following the enqueue, and the client's first look finds the answer.
        With others in flight the worker's loop has their work between this
        and the enqueue, and an early batcher would spin through it; an
        awake batcher costs the hint one load. None where the batcher does
        not spin (one CPU): it would sleep again before the request came."""
        seg = self.client.attached
        if seg is not None and not self.in_flight and self.wakes_early:
            seg.ring.expect_work()

    def engine_priority(self, triton_priority) -> int:
        return request.engine_priority(self.spec, triton_priority)

    def body_limit(self, header_length: Optional[str], rows: int, explicit: Optional[int]):
        """(the most bytes a body may have, what the limit is made of); a JSON
        body's worked out once."""
        if header_length is not None:
            return request.body_limit(self.spec, header_length, rows, explicit)
        limit = self.json_limits.get((rows, explicit))
        if limit is None:
            limit = self.json_limits[(rows, explicit)] = request.body_limit(
                self.spec, None, rows, explicit)
        return limit



@functools.lru_cache(maxsize=None)
def server_version() -> str:
    """The installed package's version (read once), both protocols' metadata's."""
    try:
        return metadata.version("shmbatch")
    except metadata.PackageNotFoundError:
        return "unknown"

class App:
    """The protocol's routes over `engines`, as an ASGI app (the front
    handles the lifespan); regions_fd: the table of shared-memory regions
    every worker of a serve shares (None: this app's own)."""

    def __init__(self, engines: Engines, parser: parsing.Parser,
                 regions_fd: Optional[int] = None) -> None:
        self.engines, self.parser = engines, parser
        self.models: Dict[str, Model] = {}
        self.regions = Regions(regions_fd, lambda: list(engines.configs))

    def close(self) -> None:
        self.regions.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            answered = await self._route(scope, receive, send)
            if answered is None:  # a stream, written as it came
                return
        except Disconnected:
            return
        except body.Refused as e:  # answered, then the rest of its body read and dropped
            return await body.refuse(scope, receive, send, _error(str(e)), e)
        except Exception as e:
            answered = _failed(scope, e)
        await asgi.send_whole(send, *_typed(answered))

    def whole(self, scope: Scope) -> Optional[asgi.WholeAnswer]:
        """The answer to an infer request once its body has come whole, as
        __call__ answers it (its errors included); None for any other route,
        a model this worker does not serve now, or a body __call__ refuses
        before it has come (a Content-Length over the limit, a
        Content-Encoding: its decoded bytes are counted as they come)."""
        parts = scope["path"].split("/")  # "", "v2", "models", NAME, ["versions", "1",] "infer"
        if len(parts) == 7 and parts[4:6] == ["versions", VERSION]:
            del parts[4:6]
        if len(parts) != 5 or parts[:3] != ["", "v2", "models"] or parts[4] != "infer" or \
                scope["method"] != "POST" or parts[3] not in self.engines.configs:
            return None
        try:
            model = self.model(parts[3])
        except (EngineError, BadRequest):  # __call__ refuses it, before its body is read
            return None
        limit, _ = model.body_limit(asgi.header(scope, b"inference-header-content-length"),
                                    model.spec.capacity, self.engines.max_body_bytes)
        if not body.whole_within(scope, limit):
            return None
        # the request's timeout counts from its arrival, not from its body's end
        return functools.partial(self._answer_whole, model, scope, time.monotonic())

    async def _answer_whole(self, model: Model, scope: Scope, arrived: float,
                            raw: bytes) -> Answer:
        async def receive() -> asgi.Message:
            return {"type": "http.request", "body": raw, "more_body": False}
        try:  # whole() took only a body that read() refuses none of
            answered = await self._retried(model, self._infer(model, scope, receive, arrived))
        except Exception as e:
            answered = _failed(scope, e)
        return _typed(answered)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> Optional[Answer]:
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
            allowed(method, "POST")
            return _json(await repository.index(self.engines, scope, receive))
        if parts[:2] == ["repository", "models"] and len(parts) == 4 and \
                parts[3] in ("load", "unload"):
            allowed(method, "POST")
            await repository.control(self.engines, parts[2], parts[3], scope, receive)
            return 200, b"", []
        if parts[0] == "systemsharedmemory":
            answer = await sysshm.route(self.regions, parts[1:], method, scope, receive)
            return (200, b"", []) if answer is None else _json(answer)
        if len(parts) < 2 or parts[0] != "models":
            raise NotFound(f"no route {path}")
        if parts == ["models", "stats"]:  # every engine's (as Triton, before a model's route)
            return _get(method, self._all_stats)
        model, rest = self.model(parts[1]), parts[2:]
        return await self._retried(model, self._model_route(model, rest, method, scope,
                                                            receive, send))

    async def _retried(self, model: Model, answer: Awaitable[T]) -> T:
        """The route's answer; a 503 refusal of the engine says when to try again."""
        try:
            return await answer
        except (QueueFull, EngineUnavailable) as e:
            if not hasattr(e, "retry_after_s"):
                e.retry_after_s = self.engines.retry_after_s(model.name, e)  # type: ignore
            raise

    async def _model_route(self, model: Model, rest: List[str], method: str, scope: Scope,
                           receive: Receive, send: Send) -> Optional[Answer]:
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
        if rest == ["stats"]:
            return _get(method, lambda: {"model_stats": [
                stats.model_stat(model.name, VERSION, self.engines.segment(model.name))]})
        if rest == ["infer"]:
            allowed(method, "POST")
            return await self._infer(model, scope, receive, time.monotonic())
        if rest in (["generate"], ["generate_stream"]):
            allowed(method, "POST")
            engines = self.engines
            raw = await body.read(scope, receive,
                                  *model.body_limit(None, 1, engines.max_body_bytes))
            if rest == ["generate"]:
                return await generate.generate(model, raw, engines.timeout_s, receive)
            await generate.generate_stream(model, raw, engines.timeout_s, scope, receive, send)
            return None
        raise NotFound(f"no route {path}")

    def model(self, name: str) -> Model:
        """The model of that name (NotFound if no engine has it now), made
        anew when its engine was loaded again; the gRPC service's too."""
        model = self.models.get(name)
        config = self.engines.configs.get(name)
        if model is None or model.config is not config:  # loaded again, or unloaded
            if config is None:
                self.models.pop(name, None)
                raise NotFound(f"Request for unknown model: {name!r} is not found; this "
                               f"server has {sorted(self.engines.configs)}")
            model = self.models[name] = Model(name, config, self.engines.client(name))
        return model

    def _server_metadata(self) -> dict:
        return {"name": "shmbatch", "version": server_version(), "extensions": list(EXTENSIONS)}

    def _server_ready(self) -> dict:
        for name in self.engines.counted():
            self.engines.ready(name)
        return {"ready": True}

    def _model_ready(self, model: Model) -> dict:
        self.engines.ready(model.name)
        return {"name": model.name, "ready": True}

    def _all_stats(self) -> dict:
        """Every running engine's statistics, by name (one that does not run
        has none to show, as Triton shows only the models it has loaded)."""
        found = []
        for name in sorted(self.engines.configs):
            try:
                found.append(stats.model_stat(name, VERSION, self.engines.segment(name)))
            except EngineUnavailable:
                continue
        return {"model_stats": found}

    async def _infer(self, model: Model, scope: Scope, receive: Receive,
                     arrived: float) -> Answer:
        """The infer's answer; arrived: when its head came (time.monotonic()),
        which its timeout counts from."""
        if model.config.iterative:  # answers of any length: no [k, ...] tensor holds them
            raise BadRequest(f"model {model.name!r} is iterative: expected POST "
                             f"/v2/models/{model.name}/generate or generate_stream, got infer")
        engines = self.engines
        header_length = asgi.header(scope, b"inference-header-content-length")
        limit, why = model.body_limit(header_length, model.spec.capacity, engines.max_body_bytes)
        model.expect()  # its batcher's wake-up overlaps the body's reading and parsing
        raw = await body.read(scope, receive, limit, why)
        parsed = await self.parser.parse(_size(raw, header_length), request.parse_infer, raw,
                                         header_length, model.spec, engines.timeout_s)
        del raw
        arrays = parsed.arrays
        shared_memory = parsed.shared_memory
        if shared_memory:
            arrays = await sysshm.read_inputs(self.regions, model, parsed)
        left_s = parsed.timeout_s - (time.monotonic() - arrived)
        if left_s <= 0:
            raise RequestTimeout(f"expected an answer within {parsed.timeout_s:g} s of the "
                                 f"request's arrival, got none: its body took that long to "
                                 f"come and be read (nothing was enqueued)")
        try:
            answers = await model.infer(arrays, parsed.k, left_s, parsed.priority)
        except QueueFull as e:
            e.retry_after_s = engines.retry_after_s(model.name, e, parsed.priority)  # type: ignore
            raise
        outputs = [(name, answers[i], b) for i, name, b in parsed.wanted]
        if shared_memory:
            outputs = await sysshm.write_outputs(self.regions, outputs)
        if sum(a.size for _, a, b in outputs if not b) > RESPONSE_INLINE_VALUES:
            out, json_length = await asyncio.to_thread(
                tensors.response, model.name, parsed.request_id, outputs)
        else:
            out, json_length = tensors.response(model.name, parsed.request_id, outputs)
        if json_length is None:
            return 200, out, []
        return 200, out, [(b"content-type", b"application/octet-stream"),
                          (b"inference-header-content-length", str(json_length).encode())]


def _size(raw: bytes, header_length: Optional[str]) -> int:
    """What a body costs to parse: its JSON's bytes (binary data is not parsed)."""
    try:
        return int(header_length) if header_length is not None else len(raw)
    except ValueError:
        return len(raw)


def _failed(scope: Scope, e: Exception) -> Answer:
    """The answer to a request that failed with e: its status and {"error"}."""
    headers: List[Tuple[bytes, bytes]] = []
    if isinstance(e, BadRequest):
        status, out, headers = e.status, _error(str(e)), list(e.headers)
    elif isinstance(e, EngineError):
        status = status_of(e)
        out = _error(f"{type(e).__name__}: {e}")
        if status == 503:
            headers = retry_after(getattr(e, "retry_after_s", 1))
    elif isinstance(e, parsing.ParseFailed):
        log.warning("%s %s: %s", scope["method"], scope["path"], e)
        status, out = 500, _error(f"ParseFailed: {e}")
    else:
        log.error("%s %s failed", scope["method"], scope["path"], exc_info=e)
        status, out = 500, _error(f"{type(e).__name__}: {e}")
    return status, out, headers


def _typed(answer: Answer) -> Answer:
    """The answer with its content-type: JSON unless the route named another."""
    status, out, headers = answer
    if not any(name == b"content-type" for name, _ in headers):
        headers = [*headers, asgi.JSON]
    return status, out, headers


def _get(method: str, make) -> Answer:
    allowed(method, "GET")
    return _json(make())


def _json(value) -> Answer:
    return 200, json.dumps(value).encode(), []


def _error(message: str) -> bytes:
    return json.dumps({"error": message}).encode()
