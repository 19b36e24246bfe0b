"""Triton's ModelStreamInfer: a bidirectional stream of infer requests and their answers.

Each ModelInferRequest of the stream is one engine request (its inputs'
first dim 1), read as ModelInfer reads one (engine.http.grpc.messages), and
runs beside the stream's others (at most MAX_RUNNING at once; past that, a
request is refused in the stream). An iterative engine's answer comes chunk
by chunk, each chunk a ModelStreamInferResponse as soon as the engine wrote
it (its outputs [1, *chunk]); a one-shot engine's comes as one response.
Responses carry the request's `id`, so that a caller can match them when
several run at once. With the request parameter
`triton_enable_empty_final_response` (tritonclient's
enable_empty_final_response), every response says `triton_final_response`
false, and an empty one ends the request with it true, and with the
request's `finish_reason` ("stop" or "length").

Request parameters: `timeout` (microseconds, 0 the server's default) and
`priority` as ModelInfer's, both the request's own; `max_steps`; and, on an
engine with sampling=True, the sampling parameters (SAMPLING: temperature,
top_p, top_k, min_p, seed, min_tokens, ignore_eos), checked as
engine.Sampling checks them. On an engine that does not sample they are
refused, never silently ignored. The stream's own deadline (grpc-timeout)
bounds every request in it.

A request's refusal or failure is a response with its `error_message`
(status's details: the kind and what was expected and what came); the
stream goes on, as Triton's does. A caller that cancels the stream (or
whose deadline passes) withdraws every request still running in it: the
batcher drops each at its next step. A caller that stops reading holds at
most QUEUED responses; then the engine's chunks wait in its slot, and the
request ends at its deadline.
"""
import asyncio
import contextlib
import time
from typing import List, Optional, Set, cast

import numpy as np

from engine.errors import EngineError, RequestTimeout
from engine.http.errors import BadRequest
from engine.http.grpc import messages, status
from engine.http.grpc.generated import grpc_service_pb2 as pb
from engine.sampling import Sampling

MAX_RUNNING = 256  # requests of one stream running at once
QUEUED = 64  # responses written and not yet taken by the caller's stream
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos")
FINAL = "triton_final_response"
ENABLE_FINAL = "triton_enable_empty_final_response"


async def serve(service, requests, context):
    """The stream's responses, as its requests come (an async generator the
    servicer's ModelStreamInfer yields from)."""
    out: asyncio.Queue = asyncio.Queue()  # bounded by room: QUEUED responses at most
    room = asyncio.Semaphore(QUEUED)
    running: Set[asyncio.Task] = set()

    async def put(response) -> None:
        await room.acquire()
        out.put_nowait(response)

    async def read() -> None:
        async for msg in requests:
            arrived = time.monotonic()  # each request's timeout counts from its own arrival
            if len(running) >= MAX_RUNNING:
                await put(_error(msg, BadRequest(
                    f"expected at most {MAX_RUNNING} requests running in one stream, got "
                    f"{MAX_RUNNING + 1}: wait for an answer's end before sending more")))
                continue
            task = asyncio.ensure_future(_answer(service, msg, context, put, arrived))
            running.add(task)
            task.add_done_callback(running.discard)
        while running:  # the caller's half ended: its requests' answers end the stream
            await asyncio.wait(set(running))

    reader = asyncio.ensure_future(read())
    reader.add_done_callback(lambda _: out.put_nowait(None))
    try:
        while (response := await out.get()) is not None:
            room.release()
            yield response
        reader.result()  # the caller's half failed: so does the call
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()  # each withdraws its request (its stream closed)
        with contextlib.suppress(BaseException):
            await asyncio.gather(reader, *running, return_exceptions=True)


async def _answer(service, msg, context, put, arrived: float) -> None:
    """One request of the stream, its responses given to put."""
    name = msg.model_name
    try:
        model = service.model(name, msg.model_version)
        parsed, params = messages.read_infer(msg, model.spec, service.engines.timeout_s)
        if parsed.k != 1:
            raise BadRequest(f"expected one request (a first dim of 1) in each stream "
                             f"message, got {parsed.k}")
        if parsed.shared_memory:
            raise BadRequest("expected a stream's inputs and outputs in its messages, got "
                             "a shared-memory region (ModelInfer reads and writes them)")
        max_steps = params.get("max_steps")
        if max_steps is not None and (type(max_steps) is not int or max_steps < 1):
            raise BadRequest(f"max_steps: expected an integer >= 1, got {max_steps!r}")
        sampling = _sampling(model, params)
        timeout_s = messages.deadline_s(parsed.timeout_s, arrived, context)
        if timeout_s <= 0:
            raise RequestTimeout(f"expected an answer within {parsed.timeout_s:g} s, got none: "
                                 f"the stream's deadline had passed (nothing was enqueued)")
        arrays = cast(List[np.ndarray], parsed.arrays)  # none in a region: refused above
        x = model.config.request_of({spec.name: a[0] for (_, spec), a in
                                     zip(model.inputs, arrays)})
        final = params.get(ENABLE_FINAL) is True
        flags = {FINAL: False} if final else None
        chunks = model.client.open_stream_async(x, timeout_s, priority=parsed.priority,
                                                max_steps=max_steps, sampling=sampling)
        try:
            async for chunk in chunks:
                values = model.config.by_name(chunk)
                outputs = [(model.outputs[i][0], np.asarray(values[model.outputs[i][1].name])[None],
                            True) for i, _, _ in parsed.wanted]
                await put(pb.ModelStreamInferResponse(infer_response=messages.response(
                    model.name, parsed.request_id, outputs, flags)))
        finally:
            await chunks.aclose()  # withdraws it, unless it ended
        if final:
            await put(pb.ModelStreamInferResponse(infer_response=messages.response(
                model.name, parsed.request_id, [],
                {FINAL: True, "finish_reason": chunks.finish_reason or "stop"})))
    except (BadRequest, EngineError) as e:
        await put(_error(msg, e))


def _sampling(model, params: dict) -> Optional[Sampling]:
    """The request's Sampling, from its sampling parameters (None: none given)."""
    given = {key: params[key] for key in SAMPLING if key in params}
    if not given:
        return None
    if not model.config.sampling:
        key = next(iter(given))
        raise BadRequest(f"model {model.name!r} does not sample (sampling=False): expected no "
                         f"{key} parameter, got {given[key]!r}")
    return Sampling(**given)


def _error(msg, error: BaseException):
    """A response saying why a request of the stream was refused or failed."""
    _, details, _ = status.of(error)  # a message of the stream carries no trailers
    return pb.ModelStreamInferResponse(error_message=details, infer_response=pb.ModelInferResponse(
        model_name=msg.model_name, model_version=msg.model_version, id=msg.id))
