"""The HTTP front: one ASGI app that holds the engines' Clients and mounts each protocol.

Run by each HTTP worker process of `shmbatch serve --http-port`
(engine.http.worker), usable under any ASGI server, and by Ray
Serve's replicas (engine.ray). Paths under /v1/ go to the OpenAI API
(engine.http.openai), for the engines that have an openai table; every
other path to the Open Inference Protocol (engine.http.oip). Both reach
the engines through one Engines (engine.http.engines), so the requests of
both protocols batch together, and neither stands above the other.

The front owns what is not a protocol's: the lifespan (the Clients attach
at its startup, and a worker says it is ready then), and a caller's W3C
traceparent, continued for the request's spans.
"""
from typing import Dict, Optional

from engine.client import tracing
from engine.client.client import Client
from engine.config import EngineConfig
from engine.http.oip import routes as oip_routes
from engine.http.openai import routes as openai_routes
from engine.http.asgi import Receive, Scope, Send
from engine.http.engines import DEFAULT_TIMEOUT_S, Engines
from engine.http.server import parsing


class Front:
    """The ASGI app of one HTTP worker for the engines `configs` names;
    openai: {engine: its OpenAI settings} for those that serve /v1/;
    clients: Clients lent already (else one per engine, made at start)."""

    def __init__(self, configs: Dict[str, EngineConfig], timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_body_bytes: Optional[int] = None, on_ready=None,
                 openai: Optional[Dict[str, dict]] = None,
                 clients: Optional[Dict[str, Client]] = None) -> None:
        self.engines = Engines(configs, timeout_s, max_body_bytes, clients)
        self.parser = parsing.Parser()  # large bodies, of either protocol
        self.oip = oip_routes.App(self.engines, self.parser)
        # the tokenizers load here: a factory that fails fails the worker's start
        self.openai = openai_routes.App(self.engines, openai, self.parser) if openai else None
        self.on_ready = on_ready
        self.startup_error: Optional[str] = None  # why the lifespan's startup failed

    def open(self) -> None:
        """A Client of each engine (EngineUnavailable if one is not running)."""
        self.engines.open()

    def close(self) -> None:
        self.engines.close()
        self.parser.close()
        if self.openai is not None:
            self.openai.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return  # websockets are not served
        token = tracing.continued(scope["headers"])  # the caller's traceparent, when tracing
        try:
            if self.openai is not None and scope["path"].startswith("/v1/"):
                return await self.openai(scope, receive, send)
            return await self.oip(scope, receive, send)
        finally:
            if token is not None:
                tracing.detach(token)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
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

