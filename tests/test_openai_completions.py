"""POST /v1/completions and GET /v1/models, called with the openai client (sync, async,
streaming): each answer checked against its own prompt (tests/openai_models.py's Echo
answers its prompt back, then EOS)."""
import asyncio
import json

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from openai_models import EOS  # noqa: E402
from openai_served import (  # noqa: E402
    EMBED,
    STEPS,
    async_client,
    client,
    post,
    serve,
)

BYTES = {"tokenizer": "openai_models:bytes_tokenizer"}
TEXT = "héllo wörld € 😀"  # characters of 1, 2, 3 and 4 bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve(tmp_path_factory.mktemp("completions"), {
        "echo": (dict(backend="openai_models:echo", **STEPS), BYTES),
        "vectors": (EMBED, BYTES),
        "bare": (dict(backend="openai_models:echo", **STEPS), None),  # no openai table
    })
    yield served
    served.stop()


def tokens(text: str) -> int:
    return len(text.encode())


def test_the_models_route_lists_the_engines_that_have_an_openai_table(server):
    c = client(server)
    assert sorted(m.id for m in c.models.list()) == ["echo", "vectors"]
    assert c.models.retrieve("echo").id == "echo"


def test_a_completion_answers_its_prompt_and_ends_at_the_tokenizers_eos(server):
    done = client(server).completions.create(model="echo", prompt=TEXT)
    assert done.choices[0].text == TEXT
    assert done.choices[0].finish_reason == "stop"
    n = tokens(TEXT)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) \
        == (n, n + 1, 2 * n + 1)  # the eos token counts, its text is none


def test_a_prompt_of_token_ids_is_taken_as_it_is(server):
    done = client(server).completions.create(model="echo", prompt=[104, 195, 169, 33])
    assert done.choices[0].text == "hé!"
    assert done.usage.prompt_tokens == 4


def test_max_tokens_cuts_the_answer_with_finish_reason_length(server):
    done = client(server).completions.create(model="echo", prompt="abcdefgh", max_tokens=3)
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("abc", "length")
    assert done.usage.completion_tokens == 3


def test_max_tokens_that_ends_inside_a_character_never_answers_half_of_it(server):
    done = client(server).completions.create(model="echo", prompt="a€b", max_tokens=2)
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("a\ufffd", "length")


def test_the_model_saying_done_finishes_with_stop(server):
    done = client(server).completions.create(model="echo", prompt="ab\x04cd")
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("ab\x04", "stop")
    assert done.usage.completion_tokens == 3


def test_a_stop_string_ends_the_answer_before_it(server):
    done = client(server).completions.create(model="echo", prompt="one, two. three. four",
                                             stop=["four", ". "])
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("one, two", "stop")
    assert done.usage.completion_tokens == tokens("one, two. ")  # up to the stop's end


def test_a_stop_string_that_never_comes_holds_nothing_back(server):
    done = client(server).completions.create(model="echo", prompt="ab xy", stop="xyz")
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("ab xy", "stop")


def test_no_streamed_piece_holds_any_part_of_a_stop_string(server):
    chunks = list(client(server).completions.create(
        model="echo", prompt="hello wörld again", stop=["wörld"], stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == "hello "
    assert not any("w" in p for p in pieces)  # held back: it might have begun the stop
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


def test_a_stream_never_splits_a_character(server):
    chunks = list(client(server).completions.create(model="echo", prompt=TEXT, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == TEXT
    assert "😀" in pieces and "€" in pieces  # 4 and 3 tokens, each one piece
    assert not any("\ufffd" in p for p in pieces)
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "text_completion"


def test_a_stream_is_server_sent_events_ending_with_done(server):
    status, headers, body = post(server, "/completions", {"model": "echo", "prompt": "xy",
                                                          "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e[len("data: "):] for e in body.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    answers = [json.loads(e) for e in events[:-1]]
    assert "".join(a["choices"][0]["text"] for a in answers) == "xy"
    assert answers[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("usage" not in a for a in answers)


def test_include_usage_adds_a_last_chunk_of_usage_alone(server):
    chunks = list(client(server).completions.create(
        model="echo", prompt="abc", max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens,
            last.usage.total_tokens) == (3, 2, 5)
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == "ab"
    assert chunks[-2].choices[0].finish_reason == "length"


def test_the_eos_token_ends_a_stream_without_its_text(server):
    chunks = list(client(server).completions.create(model="echo", prompt=[97, EOS, 98],
                                                    stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "a"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_async_client_completes_and_streams(server):
    async def both():
        async with async_client(server) as c:
            whole = await c.completions.create(model="echo", prompt="async é")
            stream = await c.completions.create(model="echo", prompt="streamed ü", stream=True)
            pieces = [chunk.choices[0].text async for chunk in stream]
            return whole, pieces

    whole, pieces = asyncio.run(both())
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == ("async é", "stop")
    assert "".join(pieces) == "streamed ü"


def test_concurrent_completions_each_get_their_own_answer(server):
    async def many():
        async with async_client(server) as c:
            return await asyncio.gather(*(c.completions.create(
                model="echo", prompt=f"request {i} ✓", max_tokens=40) for i in range(16)))

    answers = asyncio.run(many())
    assert [a.choices[0].text for a in answers] == [f"request {i} ✓" for i in range(16)]
