"""POST /v1/completions and GET /v1/models, called with the openai client (sync, async,
streaming): each answer checked against its own prompt (tests/openai_models.py's Echo
answers its prompt back, then EOS); several prompts and choices in one request; the
default max_tokens; vLLM's priority."""
import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
from conftest import wait_for  # noqa: E402
from openai_models import EOS, FAIL  # noqa: E402
from openai_served import (  # noqa: E402
    EMBED,
    STEPS,
    async_client,
    client,
    post,
    queued,
    raw_post,
    requests_total,
    serve,
    withdrawn,
)

BYTES = {"tokenizer": "openai_models:bytes_tokenizer"}
TEXT = "héllo wörld € 😀"  # characters of 1, 2, 3 and 4 bytes
RANKED_CAPACITY = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = serve(tmp_path_factory.mktemp("completions"), {
        "echo": (dict(backend="openai_models:echo", **STEPS), BYTES),
        "vectors": (EMBED, BYTES),
        "bare": (dict(backend="openai_models:echo", **STEPS), None),  # no openai table
        # one request runs at a time, in 10 ms steps; each answer says when it joined. Those
        # queued behind a long one are taken (admission "none": only the queue's room refuses)
        "ranked": (dict(backend="openai_models:numbered", backend_args={"step_ms": 10.0},
                        max_batch_size=1, queue_capacity=RANKED_CAPACITY, priority_levels=2,
                        admission="none", **{**STEPS, "max_steps": 65536}),
                   {"tokenizer": "openai_models:no_eos_tokenizer"}),
    })
    yield served
    served.stop()


def tokens(text: str) -> int:
    return len(text.encode())


def test_the_models_route_lists_the_engines_that_have_an_openai_table(server):
    c = client(server)
    assert sorted(m.id for m in c.models.list()) == ["echo", "ranked", "vectors"]
    assert c.models.retrieve("echo").id == "echo"


def test_a_completion_answers_its_prompt_and_ends_at_the_tokenizers_eos(server):
    done = client(server).completions.create(model="echo", prompt=TEXT, max_tokens=64)
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
    chunks = list(client(server).completions.create(model="echo", prompt=TEXT, max_tokens=64,
                                                    stream=True))
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


def test_max_tokens_absent_is_16_for_a_completion_and_the_engines_for_a_chat(server):
    c = client(server)
    done = c.completions.create(model="echo", prompt="x" * 20)
    assert (done.choices[0].text, done.choices[0].finish_reason) == ("x" * 16, "length")
    chat = c.chat.completions.create(model="echo", messages=[{"role": "user", "content": "x" * 20}])
    assert chat.choices[0].finish_reason == "stop"
    assert chat.choices[0].message.content == "<|user|>" + "x" * 20 + "\n<|assistant|>"


PROMPTS = ["one", "twö 😀", "three, four", "x"]


def test_a_list_of_prompts_is_answered_in_order_each_as_if_sent_alone(server):
    c = client(server)
    alone = [c.completions.create(model="echo", prompt=p, max_tokens=9) for p in PROMPTS]
    before = requests_total(server.names["echo"])
    done = c.completions.create(model="echo", prompt=PROMPTS, max_tokens=9)
    assert requests_total(server.names["echo"]) - before == len(PROMPTS)  # one request each
    assert [ch.index for ch in done.choices] == [0, 1, 2, 3]
    assert [(ch.text, ch.finish_reason) for ch in done.choices] == \
        [(a.choices[0].text, a.choices[0].finish_reason) for a in alone]
    assert done.choices[2].finish_reason == "length"  # "three, four" cut at 9 tokens
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(done.usage, field) == sum(getattr(a.usage, field) for a in alone)


def test_lists_of_token_ids_are_prompts_as_lm_evals_local_completions_sends_them(server):
    status, _, body = post(server, "/completions", {
        "model": "echo", "prompt": [[104, 105], [97], [195, 169, 33]], "max_tokens": 5,
        "temperature": 0, "seed": 1234})
    assert status == 200, body
    assert [ch["text"] for ch in json.loads(body)["choices"]] == ["hi", "a", "é!"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_one_prompts_answer_and_the_others_run_on(server, stream):
    got = client(server).completions.create(model="echo", prompt=["ab. cd", "xyz", "q. rstu"],
                                            stop=". ", max_tokens=16, stream=stream)
    texts, finished = ["", "", ""], [None, None, None]
    for choice in (got.choices if not stream else (c.choices[0] for c in got)):
        texts[choice.index] += choice.text
        finished[choice.index] = finished[choice.index] or choice.finish_reason
    assert (texts, finished) == (["ab", "xyz", "q"], ["stop"] * 3)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_a_stop_string_ended_is_withdrawn_at_once_and_frees_its_place(server, stream):
    # one runs at a time, each endless (no eos): the second runs only once the first is withdrawn
    got = client(server).with_options(timeout=20).completions.create(
        model="ranked", prompt=["ab. cd", "xy. z"], stop=". ", max_tokens=60000, stream=stream)
    texts, finished = ["", ""], [None, None]
    for choice in (got.choices if not stream else (c.choices[0] for c in got)):
        texts[choice.index] += choice.text
        finished[choice.index] = finished[choice.index] or choice.finish_reason
    assert [t.split(":", 1)[1] for t in texts] == ["ab", "xy"] and finished == ["stop"] * 2


def test_n_choices_at_temperature_0_are_each_the_greedy_answer(server):
    done = client(server).completions.create(model="echo", prompt=["ab", "cde"], n=3,
                                             temperature=0, max_tokens=8)
    assert [(ch.index, ch.text) for ch in done.choices] == \
        [(0, "ab"), (1, "ab"), (2, "ab"), (3, "cde"), (4, "cde"), (5, "cde")]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (5, 3 * 3 + 3 * 4)


def test_several_prompts_stream_each_chunk_with_its_choices_index(server):
    chunks = list(client(server).completions.create(
        model="echo", prompt=PROMPTS, max_tokens=10, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == \
        sum(len(p.encode()) for p in PROMPTS)
    assert all(len(c.choices) == 1 for c in chunks[:-1])
    texts, finished = ["" for _ in PROMPTS], [[] for _ in PROMPTS]
    for c in chunks[:-1]:
        choice = c.choices[0]
        assert not finished[choice.index]  # nothing of a choice after its last chunk
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index].append(choice.finish_reason)
    assert texts == [p.encode()[:10].decode() for p in PROMPTS]
    assert finished == [["stop"], ["stop"], ["length"], ["stop"]]


def test_a_chat_of_n_choices_streams_a_role_chunk_for_each(server):
    messages = [{"role": "user", "content": "hi"}]
    chunks = list(client(server).chat.completions.create(
        model="echo", messages=messages, n=2, temperature=0, stream=True))
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == \
        [(0, "assistant"), (1, "assistant")]
    for index in (0, 1):
        assert "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices[0].index == index) == "<|user|>hi\n<|assistant|>"


def test_a_failure_of_one_prompt_fails_the_whole_answer(server):
    status, _, body = post(server, "/completions", {"model": "echo", "prompt": [[97], [FAIL]],
                                                    "temperature": 0})
    assert status == 500 and json.loads(body)["error"]["code"] == "BackendError"


def test_more_prompts_than_the_queue_holds_are_refused_before_any_is_tokenized(server):
    before = requests_total(server.names["ranked"])
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="ranked",
                                          prompt=["a"] * (RANKED_CAPACITY + 1))
    assert refused.value.body["param"] == "prompt"
    assert f"at most {RANKED_CAPACITY} prompts" in refused.value.body["message"]
    assert requests_total(server.names["ranked"]) == before


def test_a_bad_prompt_among_several_refuses_them_all_before_any_is_enqueued(server):
    before = requests_total(server.names["echo"])
    with pytest.raises(openai.BadRequestError) as refused:
        client(server).completions.create(model="echo", prompt=["ok", "y" * 65])
    assert refused.value.body["param"] == "prompt"
    assert refused.value.body["message"].startswith("prompt[1]: expected at most 64 tokens")
    assert requests_total(server.names["echo"]) == before


@pytest.mark.parametrize("priority", [1.0, "0", True, [0]])
def test_a_priority_that_is_not_an_integer_is_refused(server, priority):
    status, _, body = post(server, "/completions", {"model": "echo", "prompt": "x",
                                                    "priority": priority})
    assert status == 400 and json.loads(body)["error"]["param"] == "priority"


def test_the_more_urgent_priority_joins_first_out_of_range_ones_clamped(server):
    c, engine = client(server), server.names["ranked"]
    holder = c.completions.create(model="ranked", prompt="hold", max_tokens=60000, stream=True)
    pieces = iter(holder)
    try:
        held = int(next(pieces).choices[0].text)  # its answer begins with when it joined
        with ThreadPoolExecutor(2) as pool:
            answers = {}
            for name, priority in (("later", 5), ("urgent", -3)):  # 5 and -3: clamped to 1, 0
                answers[name] = pool.submit(post, server, "/completions", {
                    "model": "ranked", "prompt": name, "max_tokens": 8, "priority": priority})
                want = len(answers)
                wait_for(lambda: queued(engine) == want, f"{name} queued", 60, every_s=0.01)
            holder.close()  # the urgent one, sent last, joins first
            got = {name: json.loads(f.result(timeout=60)[2])["choices"][0]["text"]
                   for name, f in answers.items()}
    finally:
        holder.close()
    assert got == {"urgent": f"{held + 1}:urgent"[:8], "later": f"{held + 2}:later"[:8]}


@pytest.mark.parametrize("stream", [False, True])
def test_a_caller_that_leaves_withdraws_each_of_its_prompts(server, stream):
    engine = server.names["ranked"]
    before, enqueued = withdrawn(engine), requests_total(engine)
    sock = raw_post(server, "/completions", {"model": "ranked", "prompt": ["a", "b", "c"],
                                             "max_tokens": 60000, "stream": stream})
    wait_for(lambda: requests_total(engine) == enqueued + 3, "the prompts enqueued", 60,
             every_s=0.01)
    sock.close()  # one running (60000 steps of 10 ms), two queued behind it
    wait_for(lambda: withdrawn(engine) == before + 3, "every prompt withdrawn", 60, every_s=0.01)
    done = client(server).completions.create(model="ranked", prompt="z", max_tokens=8)
    assert ":z" in done.choices[0].text  # the one place serves again
