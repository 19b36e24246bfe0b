"""submit()'s Future: settled by whoever asks, or by the completer for whoever waits."""
import concurrent.futures
import gc
import threading

import numpy as np
import pytest
from conftest import wait_for, wait_until_no_slot_in_use

import engine
from engine.shm import ring

X = np.arange(16, dtype=np.float32)


def completer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("shmbatch-completer")]


def test_pipelined_results_are_taken_by_the_asking_thread_with_no_completer(make_engine):
    eng = make_engine("pipe", max_batch_size=32, queue_capacity=512)
    before = completer_threads()
    with engine.Client(eng.name) as c:
        futures = [c.submit(X + k, timeout=30) for k in range(300)]
        for k, f in enumerate(futures):
            assert np.array_equal(f.result(timeout=30), (X + k) * 2 + 1)
        assert completer_threads() == before


def test_a_done_callback_gets_its_own_answer_without_being_asked(make_engine):
    eng = make_engine("callback", backend="helpers:slow_affine", backend_args={"fixed_ms": 20})
    got, called = {}, threading.Event()
    with engine.Client(eng.name) as c:
        for k in range(10):
            c.submit(X + k, timeout=30).add_done_callback(
                lambda f, k=k: (got.__setitem__(k, f.result()), len(got) == 10 and called.set()))
        assert called.wait(30)
    assert all(np.array_equal(got[k], (X + k) * 2 + 1) for k in range(10))


def test_wait_and_as_completed_see_every_future_settle(make_engine):
    eng = make_engine("waiters", backend="helpers:slow_affine", backend_args={"fixed_ms": 10})
    with engine.Client(eng.name) as c:
        futures = {c.submit(X + k, timeout=30): k for k in range(20)}
        done, not_done = concurrent.futures.wait(futures, timeout=30)
        assert len(done) == 20 and not not_done
        more = {c.submit(X - k, timeout=30): k for k in range(20)}
        seen = [(f, more[f]) for f in concurrent.futures.as_completed(more, timeout=30)]
    assert len(seen) == 20
    assert all(np.array_equal(f.result(0), (X - k) * 2 + 1) for f, k in seen)
    assert all(np.array_equal(f.result(0), (X + k) * 2 + 1) for f, k in futures.items())


def test_cancel_withdraws_a_queued_request_and_frees_its_slot(make_engine):
    eng = make_engine("cancel", backend="helpers:slow_affine", backend_args={"fixed_ms": 200},
                      max_batch_size=1)
    with engine.Client(eng.name) as c:
        running = c.submit(X, timeout=30)
        queued = c.submit(X + 1, timeout=30)
        assert queued.cancel() and queued.cancelled()
        with pytest.raises(concurrent.futures.CancelledError):
            queued.result()
        assert np.array_equal(running.result(timeout=30), X * 2 + 1)
        assert not running.cancel()  # answered: too late
        assert wait_until_no_slot_in_use(eng)
    # a batch is counted just after its answers are delivered: wait for that, then
    # see that the withdrawn request (freed by cancel, never claimable) made no second
    wait_for(lambda: eng.stats()["batches_total"] >= 1, "the answered batch counted")
    assert eng.stats()["batches_total"] == 1


def test_a_short_wait_leaves_the_request_pending(make_engine):
    eng = make_engine("short", backend="helpers:slow_affine", backend_args={"fixed_ms": 100})
    with engine.Client(eng.name) as c:
        f = c.submit(X, timeout=30)
        with pytest.raises(concurrent.futures.TimeoutError):
            f.result(timeout=0.001)
        assert not f.done() or np.array_equal(f.result(0), X * 2 + 1)
        assert np.array_equal(f.result(timeout=30), X * 2 + 1)


def test_a_dropped_future_gives_its_slot_back(make_engine):
    eng = make_engine("dropped", backend="helpers:slow_affine", backend_args={"fixed_ms": 50},
                      max_batch_size=2, queue_capacity=2)
    with engine.Client(eng.name) as c:
        c.submit(X, timeout=30), c.submit(X, timeout=30)  # noqa: B018 (dropped at once)
        gc.collect()
        assert wait_until_no_slot_in_use(eng)
        assert np.array_equal(c.submit(X + 3, timeout=30).result(timeout=30), (X + 3) * 2 + 1)


def test_a_submitted_request_past_its_deadline_times_out_when_asked(make_engine):
    eng = make_engine("late", backend="helpers:slow_affine", backend_args={"fixed_ms": 300},
                      max_batch_size=1, admission="none")  # the deadline passes in the queue
    with engine.Client(eng.name) as c:
        c.infer(X, timeout=30)  # warm: the next batch starts at once
        busy = c.submit(X, timeout=30)
        late = c.submit(X + 1, timeout=0.05)  # queued behind busy's 300 ms batch
        # withdrawn by the asker at its deadline, or failed unstarted by the engine if a
        # claim saw it first (it cannot finish in time): either way a timeout
        with pytest.raises(engine.RequestTimeout, match="within 0.05 s|not computed"):
            late.result()
        assert isinstance(late.exception(), engine.RequestTimeout)
        assert np.array_equal(busy.result(timeout=30), X * 2 + 1)
        assert wait_until_no_slot_in_use(eng)


def test_an_answered_future_carries_the_engines_stamps_in_order(make_engine):
    eng = make_engine("stamps", backend="helpers:slow_affine", backend_args={"fixed_ms": 5})
    with engine.Client(eng.name) as c:
        before = ring.now_ns()
        f = c.submit(X, timeout=30)
        assert f.stamps_ns is None  # not answered yet (a 5 ms batch)
        f.result(timeout=30)
        after = ring.now_ns()
    arrival, claim, done, batch_size = f.stamps_ns
    assert before <= arrival <= claim <= done <= after
    assert done - claim >= 5_000_000  # the batch's own 5 ms
    assert batch_size == 1


def test_a_request_given_up_before_its_loop_closed_frees_its_slot_and_the_next_loop_is_served(
        make_engine, gate):
    import asyncio
    eng = make_engine("closedloop", backend="helpers:gated", backend_args={"gate": gate.name},
                      input_shape=(4,), output_shape=(4,))
    x = np.ones(4, np.float32)
    with engine.Client(eng.name) as c:
        async def given_up():  # its loop closes with the request still in the engine
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(c.infer_async(x, timeout=60), 0.01)
        asyncio.run(given_up())
        gate.open()
        # withdrawn when wait_for cancelled it: its batcher frees the slot
        assert wait_until_no_slot_in_use(eng)
        assert np.array_equal(asyncio.run(c.infer_async(x, timeout=60)), x * 2 + 1)
