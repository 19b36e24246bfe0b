"""The gRPC server of one HTTP worker: grpc.aio on the worker's event loop, beside uvicorn.

Each HTTP worker of `serve --grpc-port` runs one, on the loop its HTTP
routes run on, over the same Engines (one Client per engine, so gRPC and
HTTP requests batch together), started at the front's startup (a worker is
ready once it listens) and stopped with the worker: serve supervises,
restarts and drains it as it does the worker. Every worker listens on the
one port with SO_REUSEPORT, which serve holds bound (not listening) from
before its engines start (engine.http.server.workers.reserve): the kernel
hands each connection to one worker, and no other user's process can take
the port.

Limits: a message at most what the largest engine can take
(engine.http.grpc.messages.max_message_bytes); at most MAX_STREAMS calls at
once on one connection (HTTP/2's SETTINGS_MAX_CONCURRENT_STREAMS) and
`max_rpcs` in the worker (the HTTP front's connection cap; past it a call is
refused RESOURCE_EXHAUSTED at once); a connection with no call for IDLE_S is
closed. A drain refuses new calls and gives those running the engines'
drain timeout to end.
"""
import logging
from typing import Callable, Iterable, Optional

from grpc import aio

from engine.http.body import HEADER_BYTES, MAX_JSON_BYTES
from engine.http.engines import Engines
from engine.http.grpc import messages
from engine.http.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from engine.http.grpc.service import Service
from engine.http.oip.regions import Regions
from engine.http.oip.request import Spec
from engine.http.oip.routes import Model

log = logging.getLogger("shmbatch")

MAX_STREAMS = 256  # calls at once on one connection
IDLE_S = 300  # a connection with no call this long is closed


class GrpcServer:
    """The service over `engines` on host:port; specs: the engines' at the
    start, which size the largest message (max_body_bytes: one size for all);
    regions: the system shared-memory regions the worker's HTTP routes hold."""

    def __init__(self, engines: Engines, model_of: Callable[[str], Model], host: str, port: int,
                 specs: Iterable[Spec], max_body_bytes: Optional[int], max_rpcs: int,
                 regions: Regions) -> None:
        self.engines, self.model_of, self.host, self.port = engines, model_of, host, port
        self.regions = regions  # the HTTP routes' system shared-memory regions
        most = messages.max_message_bytes(specs, max_body_bytes)
        if engines.explicit and max_body_bytes is None:  # engines loaded later: room for them
            most = max(most, MAX_JSON_BYTES + HEADER_BYTES)
        self.max_message_bytes = most
        self.max_rpcs = max_rpcs
        self.server: Optional[aio.Server] = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    async def start(self) -> None:
        """Listens (on the running loop); OSError if it cannot."""
        server = aio.server(options=[
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", -1),
            ("grpc.so_reuseport", 1),
            ("grpc.max_concurrent_streams", MAX_STREAMS),
            ("grpc.max_connection_idle_ms", IDLE_S * 1000),
        ], maximum_concurrent_rpcs=self.max_rpcs)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(
            Service(self.engines, self.model_of, self.regions), server)
        try:
            bound = server.add_insecure_port(self.address)
        except RuntimeError as e:  # grpc's own, for an address it cannot bind
            bound, why = 0, str(e)
        else:
            why = "in use, or not an address of this host"
        if bound != self.port:
            await server.stop(None)
            raise OSError(f"--grpc-port {self.port}: cannot listen on {self.address} ({why})")
        await server.start()
        self.server = server

    async def stop(self, grace_s: Optional[float]) -> None:
        """Refuses new calls; those running have grace_s to end (None: none)."""
        server, self.server = self.server, None
        if server is not None:
            await server.stop(grace_s)

