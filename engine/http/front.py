"""The HTTP front: one ASGI app that holds the engines' Clients and mounts each protocol.

Run by each HTTP worker process of `shmbatch serve --http-port`
(engine.http.worker), usable under any ASGI server, and by Ray
Serve's replicas (engine.ray). Paths under /v1/ (and /rerank) go to the OpenAI API
(engine.http.openai), for the engines that have an openai table; every
other path to the Open Inference Protocol (engine.http.oip). Both reach
the engines through one Engines (engine.http.engines), so the requests of
both protocols batch together, and neither stands above the other.

The front owns what is not a protocol's: the lifespan (the Clients attach
at its startup, and a worker says it is ready then), a caller's W3C
traceparent, continued for the request's spans, the API key (engine.http.auth),
checked before any route reads a body and refused 401 in the shape of the
route asked, and GET /health, vLLM's probe that gateways use: 200 while every
engine serves (as /v2/health/ready), else 503 with Retry-After. A server
that asks (the worker's connections) gets from whole() the answer to an
infer once its body has come whole: the same checks and route, with no
ASGI message between the server and the route. With grpc_at, the front
also runs the Open Inference Protocol over gRPC (engine.http.grpc) on its
event loop, over the same Engines: started at startup (before the worker
says it is ready), stopped by drain().
"""
import functools
import json
from typing import Dict, Optional, Tuple

from engine.client import tracing
from engine.client.client import Client
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.http import asgi, body
from engine.http.asgi import Receive, Scope, Send
from engine.http.auth import CHALLENGE, ApiKey
from engine.http.engines import DEFAULT_TIMEOUT_S, Engines
from engine.http.errors import BadRequest, retry_after
from engine.http.oip import routes as oip_routes
from engine.http.openai import routes as openai_routes
from engine.http.openai.replies import OpenAIError
from engine.http.server import parsing


class Front:
    """The ASGI app of one HTTP worker for the engines `configs` names;
    openai: {engine: its OpenAI settings} for those that serve /v1/;
    clients: Clients lent already (else one per engine, made at start);
    api_key: the key every route but the health probes needs (None: none);
    catalog_fd, control_at: serve's, under --model-control explicit
    (engine.http.engines); regions_fd: the file of the shared-memory regions
    every worker of a serve shares (engine.http.oip.regions; None: this
    front's own); grpc_at: (host, port) of its gRPC server (None: none), which
    runs at most max_rpcs calls at once (engine.http.grpc.server)."""

    def __init__(self, configs: Dict[str, EngineConfig], timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_body_bytes: Optional[int] = None, on_ready=None,
                 openai: Optional[Dict[str, dict]] = None,
                 clients: Optional[Dict[str, Client]] = None,
                 api_key: Optional[str] = None, catalog_fd: Optional[int] = None,
                 control_at: Optional[str] = None, regions_fd: Optional[int] = None,
                 grpc_at: Optional[Tuple[str, int]] = None, max_rpcs: int = 1024) -> None:
        self.engines = Engines(configs, timeout_s, max_body_bytes, clients, catalog_fd,
                               control_at)
        self.api_key = None if api_key is None else ApiKey(api_key)
        self.parser = parsing.Parser()  # large bodies, of either protocol
        self.oip = oip_routes.App(self.engines, self.parser, regions_fd)
        self.grpc = None
        if grpc_at is not None:  # grpcio is imported only where gRPC is served
            from engine.http.grpc.server import GrpcServer
            from engine.http.oip.request import spec_of
            self.grpc = GrpcServer(self.engines, self.oip.model, *grpc_at,
                                   [spec_of(name, c) for name, c in configs.items()],
                                   max_body_bytes, max_rpcs, self.oip.regions)
        # the tokenizers load here: a factory that fails fails the worker's start
        self.openai = openai_routes.App(self.engines, openai, self.parser) if openai else None
        self.on_ready = on_ready
        self.startup_error: Optional[str] = None  # why the lifespan's startup failed

    def open(self) -> None:
        """A Client of each engine (EngineUnavailable if one is not running)."""
        self.engines.open()

    async def drain(self, grace_s: Optional[float]) -> None:
        """Stops the gRPC server (if any): new calls refused, those running
        given grace_s to end; the HTTP server drains its own requests beside."""
        if self.grpc is not None:
            await self.grpc.stop(grace_s)

    def close(self) -> None:
        self.engines.close()
        self.parser.close()
        self.oip.close()
        if self.openai is not None:
            self.openai.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return  # websockets are not served
        app = self._protocol(scope["path"])
        if self.api_key is not None:
            why = self.api_key.refusal(scope)
            if why is not None:
                return await _unauthorized(scope, receive, send, why, app is self.openai)
        self.engines.refresh()  # explicit model control: the engines serve has now
        if scope["path"] == "/health":
            return await self._health(scope, send)
        token = tracing.continued(scope["headers"])  # the caller's traceparent, when tracing
        try:
            return await app(scope, receive, send)
        finally:
            if token is not None:
                tracing.detach(token)

    def whole(self, scope: Scope) -> Optional[asgi.WholeAnswer]:
        """The answer to a request once its body has come whole, where a
        route takes it so (an infer of the Open Inference Protocol), with
        what __call__ does around it; None for any other request, which the
        server hands to __call__. Asked with the request's head: a request
        without the API key goes to __call__, which refuses it."""
        if self._protocol(scope["path"]) is not self.oip:
            return None
        if self.api_key is not None and self.api_key.refusal(scope) is not None:
            return None
        self.engines.refresh()  # explicit model control: the engines serve has now
        answer = self.oip.whole(scope)
        if answer is None or tracing.context() is None:
            return answer
        return functools.partial(_traced, scope, answer)

    def _protocol(self, path: str) -> asgi.App:
        """The protocol's app that serves path."""
        if self.openai is not None and (path.startswith("/v1/") or
                                        path in openai_routes.ROOT_PATHS):
            return self.openai
        return self.oip

    async def _health(self, scope: Scope, send: Send) -> None:
        """200 while every engine serves, else 503 naming the first that does
        not (the OIP's error shape: the path is no protocol's)."""
        try:
            if scope["method"] not in ("GET", "HEAD"):
                raise BadRequest(f"expected GET or HEAD, got {scope['method']}", 405,
                                 ((b"allow", b"GET, HEAD"),))
            for name in self.engines.counted():
                try:
                    self.engines.ready(name)
                except EngineError as e:
                    raise BadRequest(f"{type(e).__name__}: {e}", 503,
                                     tuple(retry_after(self.engines.retry_after_s(name, e))))
        except BadRequest as e:
            headers = [asgi.JSON, *e.headers]
            return await asgi.send_whole(send, e.status, json.dumps({"error": str(e)}).encode(),
                                         headers)
        await asgi.send_whole(send, 200, b'{"ready": true}')

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    self.open()
                    if self.grpc is not None:
                        await self.grpc.start()
                except Exception as e:
                    self.startup_error = f"{type(e).__name__}: {e}"
                    await send({"type": "lifespan.startup.failed",
                                "message": self.startup_error})
                    return
                await send({"type": "lifespan.startup.complete"})
                if self.on_ready is not None:
                    self.on_ready()
            elif message["type"] == "lifespan.shutdown":
                await self.drain(None)  # stopped already by a graceful drain, if one ran
                self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _traced(scope: Scope, answer: asgi.WholeAnswer, raw: bytes):
    """answer(raw) in the context of the caller's traceparent, as __call__ runs a route."""
    token = tracing.continued(scope["headers"])
    try:
        return await answer(raw)
    finally:
        if token is not None:
            tracing.detach(token)


async def _unauthorized(scope: Scope, receive: Receive, send: Send, why: str,
                        openai: bool) -> None:
    """The 401 of a request without the key, in its route's shape (OpenAI's
    as it answers a bad key), before any of its body is read."""
    refusal = BadRequest(why, 401, (CHALLENGE,))
    if openai:
        out = OpenAIError(401, why, code="invalid_api_key", kind="invalid_request_error").encoded()
    else:
        out = json.dumps({"error": why}).encode()
    await body.refuse(scope, receive, send, out, refusal)
