"""queue_capacity bounds the requests queued or being computed: answers
waiting to be read, and the slots of dead clients, never make a request fail."""
import os
import signal

import numpy as np
import pytest
from conftest import wait_until_no_slot_in_use

import engine
from engine.shm import ring
from engine.tools import load

X = np.arange(16, dtype=np.float32)


def wait_until_answered(eng, count: int, timeout_s: float = 60.0) -> None:
    """Waits (bounded) until the engine has answered `count` requests in all."""
    r = eng.segment.ring
    deadline = ring.now_ns() + int(timeout_s * 1e9)
    while ring.now_ns() < deadline:
        seen = r.done_seq()
        if eng.stats()["answered_total"] >= count:
            return
        r.wait_done_seq(seen, 100_000_000)
    raise TimeoutError(f"fewer than {count} answered within {timeout_s} s")


def _poisson_submits_read_at_the_end(name, tag, n, rate, out):
    """n submits at Poisson arrivals of `rate`/s, every Future read after the last."""
    try:
        offsets = load.poisson_offsets_ns(rate, n, tag)
        with engine.Client(name) as c:
            futures = [c.submit(X + tag * 1000 + k, timeout=60)  # the benchmark's own pacing
                       for k in load.paced(offsets, ring.now_ns(), np.zeros(n, np.int64))]
            wrong = sum(not np.array_equal(f.result(timeout=60), (X + tag * 1000 + k) * 2 + 1)
                        for k, f in enumerate(futures))
        out.put((tag, wrong))
    except Exception as e:
        out.put((tag, repr(e)))


def test_four_processes_reading_their_answers_late_are_never_refused(make_engine, fork_ctx):
    eng = make_engine("late4", queue_capacity=1024, max_batch_size=32)
    out = fork_ctx.Queue()
    procs = [fork_ctx.Process(target=_poisson_submits_read_at_the_end,
                              args=(eng.name, tag, 300, 300.0, out)) for tag in range(1, 5)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == {1: 0, 2: 0, 3: 0, 4: 0}  # every answer its own, no error
    stats = eng.stats()
    assert stats["rejected_total"] == 0 and stats["answered_total"] == 1200


def test_unread_answers_leave_room_for_the_next_requests_of_their_process(make_engine):
    eng = make_engine("late1", queue_capacity=64, max_batch_size=8)
    with engine.Client(eng.name) as c:
        first = [c.submit(X + k, timeout=60) for k in range(48)]
        wait_until_answered(eng, 48)  # all answered, none read: 48 slots hold answers
        second = [c.submit(X + 100 + k, timeout=60) for k in range(48)]
        for k, f in enumerate(first):
            assert np.array_equal(f.result(timeout=60), (X + k) * 2 + 1)
        for k, f in enumerate(second):
            assert np.array_equal(f.result(timeout=60), (X + 100 + k) * 2 + 1)
    assert eng.stats()["rejected_total"] == 0


def _fill_with_unread_answers(name, go, out):
    """Fills the ring with submits, lets them be answered, reads them only when told."""
    try:
        with engine.Client(name) as c:
            futures = [c.submit(X + k, timeout=60) for k in range(64)]
            out.put("submitted")
            go.wait(60)
            out.put(sum(not np.array_equal(f.result(timeout=60), (X + k) * 2 + 1)
                        for k, f in enumerate(futures)))
    except Exception as e:
        out.put(repr(e))


def test_another_process_lets_its_unread_answers_go_for_a_new_request(make_engine, fork_ctx):
    eng = make_engine("lateother", queue_capacity=64, max_batch_size=8)
    go, out = fork_ctx.Event(), fork_ctx.Queue()
    holder = fork_ctx.Process(target=_fill_with_unread_answers, args=(eng.name, go, out))
    holder.start()
    try:
        assert out.get(timeout=60) == "submitted"
        wait_until_answered(eng, 64)  # every slot holds an answer the holder has not read
        with engine.Client(eng.name) as c:
            assert np.array_equal(c.infer(X + 7, timeout=60), (X + 7) * 2 + 1)
        go.set()
        assert out.get(timeout=60) == 0  # and the holder still gets each of its answers
    finally:
        go.set()
        holder.join(timeout=30)
    assert eng.stats()["rejected_total"] == 0


def test_a_ring_full_of_queued_requests_still_refuses_at_once(make_engine):
    eng = make_engine("behind", backend="helpers:slow_affine", backend_args={"fixed_ms": 300},
                      max_batch_size=1, queue_capacity=2)
    with engine.Client(eng.name) as c:
        held = [c.submit(X, timeout=30) for _ in range(2)]
        evict_seq = eng.segment.ring.evict_seq()
        with pytest.raises(engine.QueueFull, match="2 requests queued or being computed"):
            c.infer(X, timeout=30)
        # no answer to move out (the first 300 ms batch runs): nobody was asked to wait for
        assert eng.segment.ring.evict_seq() == evict_seq
        assert eng.stats()["rejected_total"] == 1
        for f in held:
            assert np.array_equal(f.result(timeout=30), X * 2 + 1)


def _hold_every_slot(name, out):
    with engine.Client(name) as c:
        lent = [c.request() for _ in range(64)]  # every slot, WRITING, never sent
        out.put(len(lent))
        signal.pause()


def test_a_killed_client_holding_every_slot_costs_no_capacity(make_engine, fork_ctx):
    # a reaper that would not come for a minute: only the reclaim on demand can help
    eng = make_engine("deadfull", queue_capacity=64, max_batch_size=8, reap_interval_s=60.0)
    out = fork_ctx.Queue()
    holder = fork_ctx.Process(target=_hold_every_slot, args=(eng.name, out))
    holder.start()
    assert out.get(timeout=60) == 64
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(timeout=30)
    with engine.Client(eng.name) as c:
        assert np.array_equal(c.infer(X + 3, timeout=10), (X + 3) * 2 + 1)
    stats = eng.stats()
    assert stats["reclaimed_slots_total"] == 64 and stats["rejected_total"] == 0
    assert wait_until_no_slot_in_use(eng)
