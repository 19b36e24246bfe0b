"""POST /v1/embeddings on a one-shot engine, called with the openai client (sync, async):
each input is one engine request, and tests/openai_models.py's embedder answers each
with (length, sum, first, last) of its own token ids."""
import asyncio
import base64
import json

import numpy as np
import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from openai_models import embedding  # noqa: E402
from openai_served import (  # noqa: E402
    EMBED,
    STEPS,
    async_client,
    client,
    post,
    requests_total,
    serve,
)

BYTES = {"tokenizer": "openai_models:bytes_tokenizer"}
CAPACITY = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve(tmp_path_factory.mktemp("embeddings"), {
        "vectors": (dict(EMBED, queue_capacity=CAPACITY, max_batch_size=4), BYTES),
        "echo": (dict(backend="openai_models:echo", **STEPS), BYTES),
    })
    yield served
    served.stop()


def ids(text: str) -> list:
    return list(text.encode())


def test_a_string_is_embedded_with_its_token_count(server):
    done = client(server).embeddings.create(model="vectors", input="héllo",
                                            encoding_format="float")
    assert [d.embedding for d in done.data] == [embedding(ids("héllo"))]
    assert (done.usage.prompt_tokens, done.usage.total_tokens) == (6, 6)
    assert done.model == "vectors" and done.object == "list"


def test_each_string_of_a_list_is_one_engine_request_answered_in_order(server):
    texts = ["a", "bb", "ccc ü", "dddd"]
    before = requests_total(server.names["vectors"])
    done = client(server).embeddings.create(model="vectors", input=texts,
                                            encoding_format="float")
    assert requests_total(server.names["vectors"]) - before == len(texts)
    assert [d.index for d in done.data] == [0, 1, 2, 3]
    assert [d.embedding for d in done.data] == [embedding(ids(t)) for t in texts]
    assert done.usage.prompt_tokens == sum(len(ids(t)) for t in texts)


def test_token_ids_and_lists_of_them_are_embedded_as_they_are(server):
    c = client(server)
    one = c.embeddings.create(model="vectors", input=[5, 6, 7], encoding_format="float")
    assert [d.embedding for d in one.data] == [embedding([5, 6, 7])]
    many = c.embeddings.create(model="vectors", input=[[1], [2, 3], [300, 4, 9]],
                               encoding_format="float")
    assert [d.embedding for d in many.data] == [embedding([1]), embedding([2, 3]),
                                                embedding([300, 4, 9])]
    assert many.usage.prompt_tokens == 6


def test_base64_is_each_embeddings_float32_bytes(server):
    status, _, body = post(server, "/embeddings", {"model": "vectors", "input": ["xy", "z"],
                                                   "encoding_format": "base64"})
    assert status == 200
    got = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist()
           for d in json.loads(body)["data"]]
    assert got == [embedding(ids("xy")), embedding(ids("z"))]


def test_the_clients_default_encoding_comes_back_as_floats(server):
    done = client(server).embeddings.create(model="vectors", input="default")
    assert [d.embedding for d in done.data] == [embedding(ids("default"))]


def test_the_async_client_embeds(server):
    async def embed():
        async with async_client(server) as c:
            return await asyncio.gather(*(c.embeddings.create(
                model="vectors", input=[f"text {i}", "ü" * i or "x"], encoding_format="float")
                for i in range(CAPACITY // 2)))  # within the queue: 2 inputs each

    for i, done in enumerate(asyncio.run(embed())):
        assert [d.embedding for d in done.data] == [embedding(ids(f"text {i}")),
                                                    embedding(ids("ü" * i or "x"))]


def test_more_inputs_than_the_queue_holds_are_refused_before_any_is_enqueued(server):
    before = requests_total(server.names["vectors"])
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).embeddings.create(model="vectors", input=["a"] * (CAPACITY + 1))
    assert refused.value.body["param"] == "input"
    assert str(CAPACITY) in refused.value.body["message"]
    assert requests_total(server.names["vectors"]) == before


def test_an_input_longer_than_the_engine_takes_is_refused(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).embeddings.create(model="vectors", input="x" * 33)
    assert "at most 32 tokens" in refused.value.body["message"]


def test_an_input_of_another_form_is_refused(server):
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).embeddings.create(model="vectors", input=[["a"], 3])
    assert refused.value.body["param"] == "input"


def test_an_encoding_other_than_float_or_base64_is_refused(server):
    status, _, body = post(server, "/embeddings", {"model": "vectors", "input": "a",
                                                   "encoding_format": "int8"})
    assert status == 400 and json.loads(body)["error"]["param"] == "encoding_format"


def test_each_kind_of_engine_refuses_the_other_kinds_route(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as refused:
        c.embeddings.create(model="echo", input="a")
    assert "/v1/completions" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        c.completions.create(model="vectors", prompt="a")
    assert "/v1/embeddings" in refused.value.body["message"]
