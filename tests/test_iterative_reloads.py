"""Iterative engines during a reload: running streams finish on the old
batcher while new requests join the new one; none is lost when a successor
still retrying its predecessor's requests is retired; a stream that
outlasts the drain timeout fails after its chunks; and a new batcher that
dies while the old one still drains fails its streams at once.
"""
import threading

import pytest
from conftest import wait_for, wait_until_no_slot_in_use
from iterative_helpers import (
    assert_each_joined_request_left_once,
    bits,
    ints,
    records,
    scripted,
    wait_held,
)
from step_models import HOLD, KILL, chunks, request

import engine


def test_reload_lets_running_streams_finish_on_the_old_batcher_while_new_ones_join_the_new(
        make_engine, log, gate):
    eng = scripted(make_engine, "reload", log, gate=gate, max_steps=16, model={"version": 1})
    [old_pid] = eng.stats()["batcher_pids"]
    with engine.Client(eng.name) as c:
        first = c.stream(request(1, 8, HOLD, bits(0, 3)), timeout=60)
        wait_held(log, 1, 0)
        second = c.stream(request(2, 8), timeout=60)
        gate.open()
        wait_held(log, 1, 3)  # both running on the old batcher, held
        reloaded = {}
        reload = threading.Thread(target=lambda: reloaded.update(eng.reload(
            backend_args={"log": log, "gate": gate.name, "version": 2})))
        reload.start()
        try:
            wait_for(lambda: eng.segment.epoch() == 1, "the new batcher serving, the old retiring")
            # served in full by the new batcher while the old one is still held
            new = [c.stream(request(tag, 4), timeout=60) for tag in (10, 11, 12)]
            for s, tag in zip(new, (10, 11, 12)):
                assert ints(s) == chunks(tag, 4, version=2)
            assert reload.is_alive()
        finally:
            gate.open()
            reload.join(60)
        assert ints(first) == chunks(1, 8, version=1)
        assert ints(second) == chunks(2, 8, version=1)
        assert ints(c.stream(request(13, 3), timeout=60)) == chunks(13, 3, version=2)
    assert not reload.is_alive()
    [new_pid] = reloaded["batcher_pids"]
    assert new_pid != old_pid and eng.stats()["batcher_pids"] == [new_pid]
    joined = assert_each_joined_request_left_once(log)
    assert joined == {1: [old_pid], 2: [old_pid], 10: [new_pid], 11: [new_pid], 12: [new_pid],
                      13: [new_pid]}
    stats = eng.stats()
    assert stats["errors_total"] == 0 and stats["batcher_restarts_total"] == 0


def test_a_reload_while_a_successor_retries_what_its_predecessor_left_loses_none(
        make_engine, log, gate):
    eng = scripted(make_engine, "reload-retry", log, gate=gate, max_steps=16, max_batch_size=4)
    first_pid = eng.stats()["batcher_pids"][0]
    with engine.Client(eng.name) as c:
        held = c.stream(request(1, 10, HOLD, bits(1, 3)), timeout=60)
        wait_held(log, 1, 1)
        killer = c.stream(request(2, 10, KILL, 2), timeout=60)
        gate.open()
        wait_held(log, 1, 3)
        # both join the step that kills the batcher, with no chunk yet: kept for its
        # successor, which retries them one by one, each held before its first chunk
        kept = [c.stream(request(tag, 4, HOLD, bits(0)), timeout=60) for tag in (3, 4)]
        gate.open()
        for s in (held, killer):
            with pytest.raises(engine.BackendError, match="BatcherDied"):
                ints(s)
        wait_for(lambda: eng.stats()["batcher_pids"] not in ([], [first_pid]),
                 "the killed batcher replaced", timeout_s=30)
        [successor] = eng.stats()["batcher_pids"]
        wait_for(lambda: any(r[1] == successor for r in records(log, "hold")),
                 "the successor holds the first of them", timeout_s=30)
        reloaded = {}
        reload = threading.Thread(target=lambda: reloaded.update(eng.reload(
            backend_args={"log": log, "gate": gate.name})))
        reload.start()
        try:
            # the successor retires with the second still to retry: it starts it still
            wait_for(lambda: eng.segment.epoch() == 1, "the successor retiring", timeout_s=60)
        finally:
            gate.open()
            gate.open()
            reload.join(60)
        for s, tag in zip(kept, (3, 4)):
            assert ints(s) == chunks(tag, 4)
    assert not reload.is_alive() and reloaded["batcher_pids"] != [successor]
    joined = assert_each_joined_request_left_once(log, dead={first_pid})
    assert joined[3] == joined[4] == [first_pid, successor]
    assert eng.stats()["errors_total"] == 2  # the two that had chunks


def test_a_stream_that_outlasts_a_reloads_drain_timeout_fails_after_its_chunks(
        make_engine, log, gate):
    eng = scripted(make_engine, "reload-overrun", log, gate=gate, max_steps=16,
                   drain_timeout_s=0.5)
    with engine.Client(eng.name) as c:
        s = c.stream(request(1, 8, HOLD, bits(2)), timeout=60)
        wait_held(log, 1, 2)  # and never let go: the reload kills it after drain_timeout_s
        [new_pid] = eng.reload(backend_args={"log": log})["batcher_pids"]
        got = []
        with pytest.raises(engine.BackendError, match="after a reload retired it; killed") as info:
            for chunk in s:
                got.append(int(chunk))
        assert got == chunks(1, 2) and info.value.exc_type == "BatcherDied"
        assert ints(c.stream(request(2, 3), timeout=60)) == chunks(2, 3)
        assert wait_until_no_slot_in_use(eng)
        stats = eng.stats()
    assert stats["batcher_pids"] == [new_pid] and stats["errors_total"] == 1
    wait_for(lambda: eng.stats()["active"] == 0, "no request in a running batch", timeout_s=30)


def test_a_new_batcher_that_dies_while_a_reload_overlaps_fails_its_streams_at_once(
        make_engine, log, gate):
    eng = scripted(make_engine, "reload-kill", log, gate=gate, max_steps=16, model={"version": 1})
    with engine.Client(eng.name) as c:
        old = c.stream(request(1, 8, HOLD, bits(0, 3)), timeout=120)
        wait_held(log, 1, 0)
        gate.open()
        wait_held(log, 1, 3)  # the old batcher holds its stream: the reload cannot end
        reload = threading.Thread(target=lambda: eng.reload(
            backend_args={"log": log, "gate": gate.name, "version": 2}))
        reload.start()
        try:
            wait_for(lambda: eng.segment.epoch() == 1, "the new batcher serving, the old retiring")
            killed = c.stream(request(2, 8, KILL, 2), timeout=120)
            with pytest.raises(engine.BackendError) as info:
                ints(killed)
            assert info.value.exc_type == "BatcherDied"
            assert reload.is_alive()  # failed while the old batcher still held its stream
        finally:
            gate.open()
            reload.join(120)
        assert ints(old) == chunks(1, 8, version=1)
        assert ints(c.stream(request(3, 3), timeout=120)) == chunks(3, 3, version=2)
    assert not reload.is_alive()
