"""Failure isolation: a request its backend raises on fails alone and its batch
mates are answered; without isolation it fails its whole batch."""
import numpy as np
import pytest
from conftest import wait_for

import engine

X = np.arange(16, dtype=np.float32)


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
