"""POST /v1/rerank and /rerank on a one-shot engine whose openai table says task = "rerank".

Jina's and Cohere's shape, as vLLM, TEI and aiperf speak it: `query`,
`documents` (strings, or objects with a `text`), `top_n`, `return_documents`.
Each document is one engine request of the query and the document tokenized
as a pair, all enqueued at once from the event loop so that they batch with
everyone's (a refusal of any withdraws those enqueued before it); the model
answers each a score. The answer lists the documents by score, highest
first (ties in the documents' order), the first top_n of them (absent or 0:
all), each with its index and, unless return_documents is false, its text;
usage counts every pair's tokens. The documents are at most the model's
most_inputs (each an engine request, as an embeddings request's inputs are);
every text is checked (its length, valid Unicode) before the first is
tokenized, and each pair against the model's context.

A pair is the tokenizer's own pair encoding when its encode takes a
text_pair (a transformers tokenizer's: a cross-encoder's [CLS] query [SEP]
document [SEP]); else the query's ids, the tokenizer's sep_token_id (else its
eos_token_id), then the document's ids. A reranker whose tokenizer has
neither fails the HTTP worker's start, naming its engine.
"""
import inspect
import json
import math
import uuid
from typing import Callable, List, Optional

import numpy as np

from engine.http.asgi import Receive, Send, send_whole
from engine.http.openai import fields
from engine.http.openai.replies import OpenAIError, bad
from engine.http.openai.text import TokenizerFailed, id_list
from engine.http.values import json_text
from engine.http.watch import watched_answers

Pairing = Callable[[str, List[str]], List[List[int]]]


def pairing(tokenizer, engine: str) -> Pairing:
    """How a reranker's tokenizer makes the token ids of (query, document)
    for each document; TokenizerFailed naming the engine if it cannot."""
    try:
        takes_pair = "text_pair" in inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        takes_pair = False
    if takes_pair:
        return lambda query, documents: [
            id_list(tokenizer.encode(query, text_pair=d), "encode") for d in documents]
    sep = next((t for t in (getattr(tokenizer, "sep_token_id", None),
                            getattr(tokenizer, "eos_token_id", None))
                if type(t) is int and t >= 0), None)
    if sep is None:
        raise TokenizerFailed(f"engine {engine!r}: a reranker's tokenizer makes (query, "
                              f"document) pairs: expected an encode(text, text_pair), or a "
                              f"sep_token_id or eos_token_id to join them, got "
                              f"{type(tokenizer).__name__} with none")

    def joined(query: str, documents: List[str]) -> List[List[int]]:
        head = id_list(tokenizer.encode(query), "encode") + [sep]
        return [head + id_list(tokenizer.encode(d), "encode") for d in documents]
    return joined


async def answer(client, served: fields.Served, pair: Pairing, body: dict, timeout_s: float,
                 priority: int, receive: Receive, send: Send) -> None:
    """Answers the request through send (an error before that is raised)."""
    query, documents = body.get("query"), body.get("documents")
    if not isinstance(query, str) or not query:
        raise bad(f"query: expected a non-empty string, got {json_text(query)}", "query")
    texts = _documents(served, documents)
    top_n = _top_n(body)
    keep = body.get("return_documents") is None or fields.flag(body, "return_documents")
    served.check_text(query, "query")
    for i, text in enumerate(texts):  # every text checked before the first is tokenized
        served.check_text(text, f"documents[{i}]")
    chars = len(query) * len(texts) + sum(map(len, texts))
    try:
        pairs = await served.tokens_of.run(chars, pair, query, texts)
    except ValueError as e:
        raise OpenAIError(500, f"model {served.model!r}: {e}") from None
    requests = [served.request(ids, body, "documents", f"documents[{i}] with the query")
                for i, ids in enumerate(pairs)]
    answers = await watched_answers(client, requests, timeout_s, priority, receive)
    if answers is None:  # their caller left
        return
    scores = [_score(served, a, i) for i, a in enumerate(answers)]
    order = sorted(range(len(texts)), key=lambda i: -scores[i])  # stable: ties in order
    results = []
    for i in order[:top_n or None]:
        result: dict = {"index": i, "relevance_score": scores[i]}
        if keep:
            result["document"] = {"text": texts[i]}
        results.append(result)
    out = {"id": "rerank-" + uuid.uuid4().hex, "model": served.model, "results": results,
           "usage": {"total_tokens": sum(map(len, pairs))}}
    await send_whole(send, 200, json.dumps(out).encode())


def _documents(served: fields.Served, documents) -> List[str]:
    """The documents' texts: their count checked before anything else."""
    expected = "a non-empty list of strings or of {\"text\": str}"
    if not isinstance(documents, list) or not documents:
        raise bad(f"documents: expected {expected}, got {json_text(documents)}", "documents")
    most = served.most_inputs
    if len(documents) > most:
        raise bad(f"documents: expected at most {most} documents (each one engine request, "
                  f"all enqueued at once: {fields.MAX_INPUTS}, or the engine's queue_capacity "
                  f"if smaller), got {len(documents)}", "documents")
    texts = []
    for i, d in enumerate(documents):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str):
            raise bad(f"documents[{i}]: expected a string or {{\"text\": str}}, got "
                      f"{json_text(d)}", "documents")
        texts.append(text)
    return texts


def _top_n(body: dict) -> Optional[int]:
    value = body.get("top_n")
    if value is not None and (type(value) is not int or value < 0):
        raise bad(f"top_n: expected an integer >= 0 (0 or absent: every document), got "
                  f"{json_text(value)}", "top_n")
    return value


def _score(served: fields.Served, answer, i: int) -> float:
    score = float(np.asarray(served.vector(answer)).reshape(-1)[0])
    if not math.isfinite(score):
        raise OpenAIError(500, f"model {served.model!r} answered documents[{i}] a score of "
                               f"{score}: expected a finite number")
    return score
