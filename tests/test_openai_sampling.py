"""The OpenAI routes on an engine that samples (engine.http.openai.sampled, .logprobs):
a V = 50 logit model whose every logit a test computes directly (tests/logit_models.py)
behind a tokenizer whose ids are texts, one letter each (openai_models.Letters), so that
each answer, logprob and echoed prompt is checked against the model alone."""
import json
import types

import numpy as np
import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from logit_models import EOS, FORCE_EOS, logits_of, prompt_logits  # noqa: E402
from openai_models import LETTERS  # noqa: E402
from openai_served import STEPS, client, post, serve  # noqa: E402
from test_sampling_engine import alone, greedy_chain, log_softmax  # noqa: E402

import engine  # noqa: E402
from engine.http.openai import sampled  # noqa: E402
from engine.http.openai.replies import OpenAIError  # noqa: E402

LOGITS = dict(backend="logit_models:logits", input_shape=["none"], max_input_shape=[16],
              input_dtype="int64", output_shape=[], output_dtype="int64", iterative=True,
              sampling=True, max_steps=16, eos_token_ids=[EOS], max_logprobs=5,
              prompt_logprobs=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve(tmp_path_factory.mktemp("sampling"), {
        "logits": (LOGITS, {"tokenizer": "openai_models:letters_tokenizer"}),
        "greedy": (dict(backend="openai_models:echo", **STEPS),
                   {"tokenizer": "openai_models:bytes_tokenizer"}),
    })
    yield served
    served.stop()


def ids(text: str) -> list:
    return [LETTERS.index(c) for c in text]


def text(tokens) -> str:
    """The answer's text of these tokens: up to the eos, without it."""
    tokens = list(tokens)
    return "".join(LETTERS[t] for t in (tokens[:tokens.index(EOS)] if EOS in tokens else tokens))


def to_eos(tokens) -> list:
    """The tokens an answer counts: up to the eos, with it."""
    tokens = list(tokens)
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens


def complete(server, path="/completions", **body) -> dict:
    status, _, raw = post(server, path, {"model": "logits", **body})
    assert status == 200, raw
    return json.loads(raw)


def streamed(server, path="/completions", **body) -> list:
    """The chunks of a streamed answer (its data events before [DONE])."""
    status, _, raw = post(server, path, {"model": "logits", "stream": True, **body})
    assert status == 200, raw
    events = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def expected_top(expected: np.ndarray, k: int) -> list:
    return np.argsort(-expected, kind="stable")[:k].tolist()


@pytest.mark.parametrize("prompt", ["dfh", [11, 2, 30, 7]])
def test_temperature_0_answers_the_greedy_chain_of_the_models_logits(server, prompt):
    prompt_ids = ids(prompt) if isinstance(prompt, str) else prompt
    chain = to_eos(greedy_chain(prompt_ids, 10))
    done = complete(server, prompt=prompt, max_tokens=10, temperature=0)
    choice = done["choices"][0]
    assert choice["text"] == text(chain)
    assert choice["finish_reason"] == ("stop" if chain[-1] == EOS else "length")
    assert done["usage"]["completion_tokens"] == len(chain)


def test_a_seeded_requests_choices_are_the_engines_draws_each_with_its_choices_seed(server):
    fields = dict(temperature=1.5, top_p=0.95, top_k=20, min_p=0.01)
    body = dict(prompt="dfh", max_tokens=8, seed=-7, n=3, **fields)
    first, again = complete(server, **body), complete(server, **body)
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]  # reproducible
    assert len(set(texts)) > 1  # each choice its own seed
    seed = -7 % 2**64  # OpenAI's seed taken mod 2**64
    for c, choice in enumerate(first["choices"]):
        s = engine.Sampling(seed=sampled.choice_seed(seed, c), **fields)
        assert choice["index"] == c and choice["text"] == text(alone(ids("dfh"), s, 8))
    # choice 0 is what that seed answers alone; a seed past 2**64 is taken mod 2**64
    one = complete(server, **{**body, "n": 1, "seed": 2**64 - 7})
    assert one["choices"][0]["text"] == texts[0]


def test_unseeded_choices_at_temperature_above_0_are_each_sampled(server):
    done = complete(server, prompt="dfh", max_tokens=8, temperature=2.0, n=6)
    assert [c["index"] for c in done["choices"]] == list(range(6))
    assert len({c["text"] for c in done["choices"]}) > 1


def test_each_tokens_logprobs_are_the_log_softmax_of_the_models_logits(server):
    prompt = ids("dfh")
    lp = complete(server, prompt="dfh", max_tokens=6, temperature=0,
                  logprobs=3)["choices"][0]["logprobs"]
    chain = to_eos(greedy_chain(prompt, 6))
    assert lp["tokens"] == [LETTERS[t] for t in chain]
    assert lp["text_offset"] == list(range(len(chain)))  # one letter a token
    for j, t in enumerate(chain):
        expected = log_softmax(logits_of(prompt, chain[:j]))
        assert lp["token_logprobs"][j] == pytest.approx(expected[t], abs=1e-4)
        # the top 3, and the token itself (OpenAI's "up to logprobs + 1")
        assert lp["top_logprobs"][j] == pytest.approx(
            {LETTERS[i]: expected[i] for i in [*expected_top(expected, 3), t]}, abs=1e-4)


def greedy_prompt(first: int, length: int) -> list:
    """A prompt whose every token is the model's most likely after the ones before."""
    prompt = [first]
    while len(prompt) < length:
        prompt.append(int(np.argmax(prompt_logits(prompt))))
    return prompt


def test_lm_evals_loglikelihood_request_gets_the_prompts_logprobs_as_the_model_gives_them(
        server):
    # lm-eval's local-completions: echo the context + continuation, read logprobs[ctxlen:-1]
    # and is_greedy from top_logprobs
    prompts = [greedy_prompt(3, 5), [11, 2, 30, 7, 1]]
    done = complete(server, prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0)
    ctxlen = 2
    for prompt, choice in zip(prompts, done["choices"]):
        lp = choice["logprobs"]
        first = greedy_chain(prompt, 1)[0]
        assert choice["text"] == text(prompt) + text([first])
        assert lp["tokens"] == [LETTERS[t] for t in prompt + [first]]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        expected = [log_softmax(prompt_logits(prompt[:j])) for j in range(1, len(prompt))]
        assert lp["token_logprobs"][1:-1] == pytest.approx(
            [e[t] for e, t in zip(expected, prompt[1:])], abs=1e-4)
        assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(
            sum(e[t] for e, t in zip(expected[ctxlen - 1:], prompt[ctxlen:])), abs=1e-4)
        greedy = all(tok == max(top.values()) for tok, top in
                     zip(lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1]))
        assert greedy == all(int(np.argmax(e)) == t
                             for e, t in zip(expected[ctxlen - 1:], prompt[ctxlen:]))
    assert [c["index"] for c in done["choices"]] == [0, 1]
    assert done["usage"]["prompt_tokens"] == 10


def test_echo_without_logprobs_answers_the_prompts_text_first(server):
    done = complete(server, prompt="dfh", max_tokens=3, echo=True, temperature=0)
    assert done["choices"][0]["text"] == "dfh" + text(greedy_chain(ids("dfh"), 3))
    assert done["choices"][0]["logprobs"] is None


def test_max_tokens_0_with_echo_answers_the_prompt_alone_with_its_logprobs(server):
    # OpenAI's legacy scoring call: the prompt's logprobs, no completion token
    prompt = [11, 2, 30, 7]
    done = complete(server, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    choice, lp = done["choices"][0], done["choices"][0]["logprobs"]
    assert (choice["text"], choice["finish_reason"]) == (text(prompt), "length")
    assert lp["tokens"] == [LETTERS[t] for t in prompt]
    expected = [log_softmax(prompt_logits(prompt[:j])) for j in range(1, len(prompt))]
    assert lp["token_logprobs"][1:] == pytest.approx(
        [e[t] for e, t in zip(expected, prompt[1:])], abs=1e-4)
    assert (done["usage"]["prompt_tokens"], done["usage"]["completion_tokens"]) == (4, 0)


def test_max_tokens_0_without_echo_is_refused_naming_the_field(server):
    status, _, raw = post(server, "/completions", {"model": "logits", "prompt": "dfh",
                                                   "max_tokens": 0})
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
    assert "0 only with echo" in json.loads(raw)["error"]["message"]


def joined(chunks: list, index: int) -> tuple:
    """(text, logprobs) of one choice's streamed chunks, its logprobs' lists concatenated."""
    mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
    logprobs = [m["logprobs"] for m in mine if m["logprobs"]]
    return "".join(m["text"] for m in mine), {
        key: [x for lp in logprobs for x in lp[key]] for key in logprobs[0]}


@pytest.mark.parametrize("fields", [dict(temperature=0), dict(temperature=0.8, seed=4, n=2)])
def test_streamed_logprobs_are_the_whole_answers_chunk_by_chunk(server, fields):
    body = dict(prompt="dfh", max_tokens=6, logprobs=2, echo=True, **fields)
    whole = complete(server, **body)["choices"]
    chunks = streamed(server, **body)
    for choice in whole:
        content, logprobs = joined(chunks, choice["index"])
        assert content == choice["text"]
        assert logprobs == choice["logprobs"]


def test_a_chat_answers_logprobs_in_the_chat_shape_streamed_or_not(server):
    messages = [{"role": "user", "content": "dfh"}]
    done = client(server).chat.completions.create(
        model="logits", messages=messages, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=2)
    prompt = ids("dfh") + ids("X")  # Letters' chat template
    chain = to_eos(greedy_chain(prompt, 5))
    content = done.choices[0].logprobs.content
    assert [e.token for e in content] == [LETTERS[t] for t in chain]
    for j, (e, t) in enumerate(zip(content, chain)):
        expected = log_softmax(logits_of(prompt, chain[:j]))
        assert e.logprob == pytest.approx(expected[t], abs=1e-4)
        assert e.bytes == list(e.token.encode())
        assert [(x.token, x.bytes) for x in e.top_logprobs] == [
            (LETTERS[i], list(LETTERS[i].encode())) for i in expected_top(expected, 2)]
        assert [x.logprob for x in e.top_logprobs] == pytest.approx(
            [expected[i] for i in expected_top(expected, 2)], abs=1e-4)
    chunks = streamed(server, "/chat/completions", messages=messages, max_tokens=5,
                      temperature=0, logprobs=True, top_logprobs=2)
    entries = [e for c in chunks if c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert entries == done.model_dump()["choices"][0]["logprobs"]["content"]
    # logprobs true alone: each token's logprob, no top ones
    alone_ = client(server).chat.completions.create(
        model="logits", messages=messages, max_tokens=2, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in alone_.choices[0].logprobs.content] == [[], []]


def test_min_tokens_masks_the_eos_and_ignore_eos_never_ends_on_it(server):
    prompt = [FORCE_EOS, 2, 5]  # eos is the greedy token at position 2
    assert greedy_chain(prompt, 3)[2] == EOS
    for fields, masked_until in [(dict(min_tokens=4), 4), (dict(ignore_eos=True), 8)]:
        done = complete(server, prompt=prompt, max_tokens=8, temperature=0, **fields)
        chain = to_eos(greedy_chain(prompt, 8, {pos: [EOS] for pos in range(masked_until)}))
        assert done["choices"][0]["text"] == text(chain), fields
        assert done["usage"]["completion_tokens"] == len(chain)


def test_a_stop_token_id_ends_the_answer_without_its_text(server):
    chain = greedy_chain(ids("dfh"), 3)
    done = complete(server, prompt="dfh", max_tokens=8, temperature=0,
                    stop_token_ids=[chain[1]])
    choice = done["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (text(chain[:1]), "stop")


@pytest.mark.parametrize("path, field, value", [
    ("/completions", "temperature", -0.5), ("/completions", "temperature", "hot"),
    ("/completions", "top_p", 0), ("/completions", "top_p", 1.5),
    ("/completions", "top_k", -2), ("/completions", "min_p", 1.5),
    ("/completions", "min_tokens", 17), ("/completions", "seed", 1.5),
    ("/completions", "ignore_eos", 1), ("/completions", "stop_token_ids", [50]),
    ("/completions", "stop_token_ids", "a"), ("/completions", "logprobs", 6),
    ("/completions", "logprobs", True), ("/completions", "echo", "yes"),
    ("/completions", "top_logprobs", 2), ("/completions", "prompt_logprobs", 1),
    ("/completions", "presence_penalty", 0.5), ("/chat/completions", "top_logprobs", 2),
    ("/chat/completions", "logprobs", 1), ("/chat/completions", "echo", True)])
def test_a_value_out_of_range_is_a_400_naming_its_field(server, path, field, value):
    body = {"model": "logits", "max_tokens": 16, field: value}
    body.update({"prompt": "dfh"} if path == "/completions" else
                {"messages": [{"role": "user", "content": "dfh"}]})
    status, _, raw = post(server, path, body)
    error = json.loads(raw)["error"]
    assert (status, error["param"], error["type"]) == (400, field, "invalid_request_error"), raw
    assert field in error["message"]


def test_a_chats_top_logprobs_past_the_engines_max_is_refused(server):
    status, _, raw = post(server, "/chat/completions", {
        "model": "logits", "messages": [{"role": "user", "content": "d"}], "logprobs": True,
        "top_logprobs": 6})
    assert status == 400 and json.loads(raw)["error"]["param"] == "top_logprobs"


def stand_in(**config) -> types.SimpleNamespace:
    """What sampled.asked reads of a Served."""
    keys = dict(max_steps=16, eos_token_ids=(EOS,), max_logprobs=5, prompt_logprobs=True)
    return types.SimpleNamespace(model="m", input_names=frozenset(), eos=EOS, vocab=50,
                                 config=types.SimpleNamespace(**{**keys, **config}))


def test_echo_with_logprobs_needs_an_engine_that_gives_prompt_logprobs():
    body = {"echo": True, "logprobs": 1}
    with pytest.raises(OpenAIError, match="prompt_logprobs=True") as refused:
        sampled.asked(stand_in(prompt_logprobs=False), body, False, 1)
    assert refused.value.param == "echo"
    assert sampled.asked(stand_in(), body, False, 1).base.prompt_logprobs == 1
    assert sampled.asked(stand_in(prompt_logprobs=False), {"echo": True}, False, 1).echo
    with pytest.raises(OpenAIError, match="max_logprobs is 0"):
        sampled.asked(stand_in(max_logprobs=0), {"logprobs": 0}, False, 1)


def test_the_tokenizers_eos_is_a_stop_id_unless_the_engines_own_or_ignored():
    served = stand_in(eos_token_ids=())
    assert sampled.asked(served, {}, False, 4).base.stop_token_ids == (EOS,)
    assert sampled.asked(served, {"ignore_eos": True}, False, 4).base.stop_token_ids == ()
    assert sampled.asked(stand_in(), {}, False, 4).base.stop_token_ids == ()


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.7), ("top_p", 0.9), ("top_k", 5), ("min_p", 0.1), ("min_tokens", 2),
    ("ignore_eos", True), ("stop_token_ids", [3]), ("logprobs", 1), ("echo", True)])
def test_an_engine_without_sampling_refuses_what_a_sampling_one_honours(server, field, value):
    status, _, raw = post(server, "/completions", {"model": "greedy", "prompt": "ok",
                                                   "max_tokens": 4, field: value})
    assert status == 400 and json.loads(raw)["error"]["param"] == field, raw
    complete(server, prompt="dfh", max_tokens=4, **{field: value})  # 200
