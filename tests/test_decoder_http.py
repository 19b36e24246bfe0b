"""The decoder bench's HTTP rows: the same arrivals through `shmbatch serve`'s
generate_stream, OpenAI's /v1/completions and the FastAPI baseline, every
answer checked against the model decoding that request alone (no timing is
asserted)."""
import asyncio
import os

import psutil
import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
from conftest import shm_entries  # noqa: E402

from engine.tools import decoder_bench, decoder_http  # noqa: E402

TINY = {"vocab": 64, "d_model": 32, "layers": 1, "heads": 2, "context": 64}


@pytest.fixture(scope="module")
def offered():
    setup = small()
    requests = decoder_bench.draw(setup, 10, setup.seed, TINY["vocab"])
    return requests, decoder_bench.oracles(setup, requests)


def small(**changes) -> decoder_bench.Setup:
    return decoder_bench.Setup(max_batch_size=4, max_steps=8, max_prompt=8, mean_prompt=3,
                               mean_output=4, clients=2, model=TINY, pin=True, **changes)


@pytest.mark.parametrize("mode", decoder_http.ROWS)
def test_an_http_row_answers_every_request_as_the_model_alone_would(mode, offered):
    requests, oracle = offered
    row = decoder_bench.run_row(mode, small(), 20.0, requests, oracle, 0)
    assert not isinstance(row, str), f"the {mode} row was skipped: {row}"
    assert (row["mode"], row["requests"], row["answered"], row["wrong"]) == (mode, 10, 10, 0)
    assert row["tokens_per_s"] > 0 and row["server_cpu_us_per_chunk"] > 0
    assert not [n for n in shm_entries() if f"bench-dec-{os.getpid()}-" in n]
    _, alive = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=10)
    assert not alive, f"processes left: {[p.cmdline() for p in alive]}"


async def _lines(*lines):
    for line in lines:
        yield line


def read(kind: str, *lines):
    """(finish_reason, tokens, one time per token) of a stream's lines."""
    times, tokens = [], []
    finish = asyncio.run(decoder_http.read_events(kind, _lines(*lines), times, tokens))
    assert len(times) == len(tokens)
    return finish, tokens


def completion(text: str, finish=None) -> bytes:
    return (b'data: {"choices": [{"index": 0, "text": "%s", "finish_reason": %s}]}\n'
            % (text.encode(), b"null" if finish is None else b'"%s"' % finish.encode()))


def test_the_tokens_of_a_whole_stream_are_read_from_either_route():
    assert read(decoder_http.GENERATE, b'data: {"OUTPUT": 5}\n', b"\n",
                b'data: {"OUTPUT": 0, "finish_reason": "length"}\n') == ("length", [5, 0])
    assert read(decoder_http.OPENAI, completion(" 5"), b"\n", completion(" 0 12"),
                completion("", "length"), b"data: [DONE]\n") == ("length", [5, 0, 12])


@pytest.mark.parametrize("kind, lines", [
    (decoder_http.GENERATE, [b'data: {"OUTPUT": 5}\n']),
    (decoder_http.GENERATE, [b'data: {"OUTPUT": 5}\n', b'data: {"error": "cut"}\n']),
    (decoder_http.OPENAI, [completion(" 5"), completion("", "length")]),
    (decoder_http.OPENAI, [completion(" 5"), b'data: {"error": {"message": "x"}}\n']),
])
def test_a_stream_that_ends_short_or_in_an_error_is_no_answer(kind, lines):
    with pytest.raises(decoder_http.StreamFailed):
        read(kind, *lines)


def test_the_openai_rows_tokenizer_gives_back_every_token_id():
    tokens = decoder_http.tokenizer()
    assert tokens.decode([3, 0, 17]) == " 3 0 17"
    assert tokens.encode(tokens.decode([3, 0, 17])) == [3, 0, 17]
