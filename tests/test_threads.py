"""`shmbatch status` says which thread pools each batcher's model uses, so a
user can size them against the web workers and clients beside the engine."""
import json
import os
import signal

import numpy as np
import pytest
from conftest import wait_for
from test_sidecar import shmbatch

import engine
from engine.batching import threads

X = np.arange(16, dtype=np.float32)
CORES = sorted(os.sched_getaffinity(0))


def thread_rows(name) -> list:
    """The status table's threads rows of engine `name`, and its advice row if any."""
    out = shmbatch("status", name)
    assert out.returncode == 0, out.stderr
    return [line.strip() for line in out.stdout.splitlines()
            if line.strip().startswith(("threads ", "advice "))]


def assert_serves(eng) -> None:
    with engine.Client(eng.name) as c:
        assert (c.infer(X, timeout=30) == X * 2 + 1).all()


def test_status_shows_the_torch_pools_of_an_unpinned_batcher(make_engine):
    eng = make_engine("torch", backend="thread_backends:with_torch",
                      backend_args={"intra": 3, "inter": 2})
    assert_serves(eng)
    pid = eng.stats()["batcher_pids"][0]
    [row] = [r for r in thread_rows(eng.name) if r.startswith("threads")]
    assert f"batcher 0 (pid {pid}): torch intra-op 3, inter-op 2" in row
    assert "not pinned" in row


def test_status_says_a_batcher_pinned_by_cpus_runs_on_its_cores_alone(make_engine, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    eng = make_engine("pinned", backend="thread_backends:with_torch", cpus=[CORES[:1]])
    assert_serves(eng)
    [row] = thread_rows(eng.name)
    assert f"pinned to core(s) {CORES[0]} (cpus)" in row
    assert "OMP_NUM_THREADS=1" in row  # the pools sized to its one core


def test_status_shows_a_pool_variable_the_batcher_inherited(make_engine, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    for var in ("MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    eng = make_engine("omp", backend="helpers:affine")
    [row] = thread_rows(eng.name)
    assert ": no torch or onnxruntime pool; OMP_NUM_THREADS=3, MKL_NUM_THREADS, " \
           "OPENBLAS_NUM_THREADS unset; not pinned" in row


def test_status_advises_when_the_unpinned_pools_fill_every_core(make_engine):
    wide = max(2, len(CORES))
    eng = make_engine("fill", backend="thread_backends:with_torch", backend_args={"intra": wide})
    rows = thread_rows(eng.name)
    assert [r for r in rows if r.startswith("advice")] == [(
        f"advice  the model's pools ({wide} threads in 1 unpinned batcher(s)) fill the "
        f"{len(CORES)} core(s) they may run on, leaving none to the web workers and clients: "
        f"size them with torch.set_num_threads(1) in the factory, or cpus=[[core], ...] to "
        f"pin each batcher")]


def test_status_gives_no_advice_for_one_thread_pools(make_engine):
    eng = make_engine("narrow", backend="thread_backends:with_torch",
                      backend_args={"intra": 1, "inter": 1})
    rows = thread_rows(eng.name)
    assert len(rows) == 1 and "torch intra-op 1, inter-op 1" in rows[0]


def test_status_json_gives_each_live_batchers_pools_and_the_warmup_as_stats_does(make_engine):
    eng = make_engine("json", backend="thread_backends:with_torch", instances=2, warmup=True,
                      max_batch_size=2, backend_args={"intra": 1, "inter": 1})
    out = shmbatch("status", eng.name, "--json")
    assert out.returncode == 0, out.stderr
    status, stats = json.loads(out.stdout), eng.stats()
    reported = status["threads"]
    assert reported == stats["threads"]
    assert sorted(r["pid"] for r in reported) == sorted(stats["batcher_pids"])
    assert [r["torch"] for r in reported] == [{"intra_op": 1, "inter_op": 1}] * 2
    assert all(r["affinity"] == CORES and not r["pinned"] for r in reported)
    # the slowest batcher's warmup, as stats() gives it; the table, each batcher's
    assert status["warmup_ms"] == stats["warmup_ms"] == max(r["warmup_ms"] for r in reported)
    rows = [r for r in thread_rows(eng.name) if r.startswith("threads")]
    assert [f"pid {r['pid']}" in row and f"warmed up in {r['warmup_ms']:.0f} ms" in row
            for r, row in zip(reported, rows)] == [True, True]


def test_a_restarted_batcher_reports_its_pools_under_its_new_pid(make_engine):
    eng = make_engine("restart", backend="thread_backends:with_torch",
                      backend_args={"intra": 1, "inter": 1})
    [old] = eng.stats()["batcher_pids"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: [r["pid"] for r in eng.stats()["threads"]] not in ([], [old]),
             "a new batcher's pools")
    [new] = eng.stats()["batcher_pids"]
    assert new != old and f"batcher 0 (pid {new}): torch intra-op 1" in thread_rows(eng.name)[0]


def test_reloaded_batchers_report_their_own_pools(make_engine):
    eng = make_engine("reload", backend="thread_backends:with_torch",
                      backend_args={"intra": 2, "inter": 1})
    new_pid = eng.reload(backend_args={"intra": 1, "inter": 1})["batcher_pids"][0]
    [row] = [r for r in thread_rows(eng.name) if r.startswith("threads")]
    assert f"(pid {new_pid}): torch intra-op 1, inter-op 1" in row
    assert_serves(eng)


def test_an_iterative_engines_batchers_report_their_pools(make_engine):
    eng = make_engine("steps", backend="thread_backends:counting_with_torch", iterative=True,
                      input_shape=(2,), input_dtype="int64", output_shape=(), output_dtype="int64",
                      max_steps=8, backend_args={"intra": 3, "inter": 1})
    with engine.Client(eng.name) as c:
        assert c.infer(np.array([5, 3], np.int64), timeout=30).tolist() == [5, 6, 7]
    [row] = [r for r in thread_rows(eng.name) if r.startswith("threads")]
    assert "torch intra-op 3, inter-op 1" in row


def test_advice_leaves_pinned_batchers_out():
    def batcher(pinned, intra):
        return {"torch": {"intra_op": intra, "inter_op": 1}, "onnxruntime": None, "env": {},
                "affinity": [0, 1], "cpu_count": 2, "pinned": pinned}
    assert threads.advice([batcher(True, 2), batcher(True, 2)]) is None
    assert threads.advice([batcher(True, 2), batcher(False, 2)]) is not None


@pytest.fixture(scope="module")
def doubling(tmp_path_factory):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    from thread_backends import doubling_model
    return str(doubling_model(tmp_path_factory.mktemp("onnx") / "doubling.onnx"))


def test_status_shows_the_onnxruntime_pools_of_the_onnx_backend(make_engine, doubling):
    eng = make_engine("ort", backend="engine.backends:onnx", input_shape=(4,), output_shape=(4,),
                      backend_args={"path": doubling, "intra_op_threads": 1})
    x = np.arange(4, dtype=np.float32)
    with engine.Client(eng.name) as c:
        assert (c.infer(x, timeout=30) == x + x).all()
    assert thread_rows(eng.name)[0].split(": ", 1)[1].startswith(
        "onnxruntime intra-op 1, inter-op 1;")


def test_status_advises_against_onnxruntimes_default_pool_when_unpinned(make_engine, doubling):
    eng = make_engine("ortdefault", backend="engine.backends:onnx", input_shape=(4,),
                      output_shape=(4,), backend_args={"path": doubling})
    rows = thread_rows(eng.name)
    assert "onnxruntime intra-op 0 (default: a thread per physical core)" in rows[0]
    assert rows[1].startswith("advice  onnxruntime's default pool has a thread per physical core")
    assert "intra_op_threads=1 (engine.backends.onnx)" in rows[1]
