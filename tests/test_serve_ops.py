"""`shmbatch serve` as a service runs it: readiness for systemd and probes,
Ctrl-C from a terminal, a backend module in the working directory."""
import os
import pathlib
import signal
import socket
import subprocess
import sys

import numpy as np
import psutil
from conftest import reap, unique_name, wait_for_line
from test_sidecar import ENV, shmbatch

import engine

X = np.arange(16, dtype=np.float32)
SHMBATCH = str(pathlib.Path(sys.executable).with_name("shmbatch"))  # the console script


def serve(name, *flags, backend="helpers:affine", env=ENV, cwd=None, command=None, **popen):
    command = command or [sys.executable, "-m", "engine"]
    return subprocess.Popen([*command, "serve", "--name", name, "--backend", backend,
                             "--input-shape", "16", "--output-shape", "16", *flags],
                            env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **popen)


def test_serve_tells_a_notify_socket_it_is_ready_once_clients_can_attach(tmp_path):
    name = unique_name("notify")
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(60)
        proc = serve(name, env={**ENV, "NOTIFY_SOCKET": path})
        try:
            message = sock.recv(4096).decode()
            assert "READY=1" in message.splitlines()
            assert f"MAINPID={proc.pid}" in message.splitlines()
            with engine.Client(name) as c:  # ready means: a client attaches and is answered
                assert np.array_equal(c.infer(X, timeout=10), X * 2 + 1)
            proc.send_signal(signal.SIGTERM)
            assert "STOPPING=1" in sock.recv(4096).decode().splitlines()
        finally:
            rc = reap(proc)
    assert rc == 0


def test_status_ready_exits_zero_only_while_the_engine_serves():
    name = unique_name("probe")
    assert shmbatch("status", name, "--ready").returncode == 1  # not started
    proc = serve(name)
    try:
        wait_for_line(proc.stdout, "ready")
        probe = shmbatch("status", name, "--ready")
        assert probe.returncode == 0 and "running" in probe.stdout
    finally:
        rc = reap(proc)
    assert rc == 0
    assert shmbatch("status", name, "--ready").returncode == 1  # stopped


def test_ctrl_c_to_the_process_group_drains_without_a_traceback_and_leaves_nothing():
    name = unique_name("ctrlc")
    proc = serve(name, "--max-batch-size", "4", "--backend-arg", "fixed_ms=20",
                 backend="helpers:slow_affine", start_new_session=True)  # a terminal's group
    try:
        wait_for_line(proc.stdout, "ready")
        batchers = [psutil.Process(p) for p in shmbatch_stats(name)["batcher_pids"]]
        with engine.Client(name) as c:
            futures = [c.submit(X + k, timeout=30) for k in range(12)]
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: every process of the group
            answers = [f.result(timeout=30) for f in futures]
        assert all(np.array_equal(y, (X + k) * 2 + 1) for k, y in enumerate(answers))
        assert proc.wait(60) == 0
        stderr = proc.stderr.read()
        assert "Traceback" not in stderr and "ERROR" not in stderr, stderr
        _, alive = psutil.wait_procs(batchers, timeout=10)
        assert not alive
        assert not os.path.exists(f"/dev/shm/shmbatch-{name}")
    finally:
        reap(proc)


def shmbatch_stats(name) -> dict:
    import json
    out = shmbatch("status", name, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_serve_imports_a_backend_module_from_its_working_directory(tmp_path):
    (tmp_path / "localmodel.py").write_text(
        "def load(scale=3.0):\n    return lambda batch: batch * scale\n")
    name = unique_name("local")
    env = {k: v for k, v in ENV.items() if k != "PYTHONPATH"}
    proc = serve(name, backend="localmodel:load", env=env, cwd=tmp_path, command=[SHMBATCH])
    try:
        wait_for_line(proc.stdout, "ready")
        with engine.Client(name) as c:
            assert np.array_equal(c.infer(X, timeout=10), X * 3)
    finally:
        rc = reap(proc)
    assert rc == 0
