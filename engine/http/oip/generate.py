"""Triton's generate extension of the Open Inference Protocol: one request, in flat JSON.

POST /v2/models/NAME/generate takes {"INPUT": value, ...}: each input by
name (INPUT for a single-array engine), its value a number or nested lists
of the tensor's shape, in the engine's datatype; and optionally "id" (a
string of at most 256 characters, echoed in the answer) and "parameters" (timeout in microseconds and priority as infer takes them, and
max_steps). It answers {"model_name", "model_version", "OUTPUT": value, ...}:
an iterative engine's whole answer, its chunks stacked, and "finish_reason":
"stop" (the model said done) or "length" (max_steps).

POST /v2/models/NAME/generate_stream answers the same request as
server-sent events, one `data: {...}` event per chunk as the engine writes
it (the events of chunks that came together in one HTTP chunk:
engine.http.events); the last chunk's event of a complete answer carries
"finish_reason". A stream that ends otherwise (an error, the server
stopping, its timeout) ends with a last `data: {"error": ...}` event (an
error before the first chunk is an ordinary error response). A caller that
disconnects withdraws its request: its stream is closed, and the batcher
drops the request at its next step; one that stops reading loses it at its
deadline. A one-shot engine answers both with its one answer, as
Client.stream does.
"""
import asyncio
import json

import numpy as np

from engine.errors import RequestTimeout
from engine.http import events
from engine.http.errors import BadRequest
from engine.http.oip import tensors
from engine.http.values import datatype_of, json_text, value_array

PARAMETERS = ("timeout", "priority", "max_steps")


def read_request(model, body: bytes, default_timeout_s: float):
    """(the request in the client's form, timeout_s, priority, max_steps, id)."""
    request, _ = tensors.split(body, None)
    names = [name for name, _ in model.inputs]
    unknown = sorted(set(request) - set(names) - {"id", "parameters"})
    missing = [name for name in names if name not in request]
    if unknown or missing:
        raise BadRequest(f"model {model.name!r}: expected keys {names} (and \"id\", "
                         f"\"parameters\"), got {sorted(request)}")
    arrays = {spec.name: value_array(request[name], datatype_of(spec.dtype), name)
              for name, spec in model.inputs}
    params = tensors.parameters(request, "request", PARAMETERS)
    max_steps = params.get("max_steps")
    if max_steps is not None and (type(max_steps) is not int or max_steps < 1):
        raise BadRequest(f"max_steps: expected an integer >= 1, got {json_text(max_steps)}")
    x = model.config.request_of(arrays)
    return (x, tensors.timeout_s(params.get("timeout", 0), default_timeout_s),
            model.engine_priority(params.get("priority", 0)), max_steps, tensors.request_id(request))


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
    try:
        blocks = await events.collect(chunks, receive)
    except RequestTimeout as e:
        raise RequestTimeout(f"{e} ({chunks.chunks_read} chunk(s) came; a longer answer asks a "
                             f"longer timeout: parameters.timeout, in microseconds)") from None
    except asyncio.CancelledError:  # the server stops: its drain ran out
        return 503, json.dumps({"error": f"EngineUnavailable: {events.SHUTDOWN}"}).encode(), []
    if blocks is None:
        return None
    answer = _joined(model, blocks)
    if not model.config.iterative:  # its one answer, not a chunk of one
        answer = model.config.answer(tuple(a[0] for a in _in_order(model, answer)))
    out = answer_json(model, answer, request_id)
    out["finish_reason"] = chunks.finish_reason
    return 200, json.dumps(out).encode(), []


async def generate_stream(model, body: bytes, default_timeout_s: float, scope, receive,
                          send) -> None:
    """Streams the answer through send (the response is this function's to
    write once its first chunk came; an error before that is raised). The
    request's timeout bounds the caller's reading too (engine.http.events)."""
    x, timeout_s, priority, max_steps, request_id = read_request(model, body, default_timeout_s)
    chunks = model.client.open_stream_async(x, timeout_s, priority=priority, max_steps=max_steps)
    await GenerateEvents(model, request_id, chunks, scope, receive, send, timeout_s).run()


class GenerateEvents(events.EventStream):
    """The extension's events: each chunk as answer_json writes it, the last
    one of a complete answer with its finish_reason; the constant part of an
    event encoded once per request."""

    def __init__(self, model, request_id, chunks, scope, receive, send, timeout_s: float) -> None:
        super().__init__(chunks, scope, receive, send, timeout_s)
        head = {"model_name": model.name, "model_version": "1"}
        if request_id is not None:
            head["id"] = request_id
        self.head = "data: " + json.dumps(head)[:-1] + ", "
        self.model = model
        self.keys = [json.dumps(name) + ": " for name, _ in model.outputs]
        # an integer's text is its JSON (a token id's, say)
        self.texts = [str if not spec.shape and np.dtype(spec.dtype).kind in "iu"
                      else events.dumps for _, spec in model.outputs]

    def events(self, chunks, finish_reason) -> bytes:
        head = self.head
        if not self.model.config.named:  # one output: chunks is its array
            key, text = head + self.keys[0], self.texts[0]
            parts = [key + text(value) + "}\n\n" for value in chunks.tolist()]
        else:
            columns = [a.tolist() for a in _in_order(self.model, chunks)]
            parts = [head + ", ".join([key + text(value) for key, text, value in
                                       zip(self.keys, self.texts, row)]) + "}\n\n"
                     for row in zip(*columns)]
        if finish_reason is not None:  # the last chunk's
            parts[-1] = parts[-1][:-3] + ', "finish_reason": "' + finish_reason + '"}\n\n'
        return "".join(parts).encode()


def _in_order(model, answer) -> list:
    """An answer's (or a block of chunks') arrays in the order of model.outputs."""
    values = model.config.by_name(answer)
    return [values[spec.name] for _, spec in model.outputs]


def _joined(model, blocks: list):
    """Blocks of chunks joined into the whole answer, in the caller's form (an
    empty answer holds no chunk of each output)."""
    columns = [_in_order(model, block) for block in blocks]
    return model.config.answer(tuple(
        np.concatenate([c[i] for c in columns]) if columns
        else np.empty((0, *spec.shape), spec.dtype) for i, (_, spec) in enumerate(model.outputs)))
