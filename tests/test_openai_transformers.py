"""A transformers tokenizer works as it is (a byte-level BPE, whose tokens split UTF-8
characters, and whose chat template answers a BatchEncoding): Echo answers the prompt's
token ids back, so the text is the prompt's, in whole characters."""
import asyncio

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")
from openai_models import hf_tokenizer  # noqa: E402
from openai_served import STEPS, async_client, client, serve  # noqa: E402

TEXT = "café in Zürich: €5 😀, 日本 ß"  # the last three unseen in training: bytes apart


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    eos = hf_tokenizer().eos_token_id
    served = serve(tmp_path_factory.mktemp("transformers"), {
        "bpe": (dict(backend="openai_models:echo", backend_args={"eos": eos, "marks": False}, **STEPS),
                {"tokenizer": "openai_models:hf_tokenizer"})})
    yield served
    served.stop()


def test_a_completion_through_a_transformers_tokenizer_answers_its_prompt(server):
    done = client(server).completions.create(model="bpe", prompt=TEXT, max_tokens=64)
    assert (done.choices[0].text, done.choices[0].finish_reason) == (TEXT, "stop")
    assert done.usage.prompt_tokens == len(hf_tokenizer().encode(TEXT))


def test_a_stream_through_a_byte_level_bpe_never_splits_a_character(server):
    async def pieces():
        async with async_client(server) as c:
            stream = await c.completions.create(model="bpe", prompt=TEXT * 2, max_tokens=128,
                                                stream=True)
            return [chunk.choices[0].text async for chunk in stream]

    got = asyncio.run(pieces())
    assert "".join(got) == TEXT * 2
    assert not any("\ufffd" in p for p in got)


def test_a_chat_through_a_transformers_chat_template(server):
    messages = [{"role": "user", "content": "Hello Ada 😀"}]
    done = client(server).chat.completions.create(model="bpe", messages=messages)
    want = hf_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=False)
    assert done.choices[0].message.content == want
