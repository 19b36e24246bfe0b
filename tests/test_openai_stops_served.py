"""Stop strings through `shmbatch serve` and the openai client: the bounds of the
`stop` field, and text held back for the longest stops (a stop across tokens is in
tests/test_openai_completions.py)."""
import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from openai_served import STEPS, client, serve  # noqa: E402

from engine.http.openai.fields import MAX_STOP_CHARS, MAX_STOPS  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve(tmp_path_factory.mktemp("stops"), {
        "echo": (dict(backend="openai_models:echo", **STEPS),
                 {"tokenizer": "openai_models:bytes_tokenizer"}),
    })
    yield served
    served.stop()


def test_five_stops_are_refused_naming_stop(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="echo", prompt="x", stop=["a"] * 5)
    body = refused.value.body
    assert body["param"] == "stop" and f"at most {MAX_STOPS}" in body["message"]


def test_an_over_long_stop_is_refused_naming_stop(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "x"}],
            stop=["y" * (MAX_STOP_CHARS + 1)])
    body = refused.value.body
    assert body["param"] == "stop" and f"{MAX_STOP_CHARS + 1} characters" in body["message"]
    assert len(body["message"]) < 300


def test_text_held_back_for_the_longest_stops_comes_out_when_the_answer_ends(server):
    stops = ["a" * (MAX_STOP_CHARS - 1) + c for c in "bcde"]
    prompt = "a" * 40 + "b a"  # the echo model's input holds at most 64 tokens
    chunks = list(client(server).completions.create(model="echo", prompt=prompt, stop=stops,
                                                    max_tokens=64, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt
    assert chunks[-1].choices[0].finish_reason == "stop"
