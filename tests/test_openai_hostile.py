"""The OpenAI routes under careless and hostile callers: every cost bounded before it is
paid, a stream that began ends with an event, nothing a caller sends echoed unbounded,
undecodable text refused, and OpenAI's own answers where it gives one."""
import json
import math
import threading
import urllib.request

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from conftest import wait_for  # noqa: E402
from openai_models import BROKEN, EOS, OUTSIDE, embedding  # noqa: E402
from openai_served import EMBED, STEPS, client, post, serve  # noqa: E402

COUNTED = {"tokenizer": "openai_models:counted_tokenizer"}
ECHO = dict(backend="openai_models:echo", **STEPS)  # at most 64 tokens a prompt


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve(tmp_path_factory.mktemp("hostile"), {
        "echo": (ECHO, COUNTED),
        "gated": (ECHO, {"tokenizer": "openai_models:gated_tokenizer",
                         "max_prompt_chars": 100_000}),
        "broken": (ECHO, {"tokenizer": "openai_models:broken_tokenizer"}),
        "beyond": (dict(ECHO, backend="openai_models:beyond"), COUNTED),
        "embed": (EMBED, COUNTED),
    })
    yield served
    served.stop()


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


def events_of(body: bytes) -> list:
    return [e[len("data: "):] for e in body.decode().split("\n\n") if e]


@pytest.mark.parametrize("path, body, field", [
    ("/embeddings", {"model": "embed", "input": "x" * (1 << 20)}, "input"),
    ("/completions", {"model": "echo", "prompt": "x" * 60_000}, "prompt"),
    ("/chat/completions", {"model": "echo",
                           "messages": [{"role": "user", "content": "x" * 60_000}]},
     "messages")], ids=["embeddings", "completions", "chat"])
def test_a_text_no_prompt_can_hold_is_refused_by_its_length(server, path, body, field):
    status, _, answer = post(server, path, body)
    error = error_of(answer)
    assert status == 400 and (error["param"], error["code"]) == (field,
                                                                 "context_length_exceeded")
    assert "characters" in error["message"], error


def test_a_long_text_is_tokenized_off_the_event_loop(server, tmp_path):
    gate = tmp_path / "gate"
    answered = {}

    def slow_caller():
        answered["slow"] = post(server, "/completions", {
            "model": "gated", "prompt": f"GATE:{gate}:" + "x" * 8000})

    caller = threading.Thread(target=slow_caller)
    caller.start()
    try:
        wait_for(lambda: (tmp_path / "gate.entered").exists(), "the tokenizer at work", 60,
                 every_s=0.01)
        # the worker answers others while that text is tokenized
        done = client(server).with_options(timeout=20).completions.create(
            model="echo", prompt="ok", max_tokens=2)
        assert done.choices[0].text == "ok"
    finally:
        gate.touch()
        caller.join(90)
    status, _, body = answered["slow"]
    assert status == 400 and error_of(body)["code"] == "context_length_exceeded"


def test_a_tokenizer_that_fails_mid_stream_ends_the_stream_with_an_error_event(server):
    status, _, body = post(server, "/completions", {
        "model": "broken", "prompt": [97, 98, BROKEN, 99], "stream": True})
    events = events_of(body)
    assert status == 200
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["a", "b"]
    error = json.loads(events[-1])["error"]
    assert error["type"] == "server_error" and "BROKEN" in error["message"], error


def test_prompt_token_ids_outside_the_vocabulary_are_refused(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="echo", prompt=[97, EOS + 1])
    assert refused.value.body["param"] == "prompt"
    assert f"0..{EOS}" in refused.value.body["message"]


def test_a_model_answering_an_id_outside_the_vocabulary_fails_its_request(server):
    status, _, body = post(server, "/completions", {"model": "beyond", "prompt": "ab"})
    error = error_of(body)
    assert status == 500 and error["code"] == "BackendError"
    assert str(OUTSIDE) in error["message"]


def test_a_model_answering_an_id_outside_the_vocabulary_ends_its_stream_so(server):
    status, _, body = post(server, "/completions", {"model": "beyond", "prompt": "ab",
                                                    "stream": True})
    events = events_of(body)
    assert status == 200 and "[DONE]" not in events
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "ab"
    assert json.loads(events[-1])["error"]["code"] == "BackendError"


def _oip(server, body: dict):
    """(status, body) of one POST of body to the echo engine's generate_stream."""
    engine = server.names["echo"]
    request = urllib.request.Request(
        f"http://{server.url}/v2/models/{engine}/generate_stream",
        data=json.dumps(body).encode(), method="POST",
        headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


@pytest.mark.parametrize("request_id", ["x" * 20_000, {"nested": ["id"] * 1000}, 7],
                         ids=["long", "object", "number"])
def test_a_streamed_requests_id_is_a_bounded_string(server, request_id):
    status, body = _oip(server, {"INPUT": [97, 98], "id": request_id})
    assert status == 400 and "id: expected a string of at most 256 characters" in \
        json.loads(body)["error"]


def test_a_streamed_requests_id_within_its_bound_is_echoed(server):
    status, body = _oip(server, {"INPUT": [97, 98], "id": "i" * 256})
    assert status == 200
    assert all(json.loads(e)["id"] == "i" * 256 for e in events_of(body))


@pytest.mark.parametrize("path, body, field", [
    ("/completions", b'{"model": "echo", "prompt": "a\\ud800b"}', "prompt"),
    ("/embeddings", b'{"model": "embed", "input": ["ok", "\\udfff"]}', "input"),
    ("/chat/completions",
     b'{"model": "echo", "messages": [{"role": "user", "content": "\\ud83d"}]}', "messages")],
    ids=["prompt", "input", "messages"])
def test_a_lone_surrogate_is_refused_naming_its_field(server, path, body, field):
    status, _, answer = post(server, path, body)
    error = error_of(answer)
    assert status == 400 and error["param"] == field and "surrogate" in error["message"]


def test_an_empty_prompt_is_completed_from_the_models_start(server):
    done = client(server).completions.create(model="echo", prompt="", max_tokens=4)
    # Counted has no bos: the start is its eos, which Echo answers back first
    assert done.usage.prompt_tokens == 1 and done.choices[0].finish_reason == "stop"


def test_embeddings_dimensions_are_the_first_values_at_unit_length(server):
    done = client(server).embeddings.create(model="embed", input=[[3, 4, 5], [1, 2]],
                                            dimensions=2)
    for got, ids in zip(done.data, ([3, 4, 5], [1, 2])):
        head = embedding(ids)[:2]
        norm = math.hypot(*head)
        assert got.embedding == pytest.approx([v / norm for v in head], rel=1e-6)


@pytest.mark.parametrize("dimensions", [0, 5, 2.5, "2"])
def test_embeddings_dimensions_past_the_models_size_are_refused(server, dimensions):
    status, _, body = post(server, "/embeddings", {"model": "embed", "input": "ab",
                                                   "dimensions": dimensions})
    error = error_of(body)
    assert status == 400 and error["param"] == "dimensions" and "1..4" in error["message"]


def test_a_prompt_over_the_models_context_is_context_length_exceeded(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="echo", prompt=[97] * 65)
    body = refused.value.body
    assert (body["param"], body["code"]) == ("prompt", "context_length_exceeded")
