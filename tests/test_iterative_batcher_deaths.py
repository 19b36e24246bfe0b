"""Iterative engines when a batcher dies: the requests it was streaming fail
with BatcherDied after the chunks they had, those that had none yet are
retried by its successor, and a request that kills two batchers fails as
poison.
"""
import pytest
from iterative_helpers import (
    assert_each_joined_request_left_once,
    bits,
    ints,
    joined_on,
    left,
    scripted,
    wait_held,
    wait_idle,
)
from step_models import HOLD, KILL, chunks, request

import engine


def test_a_killed_batcher_fails_its_streams_with_chunks_and_its_successor_serves_the_others(
        make_engine, log, gate):
    eng = scripted(make_engine, "killed", log, gate=gate, max_steps=16, max_batch_size=3)
    first_pid = eng.stats()["batcher_pids"][0]
    with engine.Client(eng.name) as c:
        held = c.stream(request(1, 10, HOLD, bits(1, 3)), timeout=60)
        wait_held(log, 1, 1)
        killer = c.stream(request(2, 10, KILL, 2), timeout=60)  # its step 2 kills the batcher
        gate.open()
        wait_held(log, 1, 3)  # tag 1 before its chunk 3, tag 2 before its chunk 1
        # one of these joins the step that kills (no chunk yet), the other is queued:
        # the batch holds max_batch_size=3
        fresh = [c.stream(request(3, 4), timeout=60), c.stream(request(4, 4), timeout=60)]
        gate.open()
        messages = []
        for s, tag, had in ((held, 1, 4), (killer, 2, 2)):
            got = []
            with pytest.raises(engine.BackendError, match="killed by signal 9") as info:
                for chunk in s:
                    got.append(int(chunk))
            assert got == chunks(tag, had) and info.value.exc_type == "BatcherDied"
            messages.append(str(info.value))
        for s, tag in zip(fresh, (3, 4)):
            assert ints(s) == chunks(tag, 4)  # in full, by the successor
        stats = wait_idle(eng)
    assert stats["batcher_restarts_total"] == 1
    [second_pid] = stats["batcher_pids"]
    assert second_pid != first_pid
    joined = assert_each_joined_request_left_once(log, dead={first_pid})
    assert joined[1] == joined[2] == [first_pid]
    # one joined the dead batcher and was retried by the successor, the other was queued
    assert sorted([joined[3], joined[4]]) == [[first_pid, second_pid], [second_pid]]
    assert left(log, 3) == left(log, 4) == [4]  # each left once, by the successor
    assert all("streaming this request" in m and "poison" not in m for m in messages), messages


def test_a_request_that_kills_two_batchers_fails_as_poison(make_engine, log):
    eng = scripted(make_engine, "poison", log, max_steps=16)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.BackendError, match="failed as poison") as info:
            ints(c.stream(request(1, 5, KILL, 0), timeout=60))  # before its first chunk
        assert info.value.exc_type == "BatcherDied"
        assert ints(c.stream(request(2, 4), timeout=60)) == chunks(2, 4)
        stats = wait_idle(eng)
    assert stats["batcher_restarts_total"] == 2 and stats["errors_total"] == 1
    joined = assert_each_joined_request_left_once(log, dead=set(joined_on(log, 1)))
    assert len(set(joined[1])) == 2  # joined by the first batcher, then retried by the second
    assert joined[2] == stats["batcher_pids"]
