"""Iterative engines: a request ends at the smaller of the engine's
max_steps and its own, and a bad max_steps (or an `out` the answer cannot
fill) is invalid input, refused before anything is enqueued.
"""
import asyncio

import numpy as np
import pytest
from iterative_helpers import ints, left, scripted
from step_models import chunks, read_log, request

import engine


def test_a_request_ends_at_the_smaller_of_the_engines_and_its_own_max_steps(make_engine, log):
    eng = scripted(make_engine, "steps", log, max_steps=8)
    with engine.Client(eng.name) as c:
        assert ints(c.stream(request(1, 20), timeout=30)) == chunks(1, 8)          # the engine's
        assert ints(c.stream(request(2, 20), timeout=30, max_steps=5)) == chunks(2, 5)  # its own
        assert ints(c.stream(request(3, 20), timeout=30, max_steps=8)) == chunks(3, 8)
        assert ints(c.stream(request(4, 3), timeout=30, max_steps=5)) == chunks(4, 3)   # done first
        assert c.infer(request(5, 20), timeout=30, max_steps=2).tolist() == chunks(5, 2)
    assert [left(log, t) for t in range(1, 6)] == [[8], [5], [8], [3], [2]]


def test_a_bad_max_steps_or_an_out_is_invalid_input_before_anything_is_enqueued(make_engine, log):
    eng = scripted(make_engine, "badsteps", log, max_steps=8)
    bad_values = [0, -1, 9, 2.5, "3", True]
    with engine.Client(eng.name) as c:
        for bad in bad_values:
            for call in (c.stream, c.infer, c.submit):
                with pytest.raises(engine.InvalidInput,
                                   match=r"max_steps: expected an int in \[1, 8\]"):
                    call(request(1, 4), timeout=30, max_steps=bad)
            with pytest.raises(engine.InvalidInput, match="max_steps"):
                asyncio.run(c.infer_async(request(1, 4), timeout=30, max_steps=bad))
        for out in (np.empty((), np.int64), np.empty(8, np.int64)):  # a chunk's, the answer's
            with pytest.raises(engine.InvalidInput, match="out"):
                c.infer(request(1, 4), timeout=30, out=out)
        with pytest.raises(engine.InvalidInput, match="expected out=None"):
            c.submit(request(1, 4), timeout=30, out=np.empty((), np.int64))
        stats = eng.stats()
        assert stats["requests_total"] == 0 and stats["invalid_total"] == 4 * len(bad_values) + 3
        assert ints(c.stream(request(2, 4), timeout=30, max_steps=8)) == chunks(2, 4)
    assert read_log(log)[0][3] == 2  # the first request the model saw
