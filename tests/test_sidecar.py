"""The sidecar deployment end to end: `shmbatch serve` / `status` / `cleanup`,
Prometheus metrics, and gunicorn --preload workers answering over HTTP."""
import concurrent.futures
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import shm_entries, unique_name, wait_for, wait_for_line

import engine
from engine.segment import Segment
from engine.shm import codes

TESTS = pathlib.Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
X = np.arange(16, dtype=np.float32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shmbatch(*args, timeout_s=60):
    return subprocess.run([sys.executable, "-m", "engine", *args], env=ENV, capture_output=True,
                          text=True, timeout=timeout_s)


class Serve:
    """`shmbatch serve` in a subprocess, ready when it says so."""

    def __init__(self, name, *flags, backend="helpers:affine"):
        self.name = name
        chosen = ["--backend", backend] if backend else []  # None: the config's
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", "--name", name, *chosen,
             "--input-shape", "16", "--output-shape", "16", *flags],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            self.ready_line = wait_for_line(self.proc.stdout, "ready")[-1]
        except EOFError as e:
            raise EOFError(f"{e}; stderr: {self.proc.stderr.read()}") from None

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        finally:
            self.proc.stdout.close()
            self.proc.stderr.close()


@pytest.fixture
def serves():
    started = []

    def start(*args, **kwargs):
        s = Serve(*args, **kwargs)
        started.append(s)
        return s
    yield start
    for s in started:
        if s.proc.poll() is None:
            s.stop(signal.SIGKILL)
        if [e for e in shm_entries() if s.name in e]:  # a killed serve's, for cleanup
            shmbatch("cleanup", s.name)


def test_serve_from_flags_answers_status_and_metrics_then_exits_clean(serves):
    port = free_port()
    s = serves(unique_name("serve"), "--max-batch-size", "8", "--metrics-port", str(port),
               "--metrics-host", "127.0.0.1", "--backend-arg", "fixed_ms=0.5",
               backend="engine.backends:synthetic")
    assert "ready" in s.ready_line
    with engine.Client(s.name) as c:
        for k in range(20):
            assert np.array_equal(c.infer(X + k, timeout=10), (X + k) * 2 + 1)
    status = shmbatch("status", s.name, "--json")
    assert status.returncode == 0, status.stderr
    figures = json.loads(status.stdout)
    assert figures["requests_total"] == figures["answered_total"] == 20
    assert figures["state"] == "running" and figures["instances_alive"] == 1
    assert figures["max_batch_size"] == 8 and figures["corrupt_total"] == 0
    table = shmbatch("status", s.name)
    assert "queue wait" in table.stdout and "p99" in table.stdout
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'shmbatch_requests_total{{engine="{s.name}",outcome="ok"}} 20.0' in text
    for name in ("shmbatch_batches_total", "shmbatch_batch_size_bucket",
                 "shmbatch_queue_wait_seconds_bucket", "shmbatch_service_seconds_bucket",
                 "shmbatch_queue_depth", "shmbatch_batch_limit", "shmbatch_isolated_failures_total",
                 "shmbatch_retried_alone_total", f'shmbatch_corrupt_total{{engine="{s.name}"}} 0.0',
                 'shmbatch_queue_wait_by_priority_seconds_bucket{engine="%s",le="0.001",priority="0"}'
                 % s.name, 'outcome="overloaded"', 'outcome="expired"'):
        assert name in text
    assert s.stop() == 0
    assert not os.path.exists(f"/dev/shm/shmbatch-{s.name}")


def test_serve_reads_a_toml_config_and_flags_override_it(serves, tmp_path):
    config = tmp_path / "engine.toml"
    config.write_text('backend = "helpers:slow_affine"\ninput_shape = [16]\noutput_shape = [16]\n'
                      'max_batch_size = 4\nmax_delay_ms = 1.5\n[backend_args]\nfixed_ms = 1.0\n')
    s = serves(unique_name("toml"), "--config", str(config), "--max-batch-size", "6", backend=None)
    figures = json.loads(shmbatch("status", s.name, "--json").stdout)
    assert (figures["max_batch_size"], figures["max_delay_ms"]) == (6, 1.5)
    with engine.Client(s.name) as c:
        assert np.array_equal(c.infer(X, timeout=10), X * 2 + 1)


def test_sigterm_drains_requests_in_flight(serves):
    s = serves(unique_name("drain"), "--max-batch-size", "4", "--backend-arg", "fixed_ms=20",
               backend="helpers:slow_affine")
    with engine.Client(s.name) as c:
        futures = [c.submit(X + k, timeout=30) for k in range(40)]
        s.proc.send_signal(signal.SIGTERM)
        answers = [f.result(timeout=30) for f in futures]
    assert all(np.array_equal(y, (X + k) * 2 + 1) for k, y in enumerate(answers))
    assert s.stop() == 0
    assert not os.path.exists(f"/dev/shm/shmbatch-{s.name}")


def test_cleanup_removes_a_killed_serve_and_refuses_a_live_one(serves):
    s = serves(unique_name("clean"))
    refused = shmbatch("cleanup", s.name)
    assert refused.returncode != 0 and "already running" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    s.stop(signal.SIGKILL)
    assert os.path.exists(f"/dev/shm/shmbatch-{s.name}")  # a crash leaves it
    dead = shmbatch("status", s.name)
    assert dead.returncode != 0 and f"dead (run: shmbatch cleanup {s.name})" in dead.stdout
    done = shmbatch("cleanup", s.name)
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(f"/dev/shm/shmbatch-{s.name}")
    assert shmbatch("cleanup", s.name).returncode != 0  # nothing left to clean


@pytest.mark.parametrize("flags, reason", [
    (["--name", "a/b", "--backend", "engine.backends:identity", "--input-shape", "16",
      "--output-shape", "16"], "name must match"),
    (["--name", "NAME", "--backend", "engine.backends:identity", "--output-shape", "16"],
     "missing --input-shape"),
    (["--name", "NAME", "--backend", "engine.backends:identity", "--input-shape", "x",
      "--output-shape", "16"], "expected a shape"),
    (["--name", "NAME", "--backend", "engine.backends:identity", "--input-shape", "none,4",
      "--output-shape", "16"], "max_input_shape"),
    (["--name", "NAME", "--backend", "helpers:no_such", "--input-shape", "16",
      "--output-shape", "16"], "AttributeError"),
    (["--name", "NAME", "--backend", "engine.backends:identity", "--input-shape", "16",
      "--output-shape", "16", "--batch-timeout-s", "-1"], "batch_timeout_s must be > 0"),
])
def test_bad_flags_give_one_line_and_create_nothing(flags, reason):
    name = unique_name("bad")
    flags = [name if f == "NAME" else f for f in flags]
    result = shmbatch("serve", *flags)
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if "ERROR" not in line]
    assert len(lines) == 1 and reason in lines[0], result.stderr
    assert not os.path.exists(f"/dev/shm/shmbatch-{name}")


class Gunicorn:
    def __init__(self, name, workers=4, in_worker=False):
        self.port = free_port()
        env = {**ENV, "SHMBATCH_NAME": name, "SHMBATCH_IN_WORKER": "1" if in_worker else "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--preload", "-w", str(workers), "-b",
             f"127.0.0.1:{self.port}", "--chdir", str(TESTS), "sidecar_app:app"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_for_line(self.proc.stderr, "Booting worker", count=workers)

    def post(self, x: np.ndarray):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/", data=x.tobytes(),
                                     method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, np.frombuffer(r.read(), np.float32)
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stderr.close()


def test_gunicorn_preload_workers_answer_over_http_and_batch_across_workers(serves, gate):
    s = serves(unique_name("guni"), "--max-batch-size", "16", "--backend-arg", f"gate={gate.name}",
               backend="helpers:gated")
    web = Gunicorn(s.name, workers=4)
    seg = Segment.attach(s.name)
    # the first batch waits until each of the 4 workers has a request queued
    opener = threading.Thread(target=lambda: (
        wait_for(lambda: seg.ring.word(codes.W_REQUESTS) >= 4, "a request from each worker"),
        gate.open()))
    opener.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda k: (k, web.post(X + k)), range(200)))
    finally:
        opener.join(60)
        seg.close()
        web.stop()
    for k, (status, y) in results:
        assert status == 200 and np.array_equal(y, (X + k) * 2 + 1)
    figures = json.loads(shmbatch("status", s.name, "--json").stdout)
    assert figures["answered_total"] == 200
    assert max(map(int, figures["batch_size_counts"])) > 1  # workers' requests shared a batch


def test_workers_get_503_while_the_sidecar_is_gone_and_recover_without_restart(serves):
    name = unique_name("restart")
    first = serves(name)
    web = Gunicorn(name, workers=2)
    try:
        assert web.post(X)[0] == 200
        assert first.stop() == 0
        statuses = {web.post(X)[0] for _ in range(6)}
        assert statuses == {503}
        serves(name, backend="engine.backends:identity")
        answers = [web.post(X + k) for k in range(6)]
        assert all(st == 200 and np.array_equal(y, X + k) for k, (st, y) in enumerate(answers))
    finally:
        web.stop()
