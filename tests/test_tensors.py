"""Named tensors: dicts in, dicts out, each tensor checked by name."""
import numpy as np
import pytest
from conftest import unique_name

import engine
from engine.errors import InvalidInput

NAMED = dict(backend="shape_backends:token_stats",
             inputs={"ids": ("int64", (None,)), "scale": ("float32", (2,))},
             max_input_shapes={"ids": (12,)},
             outputs={"total": ("float32", (1,)), "echo": ("float32", (2,))},
             max_batch_size=8)


def request(k: int):
    ids = np.arange(1, 1 + k % 12 + 1, dtype=np.int64) * (k + 1)
    scale = np.array([k % 5 + 1, k], np.float32)
    want = {"total": np.array([ids.sum() * scale[0]], np.float32),
            "echo": np.array([len(ids), k], np.float32)}
    return {"ids": ids, "scale": scale}, want


@pytest.fixture(scope="module")
def named():
    """One engine of NAMED for the tests that only send to it: each counts what it
    did from the counts it found."""
    with engine.Engine(unique_name("named"), **NAMED) as eng:
        yield eng


def test_a_dict_of_named_inputs_gets_a_dict_of_named_outputs(named):
    eng = named
    with engine.Client(eng.name) as c:
        for k in range(40):
            x, want = request(k)
            y = c.infer(x, timeout=10)
            assert sorted(y) == ["echo", "total"]
            for name in want:
                np.testing.assert_array_equal(y[name], want[name])


def test_named_requests_from_several_processes_each_get_their_own_answers(named, fork_ctx):
    eng = named

    def sender(first, q):
        wrong = 0
        with engine.Client(eng.name) as c:
            futures = [(k, c.submit(request(k)[0], timeout=20)) for k in range(first, first + 60)]
            for k, f in futures:
                y, want = f.result(timeout=30), request(k)[1]
                wrong += any(not np.array_equal(y[n], want[n]) for n in want)
        q.put(wrong)

    q = fork_ctx.Queue()
    procs = [fork_ctx.Process(target=sender, args=(1000 * p, q)) for p in range(3)]
    for p in procs:
        p.start()
    wrong = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    assert wrong == [0, 0, 0]


def test_out_dict_receives_the_answers(named):
    eng = named
    out = {"total": np.zeros(1, np.float32), "echo": np.zeros(2, np.float32)}
    with engine.Client(eng.name) as c:
        x, want = request(7)
        y = c.infer(x, timeout=10, out=out)
    assert y["total"] is out["total"] and y["echo"] is out["echo"]
    np.testing.assert_array_equal(out["echo"], want["echo"])


@pytest.mark.parametrize("x, says", [
    ({"ids": np.zeros(13, np.int64), "scale": np.zeros(2, np.float32)},
     "ids: expected int64[1..12], got int64[13]"),
    ({"ids": np.zeros(3, np.int32), "scale": np.zeros(2, np.float32)},
     "ids: expected int64[1..12], got int32[3]"),
    ({"ids": np.zeros(3, np.int64), "scale": np.zeros(3, np.float32)},
     "scale: expected float32[2], got float32[3]"),
    ({"ids": np.zeros(3, np.int64)}, "missing ['scale']"),
    ({"ids": np.zeros(3, np.int64), "scale": np.zeros(2, np.float32), "x": 1}, "unexpected ['x']"),
    (np.zeros(3, np.int64), "expected a dict of inputs"),
])
def test_a_bad_tensor_is_named_in_the_error_and_nothing_is_enqueued(named, x, says):
    eng = named
    before = eng.stats()
    with engine.Client(eng.name) as c:
        with pytest.raises(InvalidInput, match=says.replace("[", r"\[").replace("]", r"\]")):
            c.infer(x, timeout=5)
    stats = eng.stats()
    assert (stats["requests_total"], stats["invalid_total"]) == (before["requests_total"],
                                                                 before["invalid_total"] + 1)


def test_named_tensors_each_take_one_region_of_their_own_spec():
    cfg = engine.Engine("spec-only", **NAMED).config
    assert [t.name for t in cfg.input_specs] == ["ids", "scale"]
    assert cfg.slot_bytes == (12 * 8, 2 * 4, 1 * 4, 2 * 4)
    assert not cfg.in_place and [t.var_axis for t in cfg.input_specs] == [0, None]


@pytest.mark.parametrize("knobs, says", [
    (dict(inputs={"a": ("float32", (2,))}), "given together"),
    (dict(inputs={"a": ("float32", (None,))}, outputs={"b": ("float32", (1,))}),
     r"max_input_shapes\['a'\]"),
    (dict(inputs={"a": ("float32", (2,))}, outputs={"a": ("float32", (1,))}), "both an input"),
    (dict(inputs={"a": ("float32", (2,))}, outputs={"b": ("float32", (None,))}), "fixed dims"),
])
def test_named_tensor_settings_are_checked_before_anything_starts(knobs, says):
    with pytest.raises(ValueError, match=says):
        engine.Engine("bad-named", backend="helpers:affine", **knobs)


def test_a_contiguous_run_of_named_requests_reaches_the_backend_without_a_copy(make_engine, gate):
    eng = make_engine("named-views", **{**NAMED, "backend": "shape_backends:gated_named",
                                        "backend_args": {"gate": gate.name}})
    with engine.Client(eng.name) as c:
        first = c.submit(request(0)[0], timeout=60)
        futures = [c.submit(request(k)[0], timeout=60) for k in range(1, 8)]
        gate.open()
        for k, f in enumerate([first] + futures):
            assert np.array_equal(f.result(timeout=60)["total"], request(k)[1]["total"])
    stats = eng.stats()
    # consecutive submits take consecutive slots: each batch is a view of the regions
    assert stats["gathered_batches"] == 0 and stats["zero_copy_batches"] == stats["batches_total"]
