"""A `shmbatch serve` of the engines of tests/openai_models.py on the OpenAI API, and
the clients the tests of tests/test_openai_*.py call it with."""
import json
import socket
import urllib.request

import openai
from conftest import engine_word, requests_total, unique_name, wait_for  # noqa: F401 (re-exported)
from test_multi_engine import Served, table, top, toml_value

from engine.segment import Segment
from engine.shm import codes

IDS = dict(input_shape=["none"], max_input_shape=[64], input_dtype="int64")
STEPS = dict(**IDS, iterative=True, output_shape=[], output_dtype="int64", max_steps=128)
TAGGED = dict(backend="openai_models:tagged", iterative=True, max_steps=128,
              inputs={"input_ids": ["int64", ["none"]], "seed": ["int64", [1]],
                      "temperature": ["float32", [1]]},
              max_input_shapes={"input_ids": [64]}, outputs={"token": ["int64", []]})
EMBED = dict(backend="openai_models:embedder", input_shape=["none"], max_input_shape=[32],
             input_dtype="int64", output_shape=[4], output_dtype="float32")
RANK = dict(backend="openai_models:scorer", input_shape=["none"], max_input_shape=[64],
            input_dtype="int64", output_shape=[], output_dtype="float32")
# one slot and 10 ms steps without end: a request holds the slot until it is withdrawn
SLOW = dict(backend="openai_models:echo", backend_args={"step_ms": 10.0}, queue_capacity=1,
            max_batch_size=1, **{**STEPS, "max_steps": 65536})


def openai_table(engine: str, **keys) -> str:
    return f'[engines."{engine}".openai]\n' + "".join(f"{k} = {toml_value(v)}\n"
                                                     for k, v in keys.items())


def serve(folder, engines: dict, **serve_keys) -> Served:
    """serve of `engines` ({model: (engine keys, openai keys or None)}), each engine
    named uniquely and served under its model's name; `names` maps model -> engine."""
    names = {model: unique_name(model) for model in engines}
    text = top(http_workers=1, **serve_keys)
    for model, (keys, openai_keys) in engines.items():
        text += table(names[model], **keys)
        if openai_keys is not None:
            text += openai_table(names[model], model=model, **openai_keys)
    served = Served(folder, text, "--http-port", "0")
    served.names = names
    served.base_url = f"http://{served.url}/v1"
    return served


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60)


def async_client(served) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served.base_url, api_key="unused", max_retries=0,
                              timeout=60)


def post(served, path: str, body, headers=None, timeout_s: float = 60, root: bool = False):
    """(status, headers, the answer's bytes) of one POST of body (JSON, or bytes as they
    are) to path under /v1 (root: path from the server's root)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    url = f"http://{served.url}{path}" if root else served.base_url + path
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"content-type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, dict(e.headers), e.read()


def raw_post(served, path: str, body: dict) -> socket.socket:
    """A POST sent on a socket of its own, its answer left unread."""
    host, port = served.url.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(f"POST /v1{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock



def withdrawn(engine: str) -> int:
    """Requests of the engine that their client withdrew."""
    return engine_word(engine, codes.W_WITHDRAWN)


def queued(engine: str) -> int:
    """Requests of the engine waiting in its queue, at any priority (its levels
    are read from the ready bitmaps, which a header-only attach leaves unmapped)."""
    seg = Segment.attach(engine)
    try:
        return seg.ring.queued(seg.config.priority_levels - 1)
    finally:
        seg.close()


def slot_comes_back(served) -> None:
    """A short request to the one-slot engine is answered once its slot is free."""
    def answered() -> bool:
        status, _, body = post(served, "/completions", {"model": "slow", "prompt": "x",
                                                        "max_tokens": 1})
        assert status in (200, 503), body
        return status == 200

    wait_for(answered, "the one slot of slow free again", 60, every_s=0.05)
