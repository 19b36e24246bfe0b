"""The shapes a compiled model wants: allowed batch sizes, length buckets, a
token budget. The backend logs every batch it sees; a gate holds the first
batch so the rest queue up behind it on any machine."""
import json

import numpy as np
import pytest
from conftest import wait_for

import engine
from engine.batching import policy


def logged(path):
    return [json.loads(line) for line in open(path).read().splitlines()]


def held_first(eng, c, x):
    """Submits x and waits until its batch is claimed (it then waits at the gate)."""
    first = c.submit(x, timeout=60)
    wait_for(lambda: eng.stats()["queue_depth"] == 0 and eng.stats()["requests_total"] == 1,
             "the first request claimed")
    return first


def test_every_batch_the_backend_sees_has_an_allowed_size(make_engine, gate, tmp_path):
    log = tmp_path / "rows"
    eng = make_engine("allowed", backend="shape_backends:gated_log",
                      backend_args={"gate": gate.name, "log_path": str(log), "fixed": True},
                      max_batch_size=8, allowed_batch_sizes=[1, 2, 4, 8])
    X = np.arange(16, dtype=np.float32)
    with engine.Client(eng.name) as c:
        futures = [held_first(eng, c, X)] + [c.submit(X + k, timeout=60) for k in range(1, 20)]
        gate.open()
        for k, f in enumerate(futures):
            assert np.array_equal(f.result(timeout=60), (X + k) * 2 + 1)
    rows = logged(log)
    assert set(rows) <= {1, 2, 4, 8} and sum(rows) >= 20
    assert eng.stats()["answered_total"] == 20


def test_a_batch_holds_one_length_bucket_padded_to_its_bound(make_engine, gate, tmp_path):
    log = tmp_path / "lengths"
    eng = make_engine("buckets", backend="shape_backends:gated_log",
                      backend_args={"gate": gate.name, "log_path": str(log)},
                      input_shape=(None,), max_input_shape=(64,), output_shape=(),
                      max_batch_size=8, length_buckets=[8, 16])
    lengths = [1, 40, 9, 8, 64, 16, 3, 17, 12, 5, 33, 2] * 3
    with engine.Client(eng.name) as c:
        xs = [np.arange(n, dtype=np.float32) + k for k, n in enumerate(lengths)]
        futures = [held_first(eng, c, xs[0])] + [c.submit(x, timeout=60) for x in xs[1:]]
        gate.open()
        for x, f in zip(xs, futures):
            assert f.result(timeout=60) == x.sum()
    bounds = {8: 0, 16: 8, 64: 16}  # a bucket's bound -> the bound below it
    batches = logged(log)
    for rows, padded, real in batches:
        assert padded in bounds and rows == len(real) <= 8
        assert all(bounds[padded] < n <= padded for n in real)
    # after the held one, the oldest waiting request's bucket goes first
    assert batches[1][1] == 64 and 40 in batches[1][2]
    assert sum(len(real) for _, _, real in batches) == len(lengths)


def test_a_token_budget_caps_each_batch_by_its_padded_size(make_engine, gate, tmp_path):
    log = tmp_path / "tokens"
    eng = make_engine("tokens", backend="shape_backends:gated_log",
                      backend_args={"gate": gate.name, "log_path": str(log)},
                      input_shape=(None,), max_input_shape=(64,), output_shape=(),
                      max_batch_size=16, length_buckets=[8, 32], max_batch_tokens=64)
    lengths = [5, 30, 60, 7, 31, 8, 2, 64, 20, 1, 6, 3, 9, 33, 4, 8] * 2
    with engine.Client(eng.name) as c:
        xs = [np.ones(n, np.float32) * k for k, n in enumerate(lengths)]
        futures = [held_first(eng, c, xs[0])] + [c.submit(x, timeout=60) for x in xs[1:]]
        gate.open()
        for x, f in zip(xs, futures):
            assert f.result(timeout=60) == x.sum()
    batches = logged(log)
    for rows, padded, real in batches:
        assert rows * padded <= 64 and padded in (8, 32, 64)
    # 17 short requests were queued behind the held batch: the budget, not their
    # number, is what stopped a batch of them at 8
    assert any(rows == 8 and padded == 8 for rows, padded, _ in batches)


def test_allowed_sizes_round_down_when_that_leaves_fewer_waiting_than_padding_adds():
    take = policy.take_table((1, 2, 4, 8, 16), 16)
    assert take[:6] == [0, 1, 2, 3, 4, 4]  # 3: pad 1 row; 5: 1 waits rather than 3 padded
    assert take[9] == 8 and take[15] == 15 and take[16] == 16
    assert [policy.pad_size(n, (1, 2, 4, 8, 16)) for n in (1, 3, 5, 15)] == [1, 4, 8, 16]


def test_a_token_budget_makes_each_bucket_hold_budget_over_bound_requests():
    shapes = policy.BatchShapes.of(32, None, (16, 64, 128), 512, 128)
    assert (shapes.bounds, shapes.most, shapes.fixed) == ((16, 64, 128), (32, 8, 4), True)
    assert shapes.padded_length(1, 20) == 64
    alone = policy.BatchShapes.of(32, None, None, 512, 128)  # no buckets: cut to the longest
    assert (alone.most, alone.padded_length(0, 20)) == ((4,), 20)
    assert policy.BatchShapes.of(32) is None


def test_a_padded_batch_keeps_the_token_budget_and_the_limit():
    # 1200 tokens of bound 100 allow 12 requests, but 12 would be padded to 16 rows
    shapes = policy.BatchShapes.of(16, (8, 16), None, 1200, 100)
    assert shapes.most == (8,)
    assert [policy.fit_allowed(n, (2, 4, 8)) for n in (1, 2, 7, 8, 30)] == [2, 2, 4, 8, 8]


@pytest.mark.parametrize("knobs, says", [
    (dict(input_shape=(None,), max_input_shape=(200,), length_buckets=list(range(1, 17))),
     "at most 16 bounds"),
    (dict(inputs={f"i{k}": ("float32", (1,)) for k in range(9)},
          outputs={f"o{k}": ("float32", (1,)) for k in range(8)}), "at most 16 tensors"),
    (dict(inputs={"a": ("float32", (2,))}, outputs={"b": ("float32", (1,))},
          input_shape=(None,)), "max_input_shapes"),
])
def test_batch_shape_and_tensor_limits_are_checked_before_anything_starts(knobs, says):
    with pytest.raises(ValueError, match=says):
        engine.Engine("limits", backend="helpers:affine", **knobs)


def test_a_request_is_in_the_first_bucket_whose_bound_holds_it():
    shapes = policy.BatchShapes.of(32, None, (16, 64, 128))
    assert [shapes.bucket_of(n) for n in (1, 16, 17, 64, 65, 128)] == [0, 0, 1, 1, 2, 2]
    assert policy.BatchShapes.of(32, (8, 32)).bucket_of(5) == 0  # no buckets: one


def test_a_lent_slot_of_a_scalar_answer_gives_a_read_only_0d_view(make_engine):
    eng = make_engine("scalar-lent", input_shape=(4,), output_shape=(), backend="helpers:row_sum")
    with engine.Client(eng.name) as c, c.request() as r:
        r.input[...] = 3.0
        y = r.infer(timeout=10)
        assert y.shape == () and not y.flags.writeable and float(y) == 12.0
