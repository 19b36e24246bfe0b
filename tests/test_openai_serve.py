"""[engines.NAME.openai] in `shmbatch serve --config`: a table that cannot serve fails the
start with one line naming what was expected and what came, leaving nothing; a one-engine
file takes an [openai] table; a request past the server's timeout is 504 (a stream's, an
error event)."""
import json

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from conftest import shm_entries, unique_name  # noqa: E402
from openai_served import (  # noqa: E402
    EMBED,
    SLOW,
    STEPS,
    client,
    openai_table,
    post,
    serve,
    slot_comes_back,
)
from test_multi_engine import Served, failed_serve, table, toml_value, top  # noqa: E402

ECHO = dict(backend="openai_models:echo", **STEPS)
BYTES = {"tokenizer": "openai_models:bytes_tokenizer"}


@pytest.fixture(scope="module")
def impatient(tmp_path_factory):
    """A server whose requests have 1 s."""
    served = serve(tmp_path_factory.mktemp("timeouts"), {
        "slow": (SLOW, {"tokenizer": "openai_models:no_eos_tokenizer"})}, http_timeout_s=1.0)
    yield served
    served.stop()


def test_an_answer_past_the_servers_timeout_is_504(impatient):
    with pytest.raises(openai.APIStatusError) as refused:
        client(impatient).completions.create(model="slow", prompt="endless", max_tokens=1000)
    assert refused.value.status_code == 504
    assert (refused.value.body["type"], refused.value.body["code"]) == ("server_error",
                                                                      "RequestTimeout")


def test_a_stream_past_the_servers_timeout_ends_with_an_error_event(impatient):
    slot_comes_back(impatient)  # the one slot, once another test's request left it
    status, _, body = post(impatient, "/completions", {"model": "slow", "prompt": "endless",
                                                       "max_tokens": 1000, "stream": True})
    events = [e[len("data: "):] for e in body.decode().split("\n\n") if e]
    assert status == 200 and "[DONE]" not in events, body
    texts = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert texts == ("endless" + "." * 1000)[:len(texts)] and texts
    assert json.loads(events[-1])["error"]["code"] == "RequestTimeout"


def test_a_one_engine_file_takes_an_openai_table(tmp_path):
    name = unique_name("single")
    keys = "".join(f"{k} = {toml_value(v)}\n" for k, v in {**ECHO, "name": name}.items())
    text = "http_port = 0\n" + keys + \
        '[openai]\ntokenizer = "openai_models:bytes_tokenizer"\nmodel = "solo"\n'
    served = Served(tmp_path, text)
    try:
        served.base_url = f"http://{served.url}/v1"
        assert [m.id for m in client(served).models.list()] == ["solo"]
        assert client(served).completions.create(model="solo", prompt="one").choices[0].text \
            == "one"
    finally:
        assert served.stop() == 0, served.stderr()


@pytest.mark.parametrize("engine, openai_keys, reason", [
    (ECHO, {"tokenizer": "no_colon"}, 'expected tokenizer = "module:factory", got \'no_colon\''),
    (ECHO, {**BYTES, "vocab": 3}, "unknown key(s) vocab; expected some of tokenizer"),
    (ECHO, {**BYTES, "model": ""}, "expected model = a name of 1 to 256 characters"),
    (dict(ECHO, output_dtype="float32"), BYTES,
     "expected its output to be an integer [] or [1], got float32[]"),
    (dict(EMBED, output_dtype="int64"), BYTES, "expected its output to be floats [d]"),
    (dict(ECHO, input_dtype="float32"), BYTES, "(the engine has 0 integer input(s)"),
    (ECHO, {**BYTES, "defaults": {"seed": 1}}, "defaults: expected inputs among [], got seed"),
])
def test_an_openai_table_that_cannot_serve_its_engine_fails_the_start(tmp_path, engine,
                                                                      openai_keys, reason):
    name = unique_name("bad")
    rc, lines = failed_serve(tmp_path, top(http_port=0) + table(name, **engine)
                             + openai_table(name, **openai_keys))
    assert rc != 0 and len(lines) == 1 and reason in lines[0], lines
    assert f"[engines.{name}.openai]" in lines[0]
    assert not [e for e in shm_entries() if name in e]


def test_two_engines_under_one_model_name_fail_the_start(tmp_path):
    a, b = unique_name("twin"), unique_name("twin")
    rc, lines = failed_serve(tmp_path, top(http_port=0)
                             + table(a, **ECHO) + openai_table(a, **BYTES, model="same")
                             + table(b, **ECHO) + openai_table(b, **BYTES, model="same"))
    assert rc != 0 and len(lines) == 1 and "expected a model name of its own" in lines[0], lines


def test_an_openai_table_needs_the_http_port(tmp_path):
    name = unique_name("nohttp")
    rc, lines = failed_serve(tmp_path, table(name, **ECHO) + openai_table(name, **BYTES))
    assert rc != 0 and len(lines) == 1 and "expected --http-port" in lines[0], lines


def test_a_tokenizer_that_does_not_load_fails_the_start_naming_its_engine(tmp_path):
    name = unique_name("notok")
    rc, lines = failed_serve(tmp_path, top(http_port=0) + table(name, **ECHO)
                             + openai_table(name, tokenizer="openai_models:failing_tokenizer"))
    assert rc != 0 and len(lines) == 1, lines
    assert f"engine {name!r}" in lines[0] and "RuntimeError: no vocabulary here" in lines[0]
    assert not [e for e in shm_entries() if name in e]
