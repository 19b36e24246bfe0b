"""Triton's generate extension of the Open Inference Protocol: one request, in flat JSON.

POST /v2/models/NAME/generate takes {"INPUT": value, ...}: each input by
name (INPUT for a single-array engine), its value a number or nested lists
of the tensor's shape, in the engine's datatype; and optionally "id" and
"parameters" (timeout in microseconds and priority as infer takes them, and
max_steps). It answers {"model_name", "model_version", "OUTPUT": value, ...}:
an iterative engine's whole answer, its chunks stacked, and "finish_reason":
"stop" (the model said done) or "length" (max_steps).

POST /v2/models/NAME/generate_stream answers the same request as
server-sent events, one `data: {...}` event per chunk as the engine writes
it; the last chunk's event of a complete answer carries "finish_reason". A
stream that ends otherwise (an error, the server stopping, its timeout) ends
with a last `data: {"error": ...}` event (an error before the first chunk is
an ordinary error response). A caller that disconnects withdraws its
request: its stream is closed, and the batcher drops the request at its next
step; one that stops reading loses it at its deadline. A one-shot engine
answers both with its one answer, as Client.stream does.
"""
import asyncio
import json
import logging

import numpy as np

from engine.errors import EngineError, RequestTimeout
from engine.http import oip_tensors
from engine.http.oip_tensors import BadRequest, datatype_of, json_text

log = logging.getLogger("shmbatch")

PARAMETERS = ("timeout", "priority", "max_steps")
_END, _GONE = object(), object()  # the stream ended; the caller went away
SHUTDOWN = "EngineUnavailable: the server is shutting down; this request was not completed"
CUT = "EngineUnavailable: the answer ended before it completed"
CLOSING_S = 5.0
SEND_MIN_S = 1.0


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


async def generate(model, body: bytes, default_timeout_s: float, receive):
    """The whole answer, its chunks stacked, with its finish_reason; None (no
    answer) once the caller disconnected, which withdraws the request."""
    x, timeout_s, priority, max_steps, request_id = read_request(model, body, default_timeout_s)
    chunks = model.client.open_stream_async(x, timeout_s, priority=priority, max_steps=max_steps)
    gone = asyncio.ensure_future(_disconnected(receive))
    got: list = []
    try:
        while True:
            try:
                item = await _next(chunks, gone)
            except RequestTimeout as e:
                raise RequestTimeout(f"{e} ({len(got)} chunk(s) came; a longer answer asks a "
                                     f"longer timeout: parameters.timeout, in microseconds)"
                                     ) from None
            if item is _GONE:
                return None
            if item is _END:
                break
            got.append(item)
    except asyncio.CancelledError:  # the server stops: its drain ran out
        return 503, json.dumps({"error": SHUTDOWN}).encode(), []
    finally:
        gone.cancel()
        await chunks.aclose()  # withdraws the request unless it ended
    answer = _stacked(model, got) if model.config.iterative else got[0]
    out = answer_json(model, answer, request_id)
    out["finish_reason"] = chunks.finish_reason
    return 200, json.dumps(out).encode(), []


async def generate_stream(model, body: bytes, default_timeout_s: float, receive, send) -> None:
    """Streams the answer through send (the response is this function's to
    write once its first chunk came; an error before that is raised). The
    request's timeout bounds the caller's reading too: a caller that stops
    reading loses its request at its deadline, and the connection is closed."""
    x, timeout_s, priority, max_steps, request_id = read_request(model, body, default_timeout_s)
    deadline = asyncio.get_running_loop().time() + timeout_s
    chunks = model.client.open_stream_async(x, timeout_s, priority=priority, max_steps=max_steps)
    gone = asyncio.ensure_future(_disconnected(receive))
    started = False
    try:
        item = await _next(chunks, gone)  # an EngineError here is an ordinary error response
        if item is _GONE:
            return
        await _within(deadline, send({"type": "http.response.start", "status": 200,
                                      "headers": [(b"content-type", b"text/event-stream"),
                                                  (b"cache-control", b"no-cache")]}))
        started = True
        while item is not _END:
            event = answer_json(model, item, request_id)
            if chunks.finish_reason is not None:  # known with the last chunk itself
                event["finish_reason"] = chunks.finish_reason
            await _within(deadline, _send_event(send, event))
            try:
                item = await _next(chunks, gone)
            except EngineError as e:
                await _within(_closing(), _send_event(send, {"error": f"{type(e).__name__}: {e}"}))
                break
            if item is _GONE:
                return
            if item is _END and chunks.finish_reason is None:  # never a clean end short
                await _within(_closing(), _send_event(send, {"error": CUT}))
        await _within(_closing(), send({"type": "http.response.body", "body": b""}))
    except _SlowReader:  # the caller stopped reading: its request ends here
        log.warning("model %s: a stream's caller read nothing until its deadline; closed",
                    model.name)
    except asyncio.CancelledError:  # the server stops: its drain ran out
        if not started:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": json.dumps({"error": SHUTDOWN}
                                                                          ).encode()})
        else:
            await _send_event(send, {"error": SHUTDOWN}, more=False)
    finally:
        gone.cancel()
        await chunks.aclose()  # withdraws the request unless it ended


def _closing() -> float:
    """The deadline of a stream's last events: its request is over (its slot
    free), but a caller that reads nothing still cannot hold the connection."""
    return asyncio.get_running_loop().time() + CLOSING_S


class _SlowReader(Exception):
    """A send did not complete by the request's deadline: its caller stopped reading."""


async def _within(deadline: float, sending) -> None:
    """One send, bounded by the request's deadline (_SlowReader after it); a
    send begun at the deadline (its chunk came in time) gets SEND_MIN_S."""
    try:
        left_s = deadline - asyncio.get_running_loop().time()
        await asyncio.wait_for(sending, max(SEND_MIN_S, left_s))
    except asyncio.TimeoutError:
        raise _SlowReader from None


async def _send_event(send, obj, more: bool = True) -> None:
    await send({"type": "http.response.body", "more_body": more, "body": _event(obj)})


def _stacked(model, chunks: list):
    """The chunks of an answer stacked, in the caller's form (an empty answer
    holds no chunk of each output)."""
    by_name = [model.config.by_name(c) for c in chunks]
    stacked = {spec.name: np.stack([c[spec.name] for c in by_name]) if by_name
               else np.empty((0, *spec.shape), spec.dtype) for _, spec in model.outputs}
    return stacked if model.config.named else stacked[""]


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
