"""Iterative engines: a dead batcher's successor retries each request that
had no chunk yet alone, one at a time, before it joins anything else; so a
poison request (one that kills the batcher again) fails as poison without
taking down the streams retried beside it.
"""
import collections

import pytest
from iterative_helpers import (
    assert_each_joined_request_left_once,
    ints,
    scripted,
    wait_idle,
)
from step_models import KILL, chunks, read_log, request

import engine


def test_a_poison_request_fails_as_poison_without_failing_the_streams_retried_before_it(
        make_engine, log):
    # max_batch_size=3 and a long max_delay: the first batcher starts the three together
    eng = scripted(make_engine, "poison-alone", log, max_steps=16, max_batch_size=3,
                   max_delay_ms=60_000)
    first_pid = eng.stats()["batcher_pids"][0]
    with engine.Client(eng.name) as c:
        innocent = [c.stream(request(1, 6), timeout=120), c.stream(request(2, 6), timeout=120)]
        poison = c.stream(request(3, 6, KILL, 0), timeout=120)  # kills before its first chunk
        for s, tag in zip(innocent, (1, 2)):
            assert ints(s) == chunks(tag, 6)
        with pytest.raises(engine.BackendError, match="failed as poison") as info:
            ints(poison)
        assert info.value.exc_type == "BatcherDied"
        after = [c.stream(request(tag, 3), timeout=120) for tag in (4, 5, 6)]
        for s, tag in zip(after, (4, 5, 6)):
            assert ints(s) == chunks(tag, 3)  # the engine goes on
        stats = wait_idle(eng)
    assert stats["batcher_restarts_total"] == 2 and stats["errors_total"] == 1
    joins = collections.defaultdict(list)
    for event, pid, _, tag, _ in read_log(log):
        if event == "join":
            joins[pid].append(tag)
    second_pid = next(pid for pid in joins if pid != first_pid and 3 in joins[pid])
    assert joins[first_pid] == [1, 2, 3]
    # the successor retried them in slot order: the innocent ones before the poison
    assert joins[second_pid] == [1, 2, 3]
    assert_each_joined_request_left_once(log, dead={first_pid, second_pid})
