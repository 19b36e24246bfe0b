"""POST /v1/chat/completions, called with the openai client (sync, async, streaming): the
messages go through the tokenizer's chat template, and Echo answers the template's text
back (tests/openai_models.py), so each answer is checked against its own messages."""
import asyncio

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from openai_models import rendered  # noqa: E402
from openai_served import STEPS, async_client, client, serve  # noqa: E402

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi 😀 ü"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve(tmp_path_factory.mktemp("chat"), {
        "echo": (dict(backend="openai_models:echo", **STEPS),
                 {"tokenizer": "openai_models:bytes_tokenizer"}),
        "plain": (dict(backend="openai_models:echo", **STEPS),
                  {"tokenizer": "openai_models:plain_tokenizer"}),
    })
    yield served
    served.stop()


def test_a_chat_answers_the_assistants_message_through_the_chat_template(server):
    done = client(server).chat.completions.create(model="echo", messages=MESSAGES)
    choice = done.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", rendered(MESSAGES))
    assert choice.finish_reason == "stop" and done.object == "chat.completion"
    n = len(rendered(MESSAGES).encode())
    assert (done.usage.prompt_tokens, done.usage.completion_tokens,
            done.usage.total_tokens) == (n, n + 1, 2 * n + 1)


def test_a_messages_text_parts_are_joined(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one "},
                                          {"type": "text", "text": "two"}]}]
    done = client(server).chat.completions.create(model="echo", messages=parts)
    assert done.choices[0].message.content == rendered([{"role": "user", "content": "one two"}])


def test_max_completion_tokens_bounds_the_answer_before_max_tokens(server):
    c = client(server)
    done = c.chat.completions.create(model="echo", messages=MESSAGES, max_completion_tokens=5,
                                     max_tokens=9)
    assert (done.choices[0].message.content, done.choices[0].finish_reason) == ("<|sys", "length")
    done = c.chat.completions.create(model="echo", messages=MESSAGES, max_tokens=9)
    assert done.choices[0].message.content == "<|system|"
    assert done.usage.completion_tokens == 9


def test_a_stop_string_ends_the_message_before_it(server):
    done = client(server).chat.completions.create(model="echo", messages=MESSAGES,
                                                  stop=["brief"])
    assert done.choices[0].message.content == "<|system|>be "
    assert done.choices[0].finish_reason == "stop"


def test_a_streamed_chat_gives_the_role_then_the_content_in_whole_characters(server):
    chunks = list(client(server).chat.completions.create(model="echo", messages=MESSAGES,
                                                         stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    pieces = [c.choices[0].delta.content or "" for c in chunks]
    assert "".join(pieces) == rendered(MESSAGES)
    assert "😀" in pieces and not any("\ufffd" in p for p in pieces)
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_a_streamed_chat_with_include_usage_ends_with_its_usage(server):
    chunks = list(client(server).chat.completions.create(
        model="echo", messages=MESSAGES, max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.completion_tokens, chunks[-1].usage.prompt_tokens) == \
        (4, len(rendered(MESSAGES).encode()))
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "<|sy"


def test_the_async_client_chats_and_streams(server):
    async def both():
        async with async_client(server) as c:
            whole = await c.chat.completions.create(model="echo", messages=MESSAGES)
            stream = await c.chat.completions.create(model="echo", messages=MESSAGES[1:],
                                                     stream=True)
            pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]
            return whole, pieces

    whole, pieces = asyncio.run(both())
    assert whole.choices[0].message.content == rendered(MESSAGES)
    assert "".join(pieces) == rendered(MESSAGES[1:])


def test_a_tokenizer_without_a_chat_template_refuses_chats(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(model="plain", messages=MESSAGES)
    assert "apply_chat_template" in refused.value.body["message"]
    assert refused.value.body["param"] == "messages"
    done = client(server).completions.create(model="plain", prompt="still completes")
    assert done.choices[0].text == "still completes"


def test_messages_that_are_not_a_list_of_roles_are_refused(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).chat.completions.create(model="echo", messages=[{"content": "x"}])
    assert refused.value.body["param"] == "messages"
    assert refused.value.body["type"] == "invalid_request_error"
