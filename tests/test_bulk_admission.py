"""infer_many is admitted as its rows sent one by one would be: it holds no
more of the queue than its priority's share (a more urgent request still
finds room), a share already full refuses it, and admission by deadline
refuses a call whose first row cannot be answered in time."""
import threading

import numpy as np
import pytest
from conftest import wait_for

import engine
from engine.shm import codes

X = np.arange(16, dtype=np.float32)
LEVELS = 8
CAPACITY = 16  # level 7 may hold 16 * 1 // 8 = 2 queued, level 6 may hold 4


@pytest.fixture
def held(make_engine, gate):
    """An engine of 8 levels whose one batcher is held at the gate by a
    first request; yields (engine, client)."""
    eng = make_engine("bulkshare", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=1, queue_capacity=CAPACITY, priority_levels=LEVELS)
    with engine.Client(eng.name) as c:
        first = c.submit(X, timeout=60)
        wait_for(lambda: eng.stats()["queue_depth"] == 0 and eng.stats()["requests_total"] == 1,
                 "the first request claimed")
        yield eng, c
        gate.open()
        assert np.array_equal(first.result(timeout=60), X * 2 + 1)


def test_a_bulk_call_holds_no_more_than_its_share_so_urgent_requests_find_room(held, gate):
    eng, c = held
    xs = np.stack([X + k for k in range(8)])
    box = []
    bulk = threading.Thread(target=lambda: box.append(c.infer_many(xs, timeout=60, priority=7)))
    bulk.start()
    try:
        wait_for(lambda: eng.stats()["queue_depth"] >= 2, "the bulk call's first rows queued")
        assert eng.stats()["queue_depth"] == 2  # its share, as 8 single submits would leave
        urgent = c.submit(X + 100, timeout=60, priority=6)  # level 6's share has room
        assert eng.stats()["rejected_total"] == 0
    finally:
        gate.open()
        bulk.join(timeout=60)
    assert np.array_equal(urgent.result(timeout=60), (X + 100) * 2 + 1)
    assert np.array_equal(box[0], xs * 2 + 1)


def test_a_bulk_call_whose_share_is_full_is_refused(held):
    eng, c = held
    queued = [c.submit(X + k, timeout=60, priority=7) for k in range(2)]  # level 7's share
    with pytest.raises(engine.QueueFull, match="priority 7 may hold 2"):
        c.infer_many(np.stack([X, X]), timeout=60, priority=7)
    assert eng.stats()["rejected_total"] == 1 and eng.stats()["queue_depth"] == 2
    assert len(queued) == 2


def test_a_bulk_call_that_cannot_make_its_deadline_is_refused_before_enqueue(make_engine, gate):
    eng = make_engine("bulkadmit", backend="helpers:holds_on_negative",
                      backend_args={"gate": gate.name, "fixed_ms": 100}, max_batch_size=1)
    with engine.Client(eng.name) as c:
        for k in range(1 + codes.FIT_CALIBRATED):  # S(1) >= 100 ms, once calibrated
            c.infer(X + k, timeout=30)
        wait_for(lambda: eng.segment.ring.admission_figures(0)[1] > 0, "the service fit")
        hold = c.submit(-X - 1, timeout=60)  # keeps the batcher busy until the gate opens
        wait_for(lambda: eng.segment.batch_started_ns(0) != 0, "the held batch started")
        before = eng.stats()["requests_total"]
        with pytest.raises(engine.Overloaded, match="exceeds the request's deadline"):
            c.infer_many(np.stack([X, X + 1]), timeout=0.05)
        stats = eng.stats()
        assert stats["requests_total"] == before and stats["overloaded_total"] == 1
        gate.open()
        assert np.array_equal(hold.result(timeout=60), (-X - 1) * 2 + 1)
        xs = np.stack([X, X + 1])
        assert np.array_equal(c.infer_many(xs, timeout=30), xs * 2 + 1)  # idle again: admitted
