"""Iterative engines: a stream knows how its answer finished as it hands out
the last chunk ("stop": the model said done; "length": its max_steps), and
knows nothing of the kind for an answer that did not finish."""
import asyncio

import numpy as np
import pytest

import engine

STEPS = dict(input_shape=(2,), input_dtype="int64", output_shape=(), output_dtype="int64",
             iterative=True, max_steps=16)


def counting(make_engine, tag, **knobs):
    return make_engine(tag, backend="serve_backends:counting", **{**STEPS, **knobs})


def reasons(stream) -> list:
    """(chunk, finish_reason as that chunk was handed out) of each chunk."""
    return [(int(chunk), stream.finish_reason) for chunk in stream]


def test_the_last_chunk_of_an_answer_its_model_ended_says_stop(make_engine):
    eng = counting(make_engine, "fin-stop")
    with engine.Client(eng.name) as c:
        got = reasons(c.stream(np.array([5, 3]), timeout=30))
    assert got == [(5, None), (6, None), (7, "stop")]


def test_the_last_chunk_of_an_answer_at_its_max_steps_says_length(make_engine):
    eng = counting(make_engine, "fin-len")
    with engine.Client(eng.name) as c:
        assert reasons(c.stream(np.array([5, 0]), timeout=30, max_steps=2)) == \
            [(5, None), (6, "length")]
        # the engine's own max_steps likewise
        assert reasons(c.stream(np.array([0, 0]), timeout=30))[-1] == (15, "length")


def test_an_answer_cut_by_its_timeout_has_no_finish_reason(make_engine):
    eng = counting(make_engine, "fin-cut", backend_args={"step_ms": 20.0}, max_steps=4096)
    with engine.Client(eng.name) as c:
        stream = c.stream(np.array([0, 0]), timeout=0.3)
        with pytest.raises(engine.RequestTimeout):
            for _ in stream:
                assert stream.finish_reason is None
        assert stream.finish_reason is None


def test_an_async_stream_says_how_it_finished(make_engine):
    eng = counting(make_engine, "fin-async")

    async def run():
        with engine.Client(eng.name) as c:
            chunks = c.open_stream_async(np.array([1, 2]), 30)
            try:
                return [(int(x), chunks.finish_reason) async for x in chunks]
            finally:
                await chunks.aclose()

    assert asyncio.run(run()) == [(1, None), (2, "stop")]
