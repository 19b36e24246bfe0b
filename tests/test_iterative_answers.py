"""What each call answers on the two kinds of engine: a one-shot engine's
stream yields its one answer once; on an iterative engine, infer and submit
give the chunks stacked, named tensors stream and stack as dicts, and a lent
slot (Client.request) is refused.
"""
import asyncio

import numpy as np
import pytest
from conftest import wait_until_no_slot_in_use
from iterative_helpers import assert_each_joined_request_left_once, ints, scripted
from step_models import chunks, request, rows

import engine


def test_a_one_shot_engines_stream_yields_its_one_answer_once(make_engine):
    eng = make_engine("oneshot", backend="helpers:affine")
    x = np.arange(16, dtype=np.float32)
    with engine.Client(eng.name) as c:
        got = list(c.stream(x, timeout=30))
        assert len(got) == 1 and np.array_equal(got[0], x * 2 + 1)

        async def main():
            return [chunk async for chunk in c.stream_async(x + 1, timeout=30)]
        got = asyncio.run(main())
        assert len(got) == 1 and np.array_equal(got[0], (x + 1) * 2 + 1)
        with c.stream(x + 2, timeout=30) as s:  # closed before it is read: nothing comes
            pass
        assert list(s) == []
        del s
        assert wait_until_no_slot_in_use(eng)


def test_infer_and_submit_on_an_iterative_engine_give_the_chunks_stacked(make_engine, log):
    eng = scripted(make_engine, "stacked", log, max_steps=12, model={"width": 3},
                   output_shape=(3,))
    with engine.Client(eng.name) as c:
        y = c.infer(request(1, 5), timeout=30)
        assert y.shape == (5, 3) and np.array_equal(y, rows(1, 5, 3))
        futures = [c.submit(request(tag, tag), timeout=30) for tag in range(2, 8)]
        for tag, f in zip(range(2, 8), futures):
            assert np.array_equal(f.result(timeout=30), rows(tag, tag, 3))
        y = c.infer(request(8, 50), timeout=30, max_steps=4)
        assert np.array_equal(y, rows(8, 4, 3))
        y = asyncio.run(c.infer_async(request(9, 50), timeout=30))
        assert np.array_equal(y, rows(9, 12, 3))
        streamed = list(c.stream(request(10, 2), timeout=30))
        assert [s.shape for s in streamed] == [(3,), (3,)]
        assert np.array_equal(np.stack(streamed), rows(10, 2, 3))
    assert_each_joined_request_left_once(log)


def test_named_tensors_stream_as_dicts_and_stack_as_dicts(make_engine, log):
    eng = make_engine("named", backend="step_models:named", backend_args={"log": log},
                      iterative=True, max_steps=8,
                      inputs={"request": ("int64", (4,)), "weights": ("float64", (None,))},
                      max_input_shapes={"weights": (6,)},
                      outputs={"chunk": ("int64", ()), "mass": ("float64", (2,))})

    def x(tag, length, weights):
        return {"request": request(tag, length), "weights": np.array(weights, np.float64)}

    with engine.Client(eng.name) as c:
        streams = [c.stream(x(1, 3, [0.5, 1.5]), timeout=60),
                   c.stream(x(2, 4, [1, 2, 3, 4, 5]), timeout=60)]
        for s, tag, n, mass in zip(streams, (1, 2), (3, 4), (2.0, 15.0)):
            got = list(s)
            assert all(set(chunk) == {"chunk", "mass"} for chunk in got)
            assert [int(chunk["chunk"]) for chunk in got] == chunks(tag, n)
            assert np.array_equal(np.stack([chunk["mass"] for chunk in got]),
                                  [[mass, k] for k in range(n)])
        y = c.infer(x(3, 20, [2.0]), timeout=60, max_steps=5)
        assert y["chunk"].tolist() == chunks(3, 5)
        assert np.array_equal(y["mass"], [[2.0, k] for k in range(5)])
    assert_each_joined_request_left_once(log)


def test_a_lent_slot_is_refused_by_an_iterative_engine(make_engine, log):
    eng = scripted(make_engine, "lent", log, max_steps=8)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.InvalidInput, match="request"):
            c.request()
        assert ints(c.stream(request(1, 3), timeout=60)) == chunks(1, 3)
