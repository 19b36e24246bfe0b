"""The OpenAI API's refusals, in OpenAI's shape with the Open Inference Protocol front's
statuses; request fields passed as a named-tensor engine's inputs; callers that leave."""
import json

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from conftest import wait_for  # noqa: E402
from openai_models import FAIL  # noqa: E402
from openai_served import (  # noqa: E402
    SLOW,
    STEPS,
    TAGGED,
    client,
    post,
    raw_post,
    requests_total,
    serve,
    slot_comes_back,
    withdrawn,
)

from engine.http.openai import honoured  # noqa: E402
from engine.http.openai.replies import OpenAIError  # noqa: E402

BYTES = {"tokenizer": "openai_models:bytes_tokenizer"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve(tmp_path_factory.mktemp("errors"), {
        "echo": (dict(backend="openai_models:echo", **STEPS), BYTES),
        "tagged": (TAGGED, {**BYTES, "defaults": {"temperature": 1.0}}),
        "slow": (SLOW, {"tokenizer": "openai_models:no_eos_tokenizer"}),
    })
    yield served
    served.stop()


def error_of(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_an_unknown_model_is_404_in_openais_shape(server):
    with pytest.raises(openai.NotFoundError) as refused:
        client(server).completions.create(model="nobody", prompt="x")
    body = refused.value.body
    assert (body["type"], body["param"], body["code"]) == ("not_found_error", "model",
                                                          "model_not_found")
    assert "'nobody'" in body["message"] and "'echo'" in body["message"]


# each field that would change a greedy engine's answer, with a value that would
UNHONOURED = [("temperature", 0.7), ("temperature", 2), ("top_p", 0.9), ("top_k", 40),
              ("min_p", 0.1), ("n", 2), ("seed", 7), ("min_tokens", 4), ("ignore_eos", True),
              ("stop_token_ids", [10]), ("logprobs", 1), ("logprobs", 0), ("top_logprobs", 2),
              ("prompt_logprobs", 1), ("echo", True), ("presence_penalty", 0.5),
              ("frequency_penalty", -1), ("repetition_penalty", 1.2), ("logit_bias", {"5": 1}),
              ("allowed_token_ids", [1]), ("bad_words", ["x"]), ("use_beam_search", True),
              ("include_stop_str_in_output", True), ("best_of", 3), ("suffix", "!"),
              ("response_format", {"type": "json_object"})]


@pytest.mark.parametrize("field, value", UNHONOURED)
def test_a_completion_field_its_engine_cannot_honour_is_refused_naming_it(server, field, value):
    before = requests_total(server.names["echo"])
    status, _, body = post(server, "/completions", {"model": "echo", "prompt": "x", field: value})
    error = error_of(body)
    assert status == 400 and error["param"] == field, error
    assert f"expected {field} " in error["message"] and json.dumps(value) in error["message"]
    assert requests_total(server.names["echo"]) == before


def test_values_that_leave_the_greedy_answer_as_it_is_are_taken(server):
    c = client(server)
    for fields in ({"temperature": 0, "n": 2, "seed": 3}, {"temperature": 1, "top_p": 1},
                   {"top_k": -1, "min_p": 0, "min_tokens": 0, "ignore_eos": False,
                    "stop_token_ids": [], "logprobs": None, "echo": False, "logit_bias": {}}):
        done = c.completions.create(model="echo", prompt="ok", max_tokens=4, extra_body=fields)
        assert {ch.text for ch in done.choices} == {"ok"}, fields


@pytest.mark.parametrize("field, value", [
    ("n", 3), ("logprobs", True), ("top_logprobs", 2),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}])])
def test_a_chat_field_that_changes_the_answers_form_is_refused(server, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "x"}], extra_body={field: value})
    assert refused.value.body["param"] == field


def test_a_sampling_engine_would_take_the_sampling_fields_and_no_others():
    # the rule's table, read as it is for an engine whose config says sampling
    class Sampling:
        model, sampling, input_names = "s", True, frozenset()

    honoured.refuse_unhonoured(Sampling(), {"temperature": 0.7, "top_p": 0.9, "n": 4, "seed": 1,
                                            "logprobs": 2, "ignore_eos": True})
    with pytest.raises(OpenAIError) as refused:
        honoured.refuse_unhonoured(Sampling(), {"temperature": 0.7, "presence_penalty": 1})
    assert refused.value.param == "presence_penalty"


def test_other_fields_are_ignored(server):
    done = client(server).completions.create(model="echo", prompt="ok", n=1, user="someone",
                                             presence_penalty=0, extra_body={"top_k": -1})
    assert done.choices[0].text == "ok"


def test_fields_named_like_the_engines_inputs_are_passed_as_those_inputs(server):
    done = client(server).completions.create(model="tagged", prompt="hi", seed=7,
                                             temperature=0.25)
    assert done.choices[0].text == "7:0.25:hi"
    chat = client(server).chat.completions.create(
        model="tagged", messages=[{"role": "user", "content": "yo"}], seed=-2, temperature=0)
    assert chat.choices[0].message.content.startswith("-2:0.00:<|user|>yo")


def test_an_input_the_request_lacks_takes_its_default(server):
    done = client(server).completions.create(model="tagged", prompt="hi", seed=3)
    assert done.choices[0].text == "3:1.00:hi"


def test_an_input_without_a_field_or_a_default_is_refused(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="tagged", prompt="hi")
    assert refused.value.body["param"] == "seed"
    assert "int64[1]" in refused.value.body["message"]


def test_a_field_that_does_not_fit_its_input_is_refused(server):
    status, _, body = post(server, "/completions", {"model": "tagged", "prompt": "hi",
                                                    "seed": 1.5})
    assert status == 400 and error_of(body)["param"] == "seed"
    status, _, body = post(server, "/completions", {"model": "tagged", "prompt": "hi",
                                                    "seed": [1, 2]})
    assert status == 400 and error_of(body)["param"] == "seed"


def test_max_tokens_beyond_the_engines_max_steps_is_refused(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="echo", prompt="x", max_tokens=129)
    assert refused.value.body["param"] == "max_tokens"
    assert "[1, 128]" in refused.value.body["message"]


def test_a_prompt_longer_than_the_engine_takes_is_refused(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="echo", prompt="y" * 65)
    assert refused.value.body["param"] == "prompt"
    assert "at most 64 tokens" in refused.value.body["message"]


def test_a_full_queue_is_503_with_retry_after(server):
    c = client(server)
    holder = c.completions.create(model="slow", prompt="hold", max_tokens=60000, stream=True)
    try:
        assert next(iter(holder)).choices[0].text == "h"  # the one slot is held
        with pytest.raises(openai.InternalServerError) as refused:
            c.completions.create(model="slow", prompt="x")
        assert refused.value.status_code == 503
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert refused.value.body["code"] == "QueueFull"
    finally:
        holder.close()
    slot_comes_back(server)


def test_a_streaming_caller_that_disconnects_withdraws_its_request(server):
    before = withdrawn(server.names["slow"])
    stream = client(server).completions.create(model="slow", prompt="endless", max_tokens=60000,
                                               stream=True)
    pieces = iter(stream)
    assert [next(pieces).choices[0].text for _ in range(3)] == ["e", "n", "d"]
    stream.close()  # 65536 steps of 10 ms would hold the slot for minutes
    wait_for(lambda: withdrawn(server.names["slow"]) == before + 1, "the stream withdrawn", 60,
             every_s=0.05)
    slot_comes_back(server)


def test_a_caller_that_disconnects_before_its_whole_answer_withdraws_it(server):
    before, enqueued = withdrawn(server.names["slow"]), requests_total(server.names["slow"])
    sock = raw_post(server, "/completions", {"model": "slow", "prompt": "endless",
                                             "max_tokens": 60000})
    wait_for(lambda: requests_total(server.names["slow"]) == enqueued + 1,
             "the request enqueued", 60, every_s=0.05)
    sock.close()
    wait_for(lambda: withdrawn(server.names["slow"]) == before + 1, "the request withdrawn", 60,
             every_s=0.05)
    slot_comes_back(server)


@pytest.mark.parametrize("stream", [False, True])
def test_a_backend_error_before_the_first_token_is_500(server, stream):
    status, _, body = post(server, "/completions", {"model": "echo", "prompt": [FAIL],
                                                    "stream": stream})
    error = error_of(body)
    assert status == 500 and (error["type"], error["code"]) == ("server_error", "BackendError")
    assert "Echo fails" in error["message"]


def test_a_backend_error_mid_stream_ends_it_with_an_error_event_and_no_done(server):
    status, _, body = post(server, "/completions", {"model": "echo", "prompt": [97, 98, FAIL],
                                                    "stream": True})
    assert status == 200
    events = [e[len("data: "):] for e in body.decode().split("\n\n") if e]
    assert "[DONE]" not in events
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == ["a", "b"]
    assert json.loads(events[-1])["error"]["code"] == "BackendError"
    with pytest.raises(openai.APIError, match="Echo fails"):
        list(client(server).completions.create(model="echo", prompt=[97, FAIL], stream=True))


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    status, _, body = post(server, "/chat/completions", {
        "model": "echo", "messages": [{"role": "user", "content": "z" * (1 << 20)}]})
    assert status == 413
    assert error_of(body)["type"] == "invalid_request_error"


def test_a_body_that_is_not_a_json_object_is_400(server):
    for raw in (b"{not json", b"[1, 2]"):
        status, _, body = post(server, "/completions", raw)
        assert status == 400 and "expected a JSON object" in error_of(body)["message"]


def test_an_unknown_route_is_404_and_a_wrong_method_405(server):
    status, _, body = post(server, "/nothing", {"model": "echo"})
    assert status == 404 and error_of(body)["code"] == "unknown_url"
    status, headers, body = post(server, "/models", {})
    assert status == 405 and headers["allow"] == "GET"
    error_of(body)
