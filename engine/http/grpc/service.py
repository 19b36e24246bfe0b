"""Triton's `inference.GRPCInferenceService` over the engines of one worker.

The RPCs served: ServerLive, ServerReady, ModelReady, ServerMetadata,
ModelMetadata, ModelConfig, ModelStatistics, ModelInfer, ModelStreamInfer
(engine.http.grpc.streaming), and SystemSharedMemoryStatus, Register and
Unregister, over the HTTP routes' own table of regions (engine.http.oip.
regions: one a serve's workers share), whose inputs and outputs ModelInfer
reads and writes as the HTTP infer does (engine.http.oip.sysshm); every
other RPC of the service answers UNIMPLEMENTED (the generated servicer's
default). Each
engine is the model of its name, version 1, reached through the worker's
Client (engine.http.engines, shared with the HTTP routes: the requests of
both protocols batch together), shown by the HTTP routes' own Model
(engine.http.oip.routes: metadata, configuration, infer).

Ready is the HTTP front's: ServerReady says whether every engine (ModelReady:
that engine) runs with a live batcher that has loaded its model; an unknown
model is not ready (as Triton answers), and NOT_FOUND for everything else.

ModelInfer's deadline is the request's `timeout` parameter (microseconds;
0 or absent: the server's default), cut to the call's own deadline
(`grpc-timeout`) when that comes sooner, both counted from the call's
arrival. A call that ends early (cancelled, or past its deadline) withdraws
its requests. Refusals are engine.http.grpc.status's.
"""
import functools
import logging
import time
from typing import Callable

from google.protobuf import json_format

from engine.errors import EngineError, EngineUnavailable, QueueFull, RequestTimeout
from engine.http.engines import Engines
from engine.http.errors import BadRequest, NotFound
from engine.http.grpc import messages, status, streaming
from engine.http.grpc.generated import grpc_service_pb2 as pb
from engine.http.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from engine.http.grpc.generated import model_config_pb2
from engine.http.oip import stats, sysshm
from engine.http.oip.regions import Regions
from engine.http.oip.repository import VERSION
from engine.http.oip.routes import Model, server_version

log = logging.getLogger("shmbatch")

# of Triton's, those served over gRPC
EXTENSIONS = ("model_configuration", "statistics", "system_shared_memory")


def answering(rpc):
    """An RPC whose refusals (BadRequest, EngineError, any other error) end
    the call with their status (engine.http.grpc.status)."""
    @functools.wraps(rpc)
    async def answer(self, request, context):
        try:
            return await rpc(self, request, context)
        except Exception as e:
            retry_s = getattr(e, "retry_after_s", 1)
            if not isinstance(e, (BadRequest, EngineError)):
                log.exception("gRPC %s failed", rpc.__name__)
            code, details, trailers = status.of(e, retry_s)
            if trailers:
                context.set_trailing_metadata(trailers)
            await context.abort(code, details)
    return answer


class Service(pb_grpc.GRPCInferenceServiceServicer):
    """The service over `engines` and `regions` (the worker's, shared with its
    HTTP routes)."""

    def __init__(self, engines: Engines, model_of: Callable[[str], Model],
                 regions: Regions) -> None:
        self.engines, self.model_of, self.regions = engines, model_of, regions

    def model(self, name: str, version: str = "") -> Model:
        """The model of that name, the HTTP routes' own (model_of: NotFound if
        no engine has it), or NotFound for a version but 1; engines loaded or
        unloaded since are seen."""
        self.engines.refresh()
        model = self.model_of(name)
        if version not in ("", VERSION):
            raise NotFound(f"model {name!r}: expected version {VERSION}, got {version!r}")
        return model


    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        self.engines.refresh()
        try:
            for name in self.engines.counted():
                self.engines.ready(name)
        except EngineError:
            return pb.ServerReadyResponse(ready=False)
        return pb.ServerReadyResponse(ready=True)

    async def ModelReady(self, request, context):
        try:
            self.engines.ready(self.model(request.name, request.version).name)
        except (EngineError, NotFound):
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=True)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name="shmbatch", version=server_version(),
                                         extensions=list(EXTENSIONS))

    @answering
    async def ModelMetadata(self, request, context):
        shown = self.model(request.name, request.version).metadata()
        out = pb.ModelMetadataResponse(name=shown["name"], versions=shown["versions"],
                                       platform=shown["platform"])
        for field in ("inputs", "outputs"):
            for tensor in shown[field]:
                getattr(out, field).add(name=tensor["name"], datatype=tensor["datatype"],
                                        shape=tensor["shape"])
        return out

    @answering
    async def ModelConfig(self, request, context):
        config = self.model(request.name, request.version).triton_config()
        return pb.ModelConfigResponse(config=json_format.ParseDict(
            config, model_config_pb2.ModelConfig()))

    @answering
    async def ModelStatistics(self, request, context):
        if request.name:
            names = [self.model(request.name, request.version).name]
        else:
            names = sorted(self.engines.configs)
        found = []
        for name in names:
            try:
                found.append(stats.model_stat(name, VERSION, self.engines.segment(name)))
            except EngineUnavailable:
                if request.name:
                    raise
        return json_format.ParseDict({"model_stats": found}, pb.ModelStatisticsResponse(),
                                     ignore_unknown_fields=True)

    @answering
    async def ModelInfer(self, request, context):
        arrived = time.monotonic()
        model = self.model(request.model_name, request.model_version)
        if model.config.iterative:  # answers of any length: no [k, ...] tensor holds them
            raise BadRequest(f"model {model.name!r} is iterative: expected ModelStreamInfer, "
                             f"got ModelInfer")
        parsed, _ = messages.read_infer(request, model.spec, self.engines.timeout_s)
        left_s = messages.deadline_s(parsed.timeout_s, arrived, context)
        if left_s <= 0:
            raise RequestTimeout(f"expected an answer within {parsed.timeout_s:g} s, got none: "
                                 f"the call's deadline had passed (nothing was enqueued)")
        shared = parsed.shared_memory
        arrays = await sysshm.read_inputs(self.regions, model, parsed) if shared \
            else parsed.arrays
        try:
            answers = await model.infer(arrays, parsed.k, left_s, parsed.priority)
        except (QueueFull, EngineUnavailable) as e:
            e.retry_after_s = self.engines.retry_after_s(  # type: ignore
                model.name, e, parsed.priority)
            raise
        outputs = [(name, answers[i], how) for i, name, how in parsed.wanted]
        if shared:
            outputs = await sysshm.write_outputs(self.regions, outputs)
        return messages.response(model.name, parsed.request_id, outputs)

    @answering
    async def SystemSharedMemoryStatus(self, request, context):
        out = pb.SystemSharedMemoryStatusResponse()
        for found in self.regions.status(request.name or None):
            region = out.regions[found["name"]]
            region.name, region.key = found["name"], found["key"]
            region.offset, region.byte_size = found["offset"], found["byte_size"]
        return out

    @answering
    async def SystemSharedMemoryRegister(self, request, context):
        self.regions.register(request.name, {"key": request.key, "offset": request.offset,
                                             "byte_size": request.byte_size})
        return pb.SystemSharedMemoryRegisterResponse()

    @answering
    async def SystemSharedMemoryUnregister(self, request, context):
        self.regions.unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def ModelStreamInfer(self, request_iterator, context):
        async for response in streaming.serve(self, request_iterator, context):
            yield response

