"""Iterative engines: a request is withdrawn when its client leaves its
stream early (break, close or drop), when its timeout or deadline passes,
or when its client process dies; the engine leaves it once, at the next
step, and its slot comes back. The other requests are unaffected.
"""
import gc
import os
import signal
import threading

import pytest
from conftest import wait_for
from iterative_helpers import (
    assert_each_joined_request_left_once,
    bits,
    ints,
    left,
    scripted,
    slot_states,
    wait_idle,
    wait_left,
)
from step_models import HOLD, chunks, request

import engine
from engine.shm import codes


def _leave_early(c, x, how) -> list:
    """Reads three chunks of x's stream, then leaves it as `how` says."""
    got = []
    if how == "break":
        for chunk in c.stream(x, timeout=60):
            got.append(int(chunk))
            if len(got) == 3:
                break
    else:
        s = c.stream(x, timeout=60)
        got = [int(next(s)) for _ in range(3)]
        if how == "close":
            s.close()
            s.close()  # idempotent
            assert list(s) == []
        else:  # dropped
            del s
            gc.collect()
    return got


@pytest.mark.parametrize("how", ["break", "close", "drop"])
def test_leaving_a_stream_early_cancels_its_request_and_leave_is_called_once(
        make_engine, log, gate, how):
    eng = scripted(make_engine, "cancel", log, gate=gate, max_steps=64)
    with engine.Client(eng.name) as c:
        other = c.stream(request(2, 8), timeout=60)
        # held before its chunk 3: withdrawn while its batcher is in that step
        assert _leave_early(c, request(1, 50, HOLD, bits(3)), how) == chunks(1, 3)
        gate.open()
        # dropped by the step after the withdrawal (its 4th), not run on to its end
        assert wait_left(log, 1) == [4]
        assert ints(other) == chunks(2, 8)  # unaffected
        assert wait_idle(eng)["slots_in_use"] == 0
        assert ints(c.stream(request(3, 5), timeout=60)) == chunks(3, 5)
    assert left(log, 1) == [4]
    assert_each_joined_request_left_once(log)


def test_a_stream_past_its_timeout_raises_after_the_chunks_that_came_in_time(
        make_engine, log, gate):
    eng = scripted(make_engine, "timeout", log, gate=gate)
    with engine.Client(eng.name) as c:
        got = []
        with pytest.raises(engine.RequestTimeout):
            for chunk in c.stream(request(1, 10, HOLD, bits(2)), timeout=1.5):
                got.append(int(chunk))
        assert got == chunks(1, 2)
        gate.open()
        assert wait_left(log, 1) == [3]  # stopped by the step it was held in
        stats = wait_idle(eng)
        assert stats["slots_in_use"] == 0 and stats["timeouts_total"] == 1
        assert ints(c.stream(request(2, 4), timeout=30)) == chunks(2, 4)
    assert left(log, 1) == [3]
    assert_each_joined_request_left_once(log)


def test_a_deadline_passing_while_a_stream_runs_stops_it_in_the_engine(make_engine, log):
    # 400 steps of 2 ms each take 0.8 s at least: a 0.3 s deadline passes mid-stream
    eng = scripted(make_engine, "deadline", log, max_steps=400, model={"step_ms": 2.0})
    with engine.Client(eng.name) as c:
        got = []
        with pytest.raises(engine.RequestTimeout):
            for chunk in c.stream(request(1, 10**6), timeout=0.3):
                got.append(int(chunk))
        assert got == chunks(1, len(got)) and len(got) < 400
        [count] = wait_left(log, 1)
        assert len(got) <= count < 400
        wait_idle(eng)
    assert left(log, 1) == [count]


def _stream_then_wait(name, x, ready):
    with engine.Client(name) as c:
        s = c.stream(x, timeout=60)
        for _ in range(3):
            next(s)
        ready.set()
        threading.Event().wait(60)  # until killed


def test_a_killed_clients_stream_is_left_and_its_slot_comes_back(make_engine, log, gate,
                                                                  fork_ctx):
    eng = scripted(make_engine, "dead-client", log, gate=gate, max_steps=64)
    ready = fork_ctx.Event()
    victim = fork_ctx.Process(target=_stream_then_wait,
                              args=(eng.name, request(1, 50, HOLD, bits(3)), ready))
    victim.start()
    assert ready.wait(30)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    wait_for(lambda: codes.ABANDONED in slot_states(eng), "the dead client's request withdrawn",
             timeout_s=30)  # by the supervisor's reaper
    gate.open()
    assert wait_left(log, 1) == [4]
    stats = wait_idle(eng)
    assert stats["reclaimed_slots_total"] == 1 and stats["slots_in_use"] == 0
    with engine.Client(eng.name) as c:
        assert ints(c.stream(request(2, 4), timeout=60)) == chunks(2, 4)
