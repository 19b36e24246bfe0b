"""Client(retries=N): a request refused by a full queue or failed unstarted is
sent again, at most N times, never past its own deadline, within a retry
budget (at most a tenth of the client's requests, plus a burst); anything
else is raised as before, and retries=0 is the client as it was."""
import asyncio
import threading
import time

import numpy as np
import pytest
from conftest import unique_name, wait_for

import engine
from engine.client import retrying
from engine.shm import codes

X = np.arange(16, dtype=np.float32)


@pytest.fixture
def full(make_engine, gate):
    """An engine of queue_capacity 2 whose two slots are taken: one request
    held at the gate, one queued behind it. Yields (engine, gate); the held
    requests' answers are checked at the end."""
    eng = make_engine("full", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=1, queue_capacity=2, admission="none")
    with engine.Client(eng.name) as holder:
        held = [holder.submit(X + 100 + k, timeout=60) for k in range(2)]
        wait_for(lambda: eng.stats()["requests_total"] == 2, "both slots taken")
        yield eng, gate
        gate.open()
        for k, f in enumerate(held):
            assert np.array_equal(f.result(timeout=60), (X + 100 + k) * 2 + 1)


def _in_thread(call):
    """Runs call() in a thread; returns (thread, box) where box gets its
    outcome as ("ok", value) or ("error", exception)."""
    box = []

    def run():
        try:
            box.append(("ok", call()))
        except BaseException as e:  # the test reads it
            box.append(("error", e))
    t = threading.Thread(target=run)
    t.start()
    return t, box


CALLS = {
    "infer": lambda c, x: c.infer(x, timeout=30),
    "submit": lambda c, x: c.submit(x, timeout=30).result(timeout=30),
    "infer_async": lambda c, x: asyncio.run(c.infer_async(x, timeout=30)),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_request_refused_by_a_full_queue_is_answered_once_room_frees(full, call):
    eng, gate = full
    with engine.Client(eng.name, retries=8) as c:
        t, box = _in_thread(lambda: CALLS[call](c, X + 7))
        wait_for(lambda: c.retries_total >= 1, "the first refusal, backed off")
        gate.open()  # both held requests are answered: their slots free
        t.join(timeout=60)
        assert box[0][0] == "ok", box
        assert np.array_equal(box[0][1], (X + 7) * 2 + 1)
        # every attempt but the last was refused, each once
        assert 1 <= c.retries_total <= 8
        assert eng.stats()["rejected_total"] == c.retries_total


def test_a_refused_request_is_sent_at_most_n_plus_one_times(full):
    eng, _ = full
    with engine.Client(eng.name, retries=3) as c:
        with pytest.raises(engine.QueueFull, match="queue_capacity 2 reached"):
            c.infer(X, timeout=30)
        assert c.retries_total == 3
        assert eng.stats()["rejected_total"] == 4


def test_retries_end_with_the_refusal_by_the_requests_deadline(full):
    eng, _ = full
    timeout_s = 0.3
    with engine.Client(eng.name, retries=100) as c:
        started = time.monotonic()
        with pytest.raises(engine.QueueFull):
            c.infer(X, timeout=timeout_s)
        elapsed_s = time.monotonic() - started
        # the backoff doubles from 5-10 ms: a few retries fit before the deadline,
        # and none is sent after it (slack: the last refusal's own time)
        assert 1 <= c.retries_total < retrying.BURST
        assert eng.stats()["rejected_total"] == c.retries_total + 1
        assert elapsed_s < timeout_s + 0.25


def test_retries_stay_within_a_tenth_of_the_requests_plus_the_burst(full):
    eng, _ = full
    n = 195  # the last retry it earns is at request 191: the bucket is then nearly empty
    with engine.Client(eng.name, retries=3) as c:
        for k in range(n):
            with pytest.raises(engine.QueueFull):
                c.infer(X + k, timeout=30)
        # the bucket starts full (BURST retries), then each RETRY_COST requests earn one
        budget = retrying.BURST + n // retrying.RETRY_COST
        assert budget - 2 <= c.retries_total <= budget
        assert eng.stats()["rejected_total"] == n + c.retries_total
        # the budget spent, a refused request is raised without a retry
        before = c.retries_total, eng.stats()["rejected_total"]
        with pytest.raises(engine.QueueFull):
            c.infer(X, timeout=30)
        assert (c.retries_total, eng.stats()["rejected_total"]) == (before[0], before[1] + 1)


@pytest.mark.parametrize("retries", [None, 0])
def test_without_retries_a_refusal_is_raised_at_once_as_before(full, retries):
    eng, _ = full
    kwargs = {} if retries is None else {"retries": retries}
    with engine.Client(eng.name, **kwargs) as c:
        with pytest.raises(engine.QueueFull):
            c.infer(X, timeout=30)
        with pytest.raises(engine.QueueFull):
            c.submit(X, timeout=30)
        assert c.retries_total == 0
        assert eng.stats()["rejected_total"] == 2


def test_a_request_failed_unstarted_is_retried_until_its_retries_end(make_engine):
    # the engine fails unstarted a request with less time left than its batches'
    # fixed cost (200 ms here, once measured): so is each retry of it
    eng = make_engine("expire", backend="helpers:slow_affine", backend_args={"fixed_ms": 200},
                      max_batch_size=1, admission="none")
    with engine.Client(eng.name, retries=2) as c:
        for k in range(1 + codes.FIT_CALIBRATED):
            assert np.array_equal(c.infer(X + k, timeout=30), (X + k) * 2 + 1)
        wait_for(lambda: eng.segment.ring.admission_figures(0)[1] > 0, "the service fit")
        with pytest.raises(engine.RequestTimeout, match="not computed"):
            c.infer(X, timeout=0.15)
        assert c.retries_total >= 1
        assert eng.stats()["expired_total"] == c.retries_total + 1 <= 3


def test_a_backend_error_is_never_retried(make_engine):
    eng = make_engine("fails", backend="helpers:failing")
    with engine.Client(eng.name, retries=3) as c:
        with pytest.raises(engine.BackendError, match="negative input"):
            c.infer(-X - 1, timeout=30)
        assert np.array_equal(c.infer(X, timeout=30), X * 2 + 1)
        assert c.retries_total == 0
        stats = eng.stats()
        assert stats["requests_total"] == 2 and stats["errors_total"] == 1


@pytest.fixture(scope="module")
def plain():
    """One engine for the tests that send it nothing but a refused request: each
    counts what it did from the counts it found."""
    with engine.Engine(unique_name("plain"), backend="helpers:affine") as eng:
        yield eng


def test_invalid_input_is_never_retried(plain):
    eng, before = plain, plain.stats()
    with engine.Client(eng.name, retries=3) as c:
        with pytest.raises(engine.InvalidInput, match="expected float32"):
            c.infer(np.ones(3, np.float64), timeout=30)
        assert c.retries_total == 0
        stats = eng.stats()
        assert stats["invalid_total"] == before["invalid_total"] + 1
        assert stats["requests_total"] == before["requests_total"]


@pytest.mark.parametrize("retries", [-1, 1.5, "3"])
def test_retries_must_be_a_count(plain, retries):
    eng = plain
    with pytest.raises(ValueError, match="retries: expected an int >= 0"):
        engine.Client(eng.name, retries=retries)
