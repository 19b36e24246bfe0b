"""Every error, with its message; the engine serves on after each."""
import numpy as np
import pytest
from conftest import unique_name, wait_until_no_slot_in_use

import engine

X = np.arange(16, dtype=np.float32)


def still_serves(client):
    assert np.array_equal(client.infer(X, timeout=10), X * 2 + 1)


@pytest.fixture(scope="module")
def served():
    """One engine for the tests that refuse a request and then send one: each
    counts what it did from the counts it found."""
    with engine.Engine(unique_name("err"), backend="helpers:affine", max_batch_size=4,
                       queue_capacity=8) as eng, engine.Client(eng.name) as c:
        yield eng, c


@pytest.mark.parametrize("bad, got", [
    (np.zeros(16, np.float64), "got float64[16]"),
    (np.zeros((3, 16), np.float32), "got float32[3, 16]"),
    (np.zeros(15, np.float32), "got float32[15]"),
    (np.float32(1.0), "got float32[]"),
    (["a"] * 16, "not convertible to float32"),
])
def test_invalid_input_names_expected_and_got_and_enqueues_nothing(served, bad, got):
    eng, c = served
    before = eng.stats()["requests_total"]
    with pytest.raises(engine.InvalidInput, match=r"expected float32\[16\]") as info:
        c.infer(bad)
    assert got in str(info.value)
    assert isinstance(info.value, ValueError)
    assert eng.stats()["requests_total"] == before
    still_serves(c)


def read_only(a):
    a.setflags(write=False)
    return a


@pytest.mark.parametrize("out, got", [
    (np.zeros(15, np.float32), "float32[15]"),
    (np.zeros(16, np.float64), "float64[16]"),
    (np.zeros(32, np.float32)[::2], "float32[16] not C-contiguous"),
    (read_only(np.zeros(16, np.float32)), "float32[16] read-only"),
    ([0.0] * 16, "list"),
])
def test_a_bad_out_buffer_is_invalid_before_anything_is_enqueued(served, out, got):
    eng, c = served
    before = eng.stats()["requests_total"]
    with pytest.raises(engine.InvalidInput) as info:
        c.infer(X, timeout=10, out=out)
    assert str(info.value) == f"out: expected a writable C-contiguous float32[16], got {got}"
    assert eng.stats()["requests_total"] == before
    still_serves(c)


def test_an_answer_lands_in_the_out_buffer_given(served):
    _, c = served
    out = np.full(16, np.nan, np.float32)
    assert c.infer(X, timeout=10, out=out) is out
    assert np.array_equal(out, X * 2 + 1)
    f = c.submit(X + 1, timeout=10, out=out)
    assert f.result(timeout=10) is out and np.array_equal(out, (X + 1) * 2 + 1)


def test_variable_dim_over_its_bound_is_invalid(make_engine):
    eng = make_engine("var", backend="helpers:masked_sum", input_shape=(None, 4),
                      max_input_shape=(8, 4), output_shape=(4,))
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.InvalidInput, match=r"expected float32\[1\.\.8, 4\], got float32\[9, 4\]"):
            c.infer(np.zeros((9, 4), np.float32))
        x = np.ones((3, 4), np.float32)
        assert np.array_equal(c.infer(x, timeout=10), x.sum(axis=0))


def test_queue_full_is_raised_at_once_and_nothing_is_enqueued(make_engine):
    eng = make_engine("full", backend="helpers:slow_affine", backend_args={"fixed_ms": 300},
                      max_batch_size=1, queue_capacity=2)
    with engine.Client(eng.name) as c:
        held = [c.submit(X, timeout=10) for _ in range(2)]
        with pytest.raises(engine.QueueFull, match="queue_capacity 2 reached"):
            c.submit(X)
        stats = eng.stats()
        assert stats["rejected_total"] == 1 and stats["requests_total"] == 2
        for f in held:
            assert np.array_equal(f.result(timeout=10), X * 2 + 1)
        still_serves(c)


def test_request_timeout_abandons_and_the_slot_comes_back(make_engine):
    eng = make_engine("tmo", backend="helpers:slow_affine", backend_args={"fixed_ms": 300},
                      max_batch_size=1, queue_capacity=1)
    with engine.Client(eng.name) as c:
        # abandoned by the client at its deadline, or, if the batcher was late to
        # claim it (a loaded machine), failed unstarted: a timeout either way
        with pytest.raises(engine.RequestTimeout, match="within 0.05 s|not computed") as info:
            c.infer(X, timeout=0.05)
        assert isinstance(info.value, TimeoutError)
        # the one slot is ABANDONED until the batcher finishes; then it is free
        assert wait_until_no_slot_in_use(eng)
        y = c.infer(X + 1, timeout=10)
        assert np.array_equal(y, (X + 1) * 2 + 1)  # its own answer, not the late one
        stats = eng.stats()
        assert stats["timeouts_total"] + stats["expired_total"] == 1


def test_backend_exception_fails_its_batch_with_type_and_message(make_engine):
    eng = make_engine("fail", backend="helpers:failing", max_batch_size=1)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.BackendError, match="ValueError: negative input") as info:
            c.infer(-X, timeout=10)
        assert (info.value.exc_type, info.value.message) == ("ValueError", "negative input")
        still_serves(c)
        assert eng.stats()["errors_total"] == 1


@pytest.mark.parametrize("backend, got", [("helpers:wrong_count", "got float32[2, 16]"),
                                          ("helpers:wrong_shape", "got float32[1, 3]")])
def test_malformed_backend_result_is_a_backend_error(make_engine, backend, got):
    eng = make_engine("bad", backend=backend, max_batch_size=1)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.BackendError, match=r"expected float32\[1, 16\]") as info:
            c.infer(X, timeout=10)
        assert got in str(info.value)
        with pytest.raises(engine.BackendError):
            c.infer(X, timeout=10)  # the engine still answers


def test_no_engine_of_that_name_is_unavailable():
    with pytest.raises(engine.EngineUnavailable, match="no engine named"):
        engine.Client(unique_name("nobody"))


def test_a_stopped_engine_is_unavailable_to_its_clients(make_engine):
    eng = make_engine("stopped")
    c = engine.Client(eng.name)
    still_serves(c)
    eng.stop()
    with pytest.raises(engine.EngineUnavailable, match="not running"):
        c.infer(X)


def test_factory_failure_fails_start_and_leaves_nothing():
    name = unique_name("nofactory")
    eng = engine.Engine(name, backend="helpers:no_such_factory")
    with pytest.raises(engine.BackendError, match="AttributeError"):
        eng.start()
    with pytest.raises(engine.EngineUnavailable):
        engine.Client(name)


def test_bad_settings_are_refused_before_anything_is_created():
    with pytest.raises(ValueError, match="max_input_shape"):
        engine.Engine(unique_name("cfg"), input_shape=(None, 4))
    with pytest.raises(ValueError, match="name must match"):
        engine.Engine("a/b")
    with pytest.raises(ValueError, match="max_batch_size"):
        engine.Engine(unique_name("cfg"), max_batch_size=8, queue_capacity=4)


def test_start_over_a_live_engine_of_that_name_refuses(make_engine):
    eng = make_engine("live")
    with pytest.raises(engine.EngineAlreadyRunning, match="already running"):
        engine.Engine(eng.name).start()
    with engine.Client(eng.name) as c:
        still_serves(c)


def test_no_timeout_waits_as_long_as_the_engine_lives(served):
    _, c = served
    assert np.array_equal(c.infer(X, timeout=None), X * 2 + 1)
    assert np.array_equal(c.submit(X + 1, timeout=None).result(timeout=60), (X + 1) * 2 + 1)
    assert np.array_equal(c.infer_many(np.stack([X, X]), timeout=None)[1], X * 2 + 1)


@pytest.mark.parametrize("knobs, says", [
    (dict(max_batch_size="eight"), "max_batch_size: expected an integer, got 'eight' (str)"),
    (dict(max_batch_size=True), "max_batch_size: expected an integer, got True (bool)"),
    (dict(max_delay_ms="1"), "max_delay_ms: expected a number, got '1' (str)"),
    (dict(isolate_failures="no"), "isolate_failures: expected true or false, got 'no' (str)"),
    (dict(allowed_batch_sizes=[1, "2"]), "allowed_batch_sizes: expected a list of integers"),
    (dict(start_timeout_s=None), "start_timeout_s: expected a number, got None"),
])
def test_a_knob_of_the_wrong_kind_is_refused_naming_it(knobs, says):
    with pytest.raises(ValueError) as refused:
        engine.Engine(name="kinds", input_shape=(4,), output_shape=(4,), **knobs)
    assert says in str(refused.value)
