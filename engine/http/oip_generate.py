"""Triton's generate extension of the Open Inference Protocol: one request, in flat JSON.

POST /v2/models/NAME/generate takes {"INPUT": value, ...}: each input by
name (INPUT for a single-array engine), its value a number or nested lists
of the tensor's shape, in the engine's datatype; and optionally "id" and
"parameters" (timeout in microseconds and priority as infer takes them, and
max_steps). It answers {"model_name", "model_version", "OUTPUT": value, ...}:
an iterative engine's whole answer, its chunks stacked.

POST /v2/models/NAME/generate_stream answers the same request as
server-sent events, one `data: {...}` event per chunk as the engine writes
it; an error after the first chunk is a last `data: {"error": ...}` event
(one before it is an ordinary error response). A caller that disconnects
withdraws its request: its stream is closed, and the batcher drops the
request at its next step. A one-shot engine answers both with its one
answer, as Client.stream does.
"""
import asyncio
import json

from engine.errors import EngineError
from engine.http import oip_tensors
from engine.http.oip_tensors import BadRequest, datatype_of, json_text

PARAMETERS = ("timeout", "priority", "max_steps")
_END, _GONE = object(), object()  # the stream ended; the caller went away


def read_request(model, body: bytes, default_timeout_s: float):
    """(the request in the client's form, timeout_s, priority, max_steps, id)."""
    request, _ = oip_tensors.split(body, None)
    names = [name for name, _ in model.inputs]
    unknown = sorted(set(request) - set(names) - {"id", "parameters"})
    missing = [name for name in names if name not in request]
    if unknown or missing:
        raise BadRequest(f"model {model.name!r}: expected keys {names} (and \"id\", "
                         f"\"parameters\"), got {sorted(request)}")
    arrays = {spec.name: oip_tensors.value_array(request[name], datatype_of(spec.dtype), name)
              for name, spec in model.inputs}
    params = oip_tensors.parameters(request, "request", PARAMETERS)
    max_steps = params.get("max_steps")
    if max_steps is not None and (type(max_steps) is not int or max_steps < 1):
        raise BadRequest(f"max_steps: expected an integer >= 1, got {json_text(max_steps)}")
    x = model.config.request_of(arrays)
    return (x, oip_tensors.timeout_s(params.get("timeout", 0), default_timeout_s),
            model.engine_priority(params.get("priority", 0)), max_steps, request.get("id"))


def answer_json(model, answer, request_id) -> dict:
    """An answer (or one chunk) as the extension writes it: each output by name."""
    out = {"model_name": model.name, "model_version": "1"}
    if request_id is not None:
        out["id"] = request_id
    values = model.config.by_name(answer)
    for name, spec in model.outputs:
        out[name] = values[spec.name].tolist()
    return out


async def generate(model, body: bytes, default_timeout_s: float):
    x, timeout_s, priority, max_steps, request_id = read_request(model, body, default_timeout_s)
    answer = await model.client.infer_async(x, timeout_s, priority=priority,
                                             max_steps=max_steps)
    return 200, json.dumps(answer_json(model, answer, request_id)).encode(), []


async def generate_stream(model, body: bytes, default_timeout_s: float, receive, send) -> None:
    """Streams the answer through send (the response is this function's to
    write once its first chunk came; an error before that is raised)."""
    x, timeout_s, priority, max_steps, request_id = read_request(model, body, default_timeout_s)
    chunks = model.client.stream_async(x, timeout_s, priority=priority, max_steps=max_steps)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        item = await _next(chunks, gone)  # an EngineError here is an ordinary error response
        if item is _GONE:
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"),
                                (b"cache-control", b"no-cache")]})
        while item is not _END:
            await send({"type": "http.response.body", "more_body": True,
                        "body": _event(answer_json(model, item, request_id))})
            try:
                item = await _next(chunks, gone)
            except EngineError as e:
                await send({"type": "http.response.body", "more_body": True,
                            "body": _event({"error": f"{type(e).__name__}: {e}"})})
                item = _END
            if item is _GONE:
                return
        await send({"type": "http.response.body", "body": b""})
    finally:
        gone.cancel()
        await chunks.aclose()  # withdraws the request unless it ended


async def _next(chunks, gone):
    """The stream's next chunk, _END, or _GONE if the caller disconnected first
    (the wait for the chunk is then cancelled, which closes the stream)."""
    step = asyncio.ensure_future(chunks.__anext__())
    await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
    if step.done():
        try:
            return step.result()
        except StopAsyncIteration:
            return _END
    step.cancel()
    try:
        await step
    except (asyncio.CancelledError, StopAsyncIteration, EngineError):
        pass
    return _GONE


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
