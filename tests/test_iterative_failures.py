"""Iterative engines: a model's join, step or leave that raises, or a step
that returns a bad result, fails only the requests it concerns, after the
chunks they had, and the batcher goes on; a chunk count the ring refuses is
EngineCorrupt and frees the slot.
"""
import pytest
from iterative_helpers import (
    assert_each_joined_request_left_once,
    bits,
    ints,
    left,
    scripted,
    wait_held,
    wait_idle,
)
from step_models import BAD_OUT, FAIL_JOIN, FAIL_LEAVE, FAIL_STEP, HOLD, chunks, request

import engine
from engine.shm import codes


def test_a_failing_join_fails_the_requests_it_named_and_the_running_ones_go_on(
        make_engine, log, gate):
    eng = scripted(make_engine, "failjoin", log, gate=gate)
    with engine.Client(eng.name) as c:
        running = c.stream(request(1, 10, HOLD, bits(1)), timeout=60)
        wait_held(log, 1, 1)
        # both join at the next step, in one join call, which raises for tag 2
        named = [c.stream(request(2, 5, FAIL_JOIN), timeout=60),
                 c.stream(request(3, 5), timeout=60)]
        gate.open()
        for s in named:
            got = []
            with pytest.raises(engine.BackendError, match=r"join refuses tags \[2\]") as info:
                for chunk in s:
                    got.append(int(chunk))
            assert got == [] and info.value.exc_type == "ValueError"
        assert ints(running) == chunks(1, 10)
        assert ints(c.stream(request(4, 3), timeout=60)) == chunks(4, 3)
    assert [left(log, t) for t in (1, 2, 3, 4)] == [[10], [0], [0], [3]]
    assert_each_joined_request_left_once(log)
    assert eng.stats()["errors_total"] == 2


def test_a_failing_step_fails_its_requests_after_the_chunks_they_had(make_engine, log, gate):
    eng = scripted(make_engine, "failstep", log, gate=gate)
    with engine.Client(eng.name) as c:
        held = c.stream(request(1, 10, HOLD, bits(1)), timeout=60)
        wait_held(log, 1, 1)
        failing = c.stream(request(2, 10, FAIL_STEP, 2), timeout=60)  # joins at tag 1's chunk 2
        gate.open()
        # the step that would write tag 2's chunk 2 (and tag 1's chunk 4) raises
        for s, tag, had in ((held, 1, 4), (failing, 2, 2)):
            got = []
            with pytest.raises(engine.BackendError, match="step fails at chunk 2 of tag 2") as info:
                for chunk in s:
                    got.append(int(chunk))
            assert got == chunks(tag, had) and info.value.exc_type == "RuntimeError"
        assert ints(c.stream(request(3, 4), timeout=60)) == chunks(3, 4)  # the batcher goes on
    assert [left(log, t) for t in (1, 2, 3)] == [[4], [2], [4]]
    assert_each_joined_request_left_once(log)
    assert eng.stats()["batcher_restarts_total"] == 0


def test_a_step_returning_a_bad_result_fails_its_requests_after_the_chunks_they_had(
        make_engine, log):
    eng = scripted(make_engine, "badout", log)
    with engine.Client(eng.name) as c:
        got = []
        with pytest.raises(engine.BackendError, match=r"expected int64\[1\].*got int64\[0\]") as info:
            for chunk in c.stream(request(1, 10, BAD_OUT, 3), timeout=60):
                got.append(int(chunk))
        assert got == chunks(1, 3) and info.value.exc_type == "BadResult"
        assert ints(c.stream(request(2, 4), timeout=60)) == chunks(2, 4)
    assert left(log, 1) == [4] and left(log, 2) == [4]  # (the model counted its bad step)
    assert_each_joined_request_left_once(log)


def test_a_leave_that_raises_changes_no_answer(make_engine, log):
    eng = scripted(make_engine, "failleave", log)
    with engine.Client(eng.name) as c:
        assert ints(c.stream(request(1, 5, FAIL_LEAVE), timeout=60)) == chunks(1, 5)
        assert ints(c.stream(request(2, 4), timeout=60)) == chunks(2, 4)
        stats = wait_idle(eng)
    assert stats["errors_total"] == 0 and stats["batcher_restarts_total"] == 0
    assert left(log, 1) == [5]
    assert_each_joined_request_left_once(log)


def test_a_chunk_count_the_ring_refuses_is_engine_corrupt_and_frees_the_slot():
    import types

    from engine.client import ticket
    freed = []
    fake = types.SimpleNamespace(wait_chunks=lambda *a: (codes.ECORRUPT, 0),
                                 release_slot=lambda slot, gen: freed.append((slot, gen)))
    seg = types.SimpleNamespace(ring=fake, name="x", steps=8)
    with pytest.raises(engine.EngineCorrupt):
        ticket.chunk_count(seg, 3, 7)
    assert freed == [(3, 7)]
