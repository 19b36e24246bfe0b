"""POST /v1/embeddings on a one-shot engine, called with the openai client (sync, async):
each input is one engine request, and tests/openai_models.py's embedder answers each
with (length, sum, first, last) of its own token ids. POST /v1/rerank and /rerank on a
one-shot reranker: each document one engine request of its pair with the query, which
tests/openai_models.py's scorer answers with its relevance()."""
import asyncio
import base64
import json

import numpy as np
import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from openai_models import EOS, embedding, relevance  # noqa: E402
from openai_served import (  # noqa: E402
    EMBED,
    RANK,
    STEPS,
    async_client,
    client,
    post,
    requests_total,
    serve,
)

from engine.config import EngineConfig  # noqa: E402
from engine.http.openai import rerank, settings  # noqa: E402
from engine.http.openai.text import TokenizerFailed  # noqa: E402

BYTES = {"tokenizer": "openai_models:bytes_tokenizer"}
CAPACITY = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve(tmp_path_factory.mktemp("embeddings"), {
        "vectors": (dict(EMBED, queue_capacity=CAPACITY, max_batch_size=4), BYTES),
        "echo": (dict(backend="openai_models:echo", **STEPS), BYTES),
        "ranker": (dict(RANK, queue_capacity=CAPACITY, max_batch_size=4),
                   {**BYTES, "task": "rerank"}),
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


QUERY = "cat food"
DOCUMENTS = ["dog", "a cat", {"text": "food for cats"}, "tac", "xyz", "doof"]


def scores(query: str, texts) -> list:
    """The model's own score of each (query, document): the routes join Bytes' pair with EOS."""
    return [float(np.float32(relevance(ids(query) + [EOS] + ids(t)))) for t in texts]


@pytest.mark.parametrize("root", [False, True])  # /v1/rerank and /rerank
def test_rerank_orders_the_documents_by_the_models_own_scores(server, root):
    texts = [d["text"] if isinstance(d, dict) else d for d in DOCUMENTS]
    want = scores(QUERY, texts)
    before = requests_total(server.names["ranker"])
    status, _, body = post(server, "/rerank", {"model": "ranker", "query": QUERY,
                                               "documents": DOCUMENTS}, root=root)
    assert status == 200, body
    assert requests_total(server.names["ranker"]) - before == len(DOCUMENTS)  # one a pair
    done = json.loads(body)
    order = sorted(range(len(texts)), key=lambda i: -want[i])  # ties: the documents' order
    assert [r["index"] for r in done["results"]] == order
    assert [r["relevance_score"] for r in done["results"]] == [want[i] for i in order]
    assert [r["document"]["text"] for r in done["results"]] == [texts[i] for i in order]
    assert done["usage"]["total_tokens"] == sum(len(ids(QUERY)) + 1 + len(ids(t)) for t in texts)
    assert done["model"] == "ranker" and done["id"].startswith("rerank-")


def test_rerank_top_n_keeps_the_best_and_return_documents_false_leaves_their_text(server):
    status, _, body = post(server, "/rerank", {"model": "ranker", "query": QUERY,
                                               "documents": DOCUMENTS, "top_n": 2,
                                               "return_documents": False})
    results = json.loads(body)["results"]
    assert status == 200 and [r["index"] for r in results] == [2, 1]
    assert all(set(r) == {"index", "relevance_score"} for r in results)


def test_more_documents_than_the_queue_holds_are_refused_before_any_is_enqueued(server):
    before = requests_total(server.names["ranker"])
    status, _, body = post(server, "/rerank", {"model": "ranker", "query": "q",
                                               "documents": ["d"] * (CAPACITY + 1)})
    error = json.loads(body)["error"]
    assert status == 400 and error["param"] == "documents"
    assert f"at most {CAPACITY} documents" in error["message"]
    assert requests_total(server.names["ranker"]) == before


def test_a_document_too_long_with_its_query_refuses_the_request_naming_it(server):
    before = requests_total(server.names["ranker"])
    status, _, body = post(server, "/rerank", {"model": "ranker", "query": "q" * 30,
                                               "documents": ["fits", "d" * 34]})  # 30 + 1 + 34
    error = json.loads(body)["error"]
    assert status == 400 and (error["param"], error["code"]) == ("documents",
                                                                "context_length_exceeded")
    assert error["message"].startswith("documents[1] with the query: expected at most 64")
    assert requests_total(server.names["ranker"]) == before


@pytest.mark.parametrize("fields, param", [
    ({"query": ""}, "query"), ({"query": ["a"]}, "query"), ({"documents": []}, "documents"),
    ({"documents": ["a", 3]}, "documents"), ({"documents": [{"txt": "a"}]}, "documents"),
    ({"top_n": -1}, "top_n"), ({"return_documents": "yes"}, "return_documents"),
    ({"priority": "high"}, "priority")])
def test_a_rerank_field_of_another_form_is_refused_naming_it(server, fields, param):
    status, _, body = post(server, "/rerank", {"model": "ranker", "query": "q",
                                               "documents": ["d"], **fields})
    assert status == 400 and json.loads(body)["error"]["param"] == param


def test_rerank_needs_a_reranker_and_a_reranker_serves_nothing_else(server):
    status, _, body = post(server, "/rerank", {"model": "vectors", "query": "q",
                                               "documents": ["d"]})
    assert status == 400 and "serves /v1/embeddings, got /v1/rerank" in body.decode()
    status, _, body = post(server, "/rerank", {"model": "nobody", "query": "q",
                                               "documents": ["d"]})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).embeddings.create(model="ranker", input="a")
    assert "serves /v1/rerank and /rerank" in refused.value.body["message"]


class PairEncoding:
    """A transformers tokenizer's encode, pair and all."""

    def encode(self, text, text_pair=None, add_special_tokens=True):
        return [101, *ids(text), 102, *ids(text_pair or ""), 102]


class Separated:
    sep_token_id, eos_token_id = 3, 4
    encode = staticmethod(ids)


def test_a_pair_is_the_tokenizers_pair_encoding_else_joined_by_its_sep_or_eos():
    assert rerank.pairing(PairEncoding(), "e")("q", ["ab", ""]) == [[101, 113, 102, 97, 98, 102],
                                                                   [101, 113, 102, 102]]
    assert rerank.pairing(Separated(), "e")("q", ["ab"]) == [[113, 3, 97, 98]]

    class Eos:
        eos_token_id = 4
        encode = staticmethod(ids)

    assert rerank.pairing(Eos(), "e")("q", ["ab"]) == [[113, 4, 97, 98]]

    class Neither:
        encode = staticmethod(ids)

    with pytest.raises(TokenizerFailed, match="engine 'e'.*sep_token_id or eos_token_id"):
        rerank.pairing(Neither(), "e")


@pytest.mark.parametrize("task, engine, reason", [
    ("rerank", dict(output_shape=(4,), output_dtype="float32"),
     "a reranker answers a score: expected its output to be a float [] or [1], got float32[4]"),
    ("generate", dict(output_shape=(), output_dtype="float32"),
     "a one-shot engine's task is one of ['embed', 'rerank'], got task = 'generate'"),
    ("rerank", dict(iterative=True, output_shape=(), output_dtype="int64"),
     "an iterative engine's task is one of ['generate'], got task = 'rerank'")])
def test_an_openai_tables_task_must_be_one_its_engine_can_do(task, engine, reason):
    config = EngineConfig(name="e", input_shape=(None,), max_input_shape=(64,),
                          input_dtype="int64", **engine)
    with pytest.raises(ValueError) as refused:
        settings.parse("e", {**BYTES, "task": task}, config)
    assert str(refused.value) == f"[engines.e.openai]: {reason}"
