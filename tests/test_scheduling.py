"""Scheduling under load: deadlines in the ring, admission, priorities, shares,
the adaptive batch limit, and failure isolation, each on its own."""
import os

import numpy as np
import pytest

import engine
import oracles
from engine import admission, aimd, restarts, ring
from engine.restarts import Instance
from conftest import raw_segment, wait_for

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
        for k in range(3):  # the first batch warms up; the next two are measured: S(1) >= 100 ms
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


def test_a_failing_request_fails_alone_and_its_batch_mates_are_answered(make_engine, gate):
    eng = make_engine("isolate", backend="helpers:gated",
                      backend_args={"gate": gate.name, "then": "failing"}, max_batch_size=8)
    with engine.Client(eng.name) as c:
        first = c.submit(X, timeout=60)
        wait_for(lambda: eng.stats()["queue_depth"] == 0, "the first request claimed")
        xs = [X + k for k in range(8)]
        xs[5] = -X - 1  # the one the backend raises on
        futures = [c.submit(x, timeout=60) for x in xs]
        gate.open()
        first.result(timeout=60)
        for k, (x, f) in enumerate(zip(xs, futures)):
            if k == 5:
                with pytest.raises(engine.BackendError, match="negative input"):
                    f.result(timeout=60)
            else:
                assert np.array_equal(f.result(timeout=60), x * 2 + 1)
    stats = eng.stats()
    assert stats["isolated_failures_total"] == 1 and stats["errors_total"] == 1
    assert 2 <= stats["isolation_calls_total"] <= 2 * 3  # 2 log2(8) at most
    assert stats["answered_total"] == 8


def test_without_isolation_a_failing_request_fails_its_whole_batch(make_engine, gate):
    eng = make_engine("noisolate", backend="helpers:gated",
                      backend_args={"gate": gate.name, "then": "failing"}, max_batch_size=8,
                      isolate_failures=False)
    with engine.Client(eng.name) as c:
        first = c.submit(X, timeout=60)
        wait_for(lambda: eng.stats()["queue_depth"] == 0, "the first request claimed")
        futures = [c.submit(x, timeout=60) for x in (X, -X - 1, X + 2)]
        gate.open()
        first.result(timeout=60)
        for f in futures:
            with pytest.raises(engine.BackendError, match="negative input"):
                f.result(timeout=60)


def test_the_batch_limit_grows_by_one_and_is_cut_on_a_miss():
    slo = 10 * MS
    assert aimd.next_limit(4, 2 * MS, slo, 32) == 5
    assert aimd.next_limit(32, 2 * MS, slo, 32) == 32  # never above max_batch_size
    assert aimd.next_limit(8, 11 * MS, slo, 32) == 6
    assert aimd.next_limit(1, 50 * MS, slo, 32) == 1  # never below 1
    assert aimd.next_limit(8, int(9.5 * MS), slo, 32) == 8  # within, but near: hold


def test_the_batch_limit_follows_a_model_that_slows_down_and_recovers():
    # service = 1 ms + 0.5 ms per item while fast; 1 ms + 2 ms per item from batch 40 to 80
    limits, missed, limit = [], [], 1
    for k in range(120):
        per_item = 2.0 if 40 <= k < 80 else 0.5
        latency = int((1 + per_item * limit) * MS)
        missed.append(latency > 10 * MS)
        limit = aimd.next_limit(limit, latency, 10 * MS, 32)
        limits.append(limit)
    assert limits[39] == 17  # grew by one a batch to the largest within 10 ms: 1 + 0.5 n <= 9
    # slowed: cut at once, then a sawtooth around the largest n within (1 + 2 n <= 10: 4)
    assert limits[40] < limits[39] and max(limits[50:80]) <= 5
    assert sum(missed[50:80]) <= 10  # at most one batch in three over the objective
    assert limits[-1] == 17  # and back


def test_the_service_fit_recovers_a_linear_cost_model():
    fit = admission.ServiceFit()
    for n in [1, 2, 4, 8, 16, 32] * 5:
        fit.add(n, int(2 * MS + n * 100_000))
    fixed_ns, per_item_ns = fit.estimate()
    assert fixed_ns == pytest.approx(2 * MS, rel=1e-6)
    assert per_item_ns == pytest.approx(100_000, rel=1e-6)


def test_the_service_fit_skips_its_warm_up_batches():
    fit = admission.ServiceFit(warmup=1)
    assert not fit.add(1, 30_000 * MS) and fit.batches == 0  # a first call's compile: ignored
    assert fit.add(4, 2 * MS) and fit.estimate() == (2 * MS, 0.0)  # one size: all fixed


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


def test_an_input_that_kills_its_batcher_fails_alone_as_poison_and_its_batch_mates_are_answered(
        make_engine, gate):
    # float64 answers: not in place, so the inputs stay intact for a retry
    eng = make_engine("poison", backend="helpers:gated",
                      backend_args={"gate": gate.name, "then": "exits_on_negative",
                                    "dtype": "float64"},
                      max_batch_size=8, output_dtype="float64")
    with engine.Client(eng.name) as c:
        first = c.submit(X, timeout=60)
        wait_for(lambda: eng.stats()["queue_depth"] == 0, "the first request claimed")
        batch = [c.submit(x, timeout=60) for x in (X + 1, -X - 1, X + 2)]  # queued behind it
        for _ in range(3):  # each batcher's first batch waits at the gate: this one, 2 successors
            gate.open()
        assert np.array_equal(first.result(timeout=60), X * 2 + 1)
        # the batch killed its batcher; its successor retried each request alone: the
        # negative one killed it too and failed as poison, the others got their answers
        assert np.array_equal(batch[0].result(timeout=60), (X + 1) * 2 + 1)
        with pytest.raises(engine.BackendError, match="failed as poison") as info:
            batch[1].result(timeout=60)
        assert info.value.exc_type == "BatcherDied"
        assert np.array_equal(batch[2].result(timeout=60), (X + 2) * 2 + 1)
        assert np.array_equal(c.infer(X + 3, timeout=60), (X + 3) * 2 + 1)
    stats = eng.stats()
    assert stats["batcher_restarts_total"] == 2 and stats["errors_total"] == 1
    assert stats["retried_alone_total"] == 3  # the batch of three, each alone once


def test_a_dead_batchers_batch_is_kept_unless_two_successors_died_before_retrying_it():
    b = Instance(0, 0)
    message, retry = restarts.reap_terms(b, 11, "exit code 70", 0, True)
    assert retry and b"failed as poison" in message  # the words for one retried alone
    b.kept, b.retried_at_keep = 3, 0  # kept 3; the engine had retried none then
    assert restarts.reap_terms(b, 12, "exit code 1", 0, True)[1]  # its successor retried none
    b.kept = 3
    message, retry = restarts.reap_terms(b, 13, "exit code 1", 0, True)  # nor did the next
    assert not retry and b"2 successors died before retrying it" in message
    b.kept = 3
    assert restarts.reap_terms(b, 14, "exit code 70", 1, True)[1] and b.futile_restarts == 0
    assert restarts.reap_terms(Instance(0, 0), 15, "exit code 70", 0, False)[1] is False


@pytest.mark.parametrize("knobs", [{"isolate_failures": False, "output_dtype": "float64"},
                                   {}],  # answers in place: its inputs may be overwritten
                         ids=["without isolation", "answering in place"])
def test_an_input_that_kills_its_batcher_fails_its_whole_batch_when_not_retried(
        make_engine, gate, knobs):
    then_args = {"dtype": knobs["output_dtype"]} if "output_dtype" in knobs else {}
    eng = make_engine("poison-batch", backend="helpers:gated",
                      backend_args={"gate": gate.name, "then": "exits_on_negative", **then_args},
                      max_batch_size=8, **knobs)
    with engine.Client(eng.name) as c:
        first = c.submit(X, timeout=60)
        wait_for(lambda: eng.stats()["queue_depth"] == 0, "the first request claimed")
        doomed = [c.submit(x, timeout=60) for x in (X + 1, -X - 1, X + 2)]
        gate.open()
        gate.open()  # for the batcher that replaces the dead one, whose first batch waits too
        assert np.array_equal(first.result(timeout=60), X * 2 + 1)
        for f in doomed:  # the batch the model died on: failed, not retried
            with pytest.raises(engine.BackendError, match="BatcherDied"):
                f.result(timeout=60)
        assert np.array_equal(c.infer(X + 3, timeout=60), (X + 3) * 2 + 1)  # a new batcher
    assert eng.stats()["batcher_restarts_total"] == 1


@pytest.mark.parametrize("seed", range(6))
def test_the_c_admission_estimate_is_the_python_one(seed):
    rng = np.random.default_rng(seed)
    instances = int(rng.integers(1, 3))
    with raw_segment("estimate", queue_capacity=256, max_batch_size=16, priority_levels=2,
                     instances=instances) as seg:
        r = seg.ring
        r.set_word(ring.W_INSTANCES, instances)
        r.set_word(ring.W_FIT_FIXED_NS, int(rng.integers(1, 10 * MS)))  # as finish_batch does
        r.set_word(ring.W_FIT_ITEM_PS, int(rng.integers(0, 500_000)) * 1000)
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


def test_one_stalled_batch_cannot_lock_the_fit_up():
    fit = admission.ServiceFit()
    for n in [1, 2, 4, 8] * 5:
        fit.add(n, int(2 * MS + n * 100_000))
    fit.add(4, 30_000 * MS)  # a 30 s recompile
    for n in [1, 2, 4]:  # up to the next solve of the fit (every REFIT batches)
        fit.add(n, int(2 * MS + n * 100_000))
    assert fit.batches % admission.REFIT == 0
    fixed_ns, per_item_ns = fit.estimate()
    assert fixed_ns + 4 * per_item_ns < 4 * (2.4 * MS)  # bounded by OUTLIER x the prediction
