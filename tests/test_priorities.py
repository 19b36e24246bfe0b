"""Priorities: a batch takes the most urgent level first, a less urgent level
cannot fill the share kept for urgent ones, and a priority out of range is
invalid before enqueue."""
import numpy as np
import pytest
from conftest import wait_for

import engine

X = np.arange(16, dtype=np.float32)


def test_a_batch_takes_the_most_urgent_level_first(make_engine, gate):
    eng = make_engine("prio", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=4, priority_levels=2)
    with engine.Client(eng.name) as c:
        first = c.submit(X, timeout=60, priority=1)
        wait_for(lambda: eng.stats()["queue_depth"] == 0 and eng.stats()["requests_total"] == 1,
                 "the first request claimed")
        later = [c.submit(X + k, timeout=60, priority=1) for k in range(1, 5)]
        urgent = [c.submit(X + 10 + k, timeout=60, priority=0) for k in range(4)]
        gate.open()
        for k, f in enumerate(later, 1):
            assert np.array_equal(f.result(timeout=60), (X + k) * 2 + 1)
        for k, f in enumerate(urgent):
            assert np.array_equal(f.result(timeout=60), (X + 10 + k) * 2 + 1)
        assert first.result(timeout=60) is not None
    claimed = lambda fs: {f.stamps_ns[1] for f in fs}  # noqa: E731 (claim_ns: one per batch)
    assert len(claimed(urgent)) == 1  # the 4 urgent ones, sent last, form the next batch
    assert max(claimed(urgent)) < min(claimed(later))


def test_a_less_urgent_level_cannot_fill_the_share_kept_for_urgent_ones(make_engine, gate):
    eng = make_engine("share", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=1, queue_capacity=16, priority_levels=2)
    with engine.Client(eng.name) as c:
        futures = [c.submit(X, timeout=60, priority=1)]
        wait_for(lambda: eng.stats()["queue_depth"] == 0, "the first request claimed")
        share = 16 * 7 // 8  # level 1 may have 14 queued; level 0 keeps the rest
        futures += [c.submit(X + k, timeout=60, priority=1) for k in range(1, share + 1)]
        with pytest.raises(engine.QueueFull, match="priority 1 may hold 14"):
            c.submit(X, timeout=60, priority=1)
        urgent = c.submit(X + 100, timeout=60, priority=0)  # still room for the urgent
        gate.open()
        assert np.array_equal(urgent.result(timeout=60), (X + 100) * 2 + 1)
        for k, f in enumerate(futures):
            assert np.array_equal(f.result(timeout=60), (X + k) * 2 + 1)


def test_a_priority_out_of_range_is_invalid_before_enqueue(make_engine):
    eng = make_engine("badprio", priority_levels=2)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.InvalidInput, match=r"priority: expected an int in \[0, 2\), got 2"):
            c.infer(X, priority=2)
    assert eng.stats()["requests_total"] == 0
