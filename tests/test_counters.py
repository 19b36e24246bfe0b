"""The counters add up: every request enqueued is counted once, by its outcome
(answered, failed, expired, timed out, or withdrawn by its client), and the
ones refused at the door are counted apart from them."""
import numpy as np
import pytest
from conftest import wait_for
from iterative_helpers import scripted, wait_idle
from step_models import chunks, request

import engine
from engine.shm import ring

X = np.arange(16, dtype=np.float32)
MS = 1_000_000
OUTCOMES = ("answered_total", "errors_total", "expired_total", "timeouts_total",
            "withdrawn_total")


def test_every_request_enqueued_is_counted_once_by_its_outcome(make_engine, gate):
    eng = make_engine("counted", backend="helpers:gated",
                      backend_args={"gate": gate.name, "then": "failing"}, max_batch_size=1)
    with engine.Client(eng.name) as c:
        held = c.submit(X, timeout=60)  # its batch waits at the gate
        wait_for(lambda: eng.stats()["queue_depth"] == 0 and eng.stats()["requests_total"] == 1,
                 "the first request claimed")
        assert c.submit(X + 1, timeout=60).cancel()  # withdrawn while queued
        with pytest.raises(engine.RequestTimeout):
            c.infer(X + 2, timeout=0.05)  # the client gives up on it
        late = c.submit(X + 3, timeout=0.05)  # not asked: the engine expires it
        deadline = ring.now_ns() + 50 * MS
        wait_for(lambda: ring.now_ns() > deadline, "the queued request's deadline")
        failed = c.submit(-X - 1, timeout=60)  # the backend raises on it
        gate.open()
        assert np.array_equal(held.result(timeout=60), X * 2 + 1)
        assert isinstance(failed.exception(timeout=60), engine.BackendError)
        wait_for(lambda: eng.stats()["expired_total"] == 1, "the engine expiring it")
        assert isinstance(late.exception(timeout=60), engine.RequestTimeout)
        assert np.array_equal(c.infer(X + 4, timeout=60), (X + 4) * 2 + 1)
    stats = eng.stats()
    assert {key: stats[key] for key in OUTCOMES} == {
        "answered_total": 2, "errors_total": 1, "expired_total": 1, "timeouts_total": 1,
        "withdrawn_total": 1}
    assert stats["requests_total"] == sum(stats[key] for key in OUTCOMES)


def test_a_stream_closed_early_is_counted_withdrawn(make_engine, log):
    eng = scripted(make_engine, "closed", log, max_steps=64, model={"step_ms": 5.0})
    with engine.Client(eng.name) as c:
        stream = c.stream(request(1, 60), timeout=60)
        assert int(next(stream)) == chunks(1, 1)[0]  # running
        stream.close()
    wait_for(lambda: eng.stats()["withdrawn_total"] == 1, "the withdrawal counted")
    stats = wait_idle(eng)
    assert stats["requests_total"] == 1 and stats["answered_total"] == 0


def test_requests_refused_at_the_door_are_not_counted_as_enqueued(make_engine, gate):
    eng = make_engine("door", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=1, queue_capacity=2)
    with engine.Client(eng.name) as c:
        sent = [c.submit(X + k, timeout=60) for k in range(2)]  # the ring is full
        with pytest.raises(engine.QueueFull):
            c.submit(X + 2, timeout=0.01)
        gate.open()
        for k, f in enumerate(sent):
            assert np.array_equal(f.result(timeout=60), (X + k) * 2 + 1)
    stats = eng.stats()
    assert stats["rejected_total"] == 1
    assert stats["requests_total"] == 2 == sum(stats[key] for key in OUTCOMES)
