"""POST /v1/embeddings on a one-shot engine.

`input` is a string, a list of strings, a list of token ids or a list of such
lists; each input is one engine request, all enqueued at once from the event
loop so that they batch with everyone's (a refusal of any withdraws those
enqueued before it, as a k-row infer does). The answer lists each input's
embedding in order, as floats or, with encoding_format "base64", as the
base64 of its float32 values (little-endian), as OpenAI gives them; usage
counts the inputs' tokens. With `dimensions`, each embedding is its first
values scaled back to unit length (OpenAI's shortening). A caller that
disconnects withdraws them.
"""
import asyncio
import base64
import json
from typing import Optional

import numpy as np

from engine.http.asgi import Receive, Send, send_whole
from engine.http.openai import fields
from engine.http.openai.replies import bad
from engine.http.values import json_text
from engine.http.watch import watched_answers

FORMATS = ("float", "base64")
INLINE_VALUES = 4096  # an answer of more values is encoded in a thread


async def answer(client, served: fields.Served, body: dict, timeout_s: float, priority: int,
                 receive: Receive, send: Send) -> None:
    """Answers the request through send (an error before that is raised)."""
    fmt = body.get("encoding_format") or "float"
    if fmt not in FORMATS:
        raise bad(f"encoding_format: expected one of {list(FORMATS)}, got {json_text(fmt)}",
                  "encoding_format")
    dimensions = _dimensions(served, body)
    inputs = await fields.embedding_inputs(served, body)
    most = served.most_inputs
    if len(inputs) > most:
        raise bad(f"input: expected at most {most} inputs (OpenAI's bound, or the engine's "
                  f"queue_capacity if smaller), "
                  f"got {len(inputs)}", "input")
    requests = [served.request(ids, body, "input") for ids in inputs]
    answers = await watched_answers(client, requests, timeout_s, priority, receive)
    if answers is None:  # their caller left
        return
    vectors = [served.vector(a) for a in answers]
    if dimensions is not None:
        vectors = [_shortened(v, dimensions) for v in vectors]
    usage = sum(len(ids) for ids in inputs)
    if sum(v.size for v in vectors) > INLINE_VALUES:
        out = await asyncio.to_thread(_encode, served.model, vectors, fmt, usage)
    else:
        out = _encode(served.model, vectors, fmt, usage)
    await send_whole(send, 200, out)


def _dimensions(served: fields.Served, body: dict) -> Optional[int]:
    """The request's `dimensions`: None (the model's own), or an integer in
    1..the model's size."""
    value = body.get("dimensions")
    size = served.vector_size
    if value is None or value == size:
        return None
    if type(value) is not int or not 1 <= value <= size:
        raise bad(f"dimensions: expected an integer in 1..{size} (model {served.model!r}'s "
                  f"embedding size), got {json_text(value)}", "dimensions")
    return value


def _shortened(vector: np.ndarray, dimensions: int) -> np.ndarray:
    """An embedding's first `dimensions` values, scaled back to unit length, as
    OpenAI shortens its embeddings."""
    head = np.asarray(vector[:dimensions], np.float64)
    norm = float(np.linalg.norm(head))
    return (head / norm if norm > 0 else head).astype(np.float32)


def _encode(model: str, vectors, fmt: str, prompt_tokens: int) -> bytes:
    if fmt == "base64":
        values = [base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() for v in vectors]
    else:
        values = [v.tolist() for v in vectors]
    return json.dumps({"object": "list", "model": model,
                       "data": [{"object": "embedding", "index": i, "embedding": e}
                                for i, e in enumerate(values)],
                       "usage": {"prompt_tokens": prompt_tokens,
                                 "total_tokens": prompt_tokens}}).encode()
