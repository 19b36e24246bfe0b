"""Admission: a request whose deadline passes in the queue is failed unstarted,
one that cannot make its deadline is refused before enqueue, and the predicted
wait the refusal rests on (the C estimate is the Python oracle's)."""
import os

import numpy as np
import oracles
import pytest
from conftest import raw_segment, wait_for

import engine
from engine.shm import codes, ring

X = np.arange(16, dtype=np.float32)
MS = 1_000_000


def test_a_request_whose_deadline_passes_in_the_queue_is_failed_unstarted(make_engine, gate):
    eng = make_engine("expire", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=4, admission="none")
    with engine.Client(eng.name) as c:
        held = c.submit(X, timeout=60)  # its batch waits at the gate
        wait_for(lambda: eng.stats()["queue_depth"] == 0 and eng.stats()["requests_total"] == 1,
                 "the first request claimed")
        late = c.submit(X + 1, timeout=0.05)  # never asked before the gate opens
        deadline = ring.now_ns() + 50 * MS
        wait_for(lambda: ring.now_ns() > deadline, "the queued request's deadline")
        gate.open()
        assert np.array_equal(held.result(timeout=60), X * 2 + 1)
        # not asked before the engine has judged it (asked, the client would withdraw it)
        wait_for(lambda: eng.stats()["expired_total"] == 1, "the engine expiring it")
        with pytest.raises(engine.RequestTimeout, match="not computed"):
            late.result(timeout=60)
    stats = eng.stats()
    assert stats["expired_total"] == 1 and stats["answered_total"] == 1
    wait_for(lambda: eng.stats()["batches_total"] == 1, "the one batch counted")
    assert eng.stats()["batch_size_counts"] == {1: 1}  # the expired one reached no batch


def test_a_request_that_cannot_make_its_deadline_is_refused_before_enqueue(make_engine, gate):
    eng = make_engine("admit", backend="helpers:holds_on_negative",
                      backend_args={"gate": gate.name, "fixed_ms": 100}, max_batch_size=1)
    with engine.Client(eng.name) as c:
        # the first batch of a shape warms up; the fit is published once calibrated
        for k in range(1 + codes.FIT_CALIBRATED):  # S(1) >= 100 ms
            c.infer(X + k, timeout=30)
        # the batcher publishes its fit just after the batch's answers go out
        wait_for(lambda: eng.segment.ring.admission_figures(0)[1] > 0, "the service fit")
        held = c.submit(-X - 1, timeout=60)  # keeps the batcher busy until the gate opens
        wait_for(lambda: eng.segment.batch_started_ns(0) != 0, "the held batch started")
        before = eng.stats()["requests_total"]
        assert c.predicted_wait_s() >= 0.1  # the held batch's S(1), at least, is still ahead
        with pytest.raises(engine.Overloaded, match="exceeds the request's deadline") as refused:
            c.infer(X, timeout=0.05)
        assert refused.value.predicted_wait_ms >= 100 and refused.value.deadline_left_ms <= 50
        stats = eng.stats()
        assert stats["requests_total"] == before and stats["overloaded_total"] == 1
        gate.open()
        assert np.array_equal(held.result(timeout=60), (-X - 1) * 2 + 1)
        assert np.array_equal(c.infer(X + 1, timeout=30), (X + 1) * 2 + 1)  # idle again: admitted
        # nothing queued and the batcher idle again (it marks itself idle just after
        # the answers go out): nothing to wait for, never a refusal
        wait_for(lambda: c.predicted_wait_s() == 0.0, "a predicted wait of 0 when idle")


def test_a_refusal_says_its_figures_and_survives_pickling():
    import pickle
    e = pickle.loads(pickle.dumps(engine.Overloaded.predicted(120, 49.96)))
    assert isinstance(e, engine.QueueFull)
    assert (e.predicted_wait_ms, e.deadline_left_ms) == (120, 49.96)
    assert str(e) == "predicted wait 120 ms exceeds the request's deadline of 50.0 ms"
    assert str(engine.Overloaded("as said")) == "as said"


def test_the_predicted_wait_counts_full_rounds_ahead_then_its_own_batch():
    f, c = 2 * MS, 100_000
    assert oracles.predicted_wait_ns(0, 32, 1, f, c) == 0  # nothing ahead, a batcher idle
    assert oracles.predicted_wait_ns(1, 32, 1, f, c) == f + 2 * c  # joins the one ahead
    assert oracles.predicted_wait_ns(31, 32, 1, f, c) == f + 32 * c  # joins the next batch
    assert oracles.predicted_wait_ns(32, 32, 1, f, c) == (f + 32 * c) + f + c
    assert oracles.predicted_wait_ns(64, 32, 2, f, c) == (f + 32 * c) + f + c  # 2 instances
    # every batcher busy: what is left of the batch in service comes first
    assert oracles.predicted_wait_ns(0, 32, 1, f, c, busy_since_ns=10 * MS,
                                       now_ns=11 * MS) == (f + 32 * c - MS) + f + c


@pytest.mark.parametrize("seed", range(6))
def test_the_c_admission_estimate_is_the_python_one(seed):
    rng = np.random.default_rng(seed)
    instances = int(rng.integers(1, 3))
    with raw_segment("estimate", queue_capacity=256, max_batch_size=16, priority_levels=2,
                     instances=instances) as seg:
        r = seg.ring
        r.set_word(codes.W_INSTANCES, instances)
        r.set_word(codes.W_FIT_FIXED_NS, int(rng.integers(1, 10 * MS)))  # as finish_batch does
        r.set_word(codes.W_FIT_ITEM_PS, int(rng.integers(0, 500_000)) * 1000)
        seg.set_batch_limit(int(rng.integers(1, 17)))
        for _ in range(int(rng.integers(0, 200))):  # queued, at either priority
            _, slot, gen = r.acquire(os.getpid(), 0)
            r.publish(slot, gen, 0, 0, int(rng.integers(0, 2)))
        now = ring.now_ns()
        if rng.random() < 0.5:  # every batcher busy, since a while ago
            for i in range(instances):
                seg.mark_batch(i, now - int(rng.integers(0, 5 * MS)))
        for priority in (0, 1):
            ahead, fixed_ns, item_ps, limit, busy = r.admission_figures(priority)
            want = oracles.predicted_wait_ns(ahead, limit, instances, fixed_ns, item_ps / 1000,
                                               busy, now)
            assert abs(r.predicted_wait_ns(priority, now) - want) <= 2 * limit + 2  # rounding


def test_admission_refuses_a_wait_that_with_an_eighth_more_ends_after_the_deadline():
    assert not ring.refuses(80 * MS, 100 * MS)  # 90 ms: in time
    assert ring.refuses(90 * MS, 100 * MS)  # 101.25 ms: refused
    assert not ring.refuses(0, 0)
