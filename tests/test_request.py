"""Client.request(): a lent slot, its input written in place and its answer read there."""
import numpy as np
import pytest
from conftest import wait_until_no_slot_in_use

import engine

X = np.arange(16, dtype=np.float32)


def test_a_lent_row_is_sent_as_written_and_answered_in_place(make_engine):
    eng = make_engine("lent")
    with engine.Client(eng.name) as c:
        for k in range(50):
            with c.request() as r:
                r.input[...] = X + k
                y = r.infer(timeout=10)
                assert np.array_equal(y, (X + k) * 2 + 1) and not y.flags.writeable
        assert wait_until_no_slot_in_use(eng)
    assert eng.stats()["answered_total"] == 50


def test_leaving_a_request_unsent_drops_it(make_engine):
    eng = make_engine("unsent", queue_capacity=1, max_batch_size=1)
    with engine.Client(eng.name) as c:
        with c.request() as r:
            r.input[...] = X
            with pytest.raises(engine.QueueFull):
                c.request()  # the one slot is lent
        assert eng.stats()["slots_in_use"] == 0
        assert np.array_equal(c.infer(X, timeout=10), X * 2 + 1)
    assert eng.stats()["requests_total"] == 1  # only the infer() was ever sent


def test_a_lent_request_that_times_out_gives_its_slot_back(make_engine):
    eng = make_engine("lent-late", backend="helpers:slow_affine", backend_args={"fixed_ms": 200},
                      max_batch_size=1)
    with engine.Client(eng.name) as c:
        with c.request() as r:
            r.input[...] = X
            with pytest.raises(engine.RequestTimeout):
                r.infer(timeout=0.02)
            with pytest.raises(RuntimeError, match="sends once"):
                r.infer()
        assert wait_until_no_slot_in_use(eng)
    stats = eng.stats()  # abandoned at its deadline, or expired unstarted if claimed late
    assert stats["timeouts_total"] + stats["expired_total"] == 1


def test_request_needs_a_fixed_input_shape(make_engine):
    eng = make_engine("lent-var", input_shape=(None,), max_input_shape=(8,), output_shape=(8,))
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.InvalidInput, match="fixed input shape"):
            c.request()
