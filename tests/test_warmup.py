"""warmup=True: before the engine is ready (and before a reload hands the ring
to its new batchers) each batcher calls its model on zeros at every batch
shape it will see, so the model's lazy first call is paid before any request
waits for it. The backends (warmup_backends) sleep FIRST_S in their process's
first call and log every call with its start and end: a test compares those
times with the moment the engine became ready, never a latency."""
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import reap, shm_entries, unique_name, wait_for
from test_sidecar import ENV
from warmup_backends import read_log

import engine

# each backend's first call in a process sleeps this long: a slow call is told by
# its flag and times are only ordered, so a short one proves what a long one would
FIRST_S = 0.2


def started(make_engine, log, **knobs):
    """An engine of warmup_backends' first_slow (unless a backend is given),
    started; (it, the time start() returned: the engine was ready)."""
    knobs.setdefault("backend", "warmup_backends:first_slow")
    knobs["backend_args"] = {"log": str(log), "first_s": FIRST_S, **knobs.get("backend_args", {})}
    if "inputs" not in knobs:
        knobs.setdefault("input_shape", (4,))
        knobs.setdefault("output_shape", (4,))
    eng = make_engine("warm", **knobs)
    return eng, time.monotonic()


def x_of(k: int) -> np.ndarray:
    return np.arange(4, dtype=np.float32) + 10 * k + 1  # never zeros: not a warm call


def test_warmup_calls_every_allowed_batch_size_on_zeros_before_ready(make_engine, tmp_path):
    log = tmp_path / "calls.jsonl"
    eng, ready = started(make_engine, log, warmup=True, max_batch_size=4,
                         allowed_batch_sizes=[1, 2, 4])
    calls = read_log(log)
    assert [c["rows"] for c in calls] == [1, 1, 2, 2, 4, 4]  # each shape twice
    assert all(c["zeros"] and c["shape"] == [c["rows"], 4] for c in calls)
    assert calls[0]["slow"] and not any(c["slow"] for c in calls[1:])
    assert max(c["end"] for c in calls) < ready  # the slow first call among them
    stats = eng.stats()
    assert stats["requests_total"] == 0 and stats["batches_total"] == 0
    assert stats["warmup_ms"] >= FIRST_S * 1000  # it held the slow call


def test_with_warmup_the_first_request_is_not_the_slow_call(make_engine, tmp_path):
    log = tmp_path / "calls.jsonl"
    eng, ready = started(make_engine, log, warmup=True)
    with engine.Client(eng.name) as c:
        assert np.array_equal(c.infer(x_of(1), timeout=30), x_of(1) + 1)
    after = [c for c in read_log(log) if c["start"] > ready]
    assert len(after) == 1 and not after[0]["zeros"] and not after[0]["slow"]
    assert [c for c in read_log(log) if c["slow"]][0]["end"] < ready


def test_without_warmup_the_first_request_pays_the_slow_call(make_engine, tmp_path):
    log = tmp_path / "calls.jsonl"
    eng, ready = started(make_engine, log)
    assert read_log(log) == [] and eng.stats()["warmup_ms"] is None
    with engine.Client(eng.name) as c:
        assert np.array_equal(c.infer(x_of(1), timeout=30), x_of(1) + 1)
    (call,) = read_log(log)
    assert call["slow"] and call["start"] > ready and not call["zeros"]


def test_sizes_default_to_one_and_max_batch_size(make_engine, tmp_path):
    log = tmp_path / "calls.jsonl"
    started(make_engine, log, warmup=True, max_batch_size=8)
    assert [c["rows"] for c in read_log(log)] == [1, 1, 8, 8]


def test_every_length_bucket_is_warmed_at_its_bound(make_engine, tmp_path):
    log = tmp_path / "calls.jsonl"
    eng, ready = started(make_engine, log, warmup=True, input_shape=(None,),
                         max_input_shape=(8,), output_shape=(1,), max_batch_size=2,
                         allowed_batch_sizes=[1, 2], length_buckets=[4])
    calls = read_log(log)
    assert [(c["rows"], c["shape"][1]) for c in calls] == [
        (1, 4), (1, 4), (2, 4), (2, 4), (1, 8), (1, 8), (2, 8), (2, 8)]
    assert all(c["zeros"] and c["lengths"] == [c["shape"][1]] * c["rows"] for c in calls)
    assert max(c["end"] for c in calls) < ready
    with engine.Client(eng.name) as c:
        x = np.array([3, 4, 5], np.float32)
        assert np.array_equal(c.infer(x, timeout=30), [12 + 3 + 1])


def test_max_batch_tokens_bounds_the_warmed_sizes(make_engine, tmp_path):
    log = tmp_path / "calls.jsonl"
    started(make_engine, log, warmup=True, input_shape=(None,), max_input_shape=(8,),
            output_shape=(1,), max_batch_size=4, length_buckets=[2], max_batch_tokens=8)
    # bucket 2 holds 4 requests; bucket 8, one
    assert [(c["rows"], c["shape"][1]) for c in read_log(log)] == [
        (1, 2), (1, 2), (4, 2), (4, 2), (1, 8), (1, 8)]


def test_named_tensors_are_warmed_with_a_dict_of_zeros(make_engine, tmp_path):
    log = tmp_path / "calls.jsonl"
    eng, ready = started(make_engine, log, warmup=True, backend="warmup_backends:named_first_slow",
                         inputs={"a": ("float32", (3,)), "ids": ("int64", (None,))},
                         max_input_shapes={"ids": (6,)}, outputs={"y": ("float32", (3,))},
                         max_batch_size=2)
    calls = read_log(log)
    assert [c["shape"] for c in calls] == [{"a": [n, 3], "ids": [n, 6]} for n in (1, 1, 2, 2)]
    assert all(c["zeros"] and c["lengths"] == {"ids": [6] * c["rows"]} for c in calls)
    with engine.Client(eng.name) as c:
        out = c.infer({"a": np.ones(3, np.float32), "ids": np.array([2, 3], np.int64)},
                      timeout=30)
        assert np.array_equal(out["y"], np.full(3, 6, np.float32))


def test_iterative_warmup_joins_steps_and_leaves_zero_prompts(make_engine, tmp_path):
    log = tmp_path / "calls.jsonl"
    eng, ready = started(make_engine, log, warmup=True, backend="warmup_backends:counter",
                         iterative=True, input_shape=(None,), input_dtype="int64",
                         max_input_shape=(6,), output_shape=(), output_dtype="int64",
                         max_batch_size=3, max_steps=4)
    calls = read_log(log)
    # per prompt length (1, then the bound 6) and running size (1, then 3): two rounds
    rounds = [(n, length) for length in (1, 6) for n in (1, 3) for _ in range(2)]
    assert [c["method"] for c in calls] == ["join", "step", "leave"] * len(rounds)
    joins = [c for c in calls if c["method"] == "join"]
    assert [(len(c["ids"]), c["shape"][1]) for c in joins] == rounds
    assert all(c["zeros"] and c["lengths"] == [c["shape"][1]] * len(c["ids"]) for c in joins)
    assert calls[0]["slow"] and max(c["end"] for c in calls) < ready
    assert eng.stats()["requests_total"] == 0 and eng.stats()["steps_total"] == 0
    with engine.Client(eng.name) as c:
        assert c.infer(np.array([4, 5], np.int64), timeout=30).tolist() == [9, 10, 11]
    after = read_log(log)[len(calls):]
    assert [c["method"] for c in after] == ["join", "step", "step", "step", "leave"]
    assert not any(c["slow"] for c in after)


def test_a_backend_that_raises_in_warmup_fails_the_start_in_one_line(tmp_path):
    eng = engine.Engine(unique_name("warmfail"), backend="warmup_backends:first_slow",
                        backend_args={"log": str(tmp_path / "calls.jsonl"), "first_s": 0,
                                      "raise_at": 4},
                        input_shape=(4,), output_shape=(4,), max_batch_size=4,
                        allowed_batch_sizes=[1, 2, 4], warmup=True)
    with pytest.raises(engine.BackendError) as raised:
        eng.start()
    text = str(raised.value)
    assert "\n" not in text and "batch size 4" in text and "no kernel" in text
    assert raised.value.exc_type == "RuntimeError"
    assert not [n for n in shm_entries() if eng.name in n]  # not started: nothing left
    with pytest.raises(engine.EngineUnavailable):
        engine.Client(eng.name)


def test_serve_warmup_flag_warms_before_it_tells_systemd_ready(tmp_path):
    log, path = tmp_path / "calls.jsonl", str(tmp_path / "notify.sock")
    name = unique_name("warmserve")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(60)
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", "--name", name, "--warmup",
             "--backend", "warmup_backends:first_slow", "--backend-arg", f"log={log}",
             "--backend-arg", f"first_s={FIRST_S}", "--input-shape", "4", "--output-shape", "4",
             "--max-batch-size", "2"],
            env={**ENV, "NOTIFY_SOCKET": path}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        try:
            assert "READY=1" in sock.recv(4096).decode().splitlines()
            ready = time.monotonic()
            calls = read_log(log)
            assert [c["rows"] for c in calls] == [1, 1, 2, 2]
            assert calls[0]["slow"] and max(c["end"] for c in calls) < ready
            with engine.Client(name) as c:
                assert np.array_equal(c.infer(x_of(1), timeout=30), x_of(1) + 1)
        finally:
            assert reap(proc, signal.SIGTERM) == 0


def test_serve_fails_in_one_line_when_warmup_raises(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "serve", "--name", unique_name("warmfail"), "--warmup",
         "--backend", "warmup_backends:first_slow", "--backend-arg", "first_s=0",
         "--backend-arg", "raise_at=2", "--input-shape", "4", "--output-shape", "4",
         "--max-batch-size", "2"], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("shmbatch serve: ") and "warmup failed at batch size 2" in last


def test_warmed_shapes_calibrate_admission_before_the_first_request(make_engine, tmp_path):
    sizes = list(range(1, 9))  # eight shapes: the fit's calibration, at once
    eng, _ = started(make_engine, tmp_path / "calls.jsonl", warmup=True, max_batch_size=8,
                     allowed_batch_sizes=sizes, backend_args={"first_s": 0})
    assert eng.stats()["admission"]["calibrated"]
    cold, _ = started(make_engine, tmp_path / "cold.jsonl", max_batch_size=8,
                      allowed_batch_sizes=sizes, backend_args={"first_s": 0})
    assert not cold.stats()["admission"]["calibrated"]


def test_a_warmed_shapes_first_request_is_a_measure_of_the_fit(make_engine, tmp_path):
    sizes = list(range(1, 8))  # seven shapes: one batch short of the fit's calibration
    eng, _ = started(make_engine, tmp_path / "calls.jsonl", warmup=True, max_batch_size=7,
                     allowed_batch_sizes=sizes, backend_args={"first_s": 0})
    assert not eng.stats()["admission"]["calibrated"]
    with engine.Client(eng.name) as c:  # its shape was warmed: no first call to skip
        assert np.array_equal(c.infer(x_of(1), timeout=30), x_of(1) + 1)
    wait_for(lambda: eng.stats()["admission"]["calibrated"], "the eighth batch in the fit", 10)


def test_a_reload_warms_its_new_batchers_before_they_take_the_queue(make_engine, tmp_path):
    old_log, new_log = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    eng, _ = started(make_engine, old_log, warmup=True, max_batch_size=2, instances=2)
    answers, stop = [], threading.Event()

    def send():  # back to back through the reload; each answer against its own request
        with engine.Client(eng.name) as c:
            for k in range(100_000):
                if stop.is_set():
                    return
                y = c.infer(x_of(k), timeout=30)
                answers.append((time.monotonic(), float(y[0] - x_of(k)[0]),
                                np.array_equal(y, x_of(k) + (y[0] - x_of(k)[0]))))
    sender = threading.Thread(target=send)
    sender.start()
    try:
        eng.reload(backend_args={"log": str(new_log), "first_s": FIRST_S, "bias": 2.0})
        returned = time.monotonic()
        wait_for(lambda: any(bias == 2.0 for _, bias, _ in answers),
                 "an answer from the new batchers", 30, every_s=0.01)
    finally:
        stop.set()
        sender.join(60)
    warm = [c for c in read_log(new_log) if c["zeros"]]
    assert sorted(c["rows"] for c in warm) == [1, 1, 1, 1, 2, 2, 2, 2]  # two batchers
    assert sum(c["slow"] for c in warm) == 2 and max(c["end"] for c in warm) < returned
    first_new = min(t for t, bias, _ in answers if bias == 2.0)
    assert max(c["end"] for c in warm) < first_new
    assert all(ok and bias in (1.0, 2.0) for _, bias, ok in answers)
    assert not any(c["slow"] for c in read_log(new_log) if not c["zeros"])
    assert eng.stats()["requests_total"] == len(answers)
