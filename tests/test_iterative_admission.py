"""Iterative engines: who joins the running batch, and when. Priorities
order the queue, a request over the token budget waits until one leaves,
one that cannot get its first chunk before its deadline is refused at
once, and a stopping engine refuses new requests but lets the running and
queued ones finish.
"""
import threading

import pytest
from conftest import wait_for
from iterative_helpers import (
    assert_each_joined_request_left_once,
    bits,
    ints,
    records,
    scripted,
    wait_held,
    wait_idle,
)
from step_models import HOLD, chunks, read_log, request

import engine
from engine.shm import codes


def test_priorities_order_who_joins_the_running_batch(make_engine, log, gate):
    eng = scripted(make_engine, "priority", log, gate=gate, max_batch_size=1, priority_levels=3)
    with engine.Client(eng.name) as c:
        running = c.stream(request(1, 3, HOLD, bits(1)), timeout=60)
        wait_held(log, 1, 1)  # the running batch is full (max_batch_size=1)
        queued = [c.stream(request(tag, 2), timeout=60, priority=p)
                  for tag, p in ((2, 2), (3, 1), (4, 0), (5, 1))]
        gate.open()
        assert ints(running) == chunks(1, 3)
        for s, tag in zip(queued, (2, 3, 4, 5)):
            assert ints(s) == chunks(tag, 2)
    # most urgent first, oldest first within a level
    assert [r[3] for r in records(log, "join")] == [1, 4, 3, 5, 2]


def test_a_request_over_the_token_budget_waits_and_joins_when_one_leaves(make_engine, log, gate):
    # a fixed-shape request reserves its max_steps: two of 8 fill a budget of 16
    eng = scripted(make_engine, "budget", log, gate=gate, max_steps=8, max_batch_tokens=16,
                   max_batch_size=8)
    with engine.Client(eng.name) as c:
        first = c.stream(request(1, 6, HOLD, bits(1)), timeout=60)
        wait_held(log, 1, 1)
        second = c.stream(request(2, 3), timeout=60)
        third = c.stream(request(3, 3), timeout=60)               # 8 more: over the budget
        fourth = c.stream(request(4, 3), timeout=60, max_steps=1)  # over the budget too
        gate.open()
        assert ints(first) == chunks(1, 6)
        for s, tag, n in ((second, 2, 3), (third, 3, 3), (fourth, 4, 1)):
            assert ints(s) == chunks(tag, n)
    order = [(r[0], r[3]) for r in read_log(log) if r[0] != "hold"]
    assert order.index(("join", 3)) > order.index(("leave", 2))  # joined when 2 left
    assert order.index(("join", 4)) > order.index(("leave", 1))  # and 4 when 1 left
    assert_each_joined_request_left_once(log)


def test_admission_refuses_at_once_what_cannot_get_its_first_chunk_before_its_deadline(
        make_engine, log):
    # every step takes at least 50 ms: once the engine has measured a few, a first chunk
    # cannot come within 5 ms, however loaded the machine (a slower step predicts more)
    eng = scripted(make_engine, "admit", log, max_steps=64, model={"step_ms": 50.0})
    with engine.Client(eng.name) as c:
        running = c.stream(request(1, 60), timeout=120)
        # the fit is published once calibrated (a shape's first step is not a measure)
        measured = codes.FIT_CALIBRATED + 2
        assert [int(next(running)) for _ in range(measured)] == chunks(1, measured)
        with pytest.raises(engine.Overloaded):
            c.infer(request(2, 3), timeout=0.005)
        assert ints(c.stream(request(3, 2), timeout=120)) == chunks(3, 2)
        running.close()
    stats = wait_idle(eng)
    assert stats["overloaded_total"] == 1 and stats["requests_total"] == 2


def test_a_full_running_batch_refuses_at_once_what_cannot_join_before_its_deadline(
        make_engine, log):
    # one place, taken by a request with hundreds of steps of at least 10 ms left: a
    # request behind it cannot get its first chunk within a second, however fast the machine
    eng = scripted(make_engine, "full", log, max_steps=512, max_batch_size=1,
                   model={"step_ms": 10.0})
    with engine.Client(eng.name) as c:
        running = c.stream(request(1, 400), timeout=120)
        measured = codes.FIT_CALIBRATED + 2  # the fit is published once calibrated
        assert [int(next(running)) for _ in range(measured)] == chunks(1, measured)
        with pytest.raises(engine.Overloaded):  # at enqueue: not a timeout a second later
            c.infer(request(2, 3), timeout=1.0)
        running.close()
    stats = wait_idle(eng)
    assert stats["overloaded_total"] == 1 and stats["timeouts_total"] == 0


def test_a_place_withdrawn_from_a_full_running_batch_is_counted_free_at_once(make_engine, log):
    # its batcher drops it at its next step: a request sent before that step is
    # admitted, not refused on the withdrawn request's remaining steps
    eng = scripted(make_engine, "freed", log, max_steps=512, max_batch_size=1,
                   model={"step_ms": 10.0})
    with engine.Client(eng.name) as c:
        running = c.stream(request(1, 400), timeout=120)
        measured = codes.FIT_CALIBRATED + 2
        assert [int(next(running)) for _ in range(measured)] == chunks(1, measured)
        running.close()
        assert ints(c.stream(request(2, 3), timeout=1.0)) == chunks(2, 3)
    stats = wait_idle(eng)
    assert stats["overloaded_total"] == 0 and stats["withdrawn_total"] == 1


def test_stop_lets_running_and_queued_streams_finish(make_engine, log, gate):
    eng = scripted(make_engine, "stop", log, gate=gate)
    c = engine.Client(eng.name)
    running = c.stream(request(1, 10, HOLD, bits(3)), timeout=60)
    wait_held(log, 1, 3)
    queued = c.stream(request(2, 5), timeout=60)
    stopper = threading.Thread(target=eng.stop)
    stopper.start()
    try:
        wait_for(lambda: eng.segment.engine_state() != codes.ENGINE_RUNNING, "the engine stopping")
        with pytest.raises(engine.EngineUnavailable):
            c.stream(request(3, 5), timeout=60)
    finally:
        gate.open()
    assert ints(running) == chunks(1, 10)
    assert ints(queued) == chunks(2, 5)
    stopper.join(60)
    assert not stopper.is_alive()
    c.close()
    assert_each_joined_request_left_once(log)
