"""Readiness, over HTTP and on the command line: an engine is ready only while a live
batcher that has loaded its model serves it, not while a replacement still loads it."""
import http.client
import json
import os
import signal

import numpy as np
import pytest

pytest.importorskip("uvicorn")
triton = pytest.importorskip("tritonclient.http")
from conftest import Gate, shm_entries, unique_name, wait_for  # noqa: E402
from test_multi_engine import Served, table  # noqa: E402
from test_sidecar import shmbatch  # noqa: E402


def get(url: str, path: str, method: str = "GET"):
    """(status, headers by lowercase name, JSON body)."""
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return (response.status, {k.lower(): v for k, v in response.getheaders()},
                json.loads(response.read()))
    finally:
        conn.close()


def test_not_ready_while_a_replacement_batcher_still_loads_its_model(tmp_path):
    gate = Gate()
    gate.open()  # the first batcher's factory passes; its replacement's waits for the gate
    name = unique_name("ready")
    s = Served(tmp_path, table(name, backend="helpers:starts_on_gate",
                               backend_args={"gate": gate.name}, input_shape=[4],
                               output_shape=[4]), "--http-port", "0")
    try:
        c = triton.InferenceServerClient(s.url)
        assert c.is_server_ready() and c.is_model_ready(name)
        assert shmbatch("status", name, "--ready").returncode == 0
        pid = json.loads(shmbatch("status", name, "--json").stdout)["batcher_pids"][0]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not c.is_server_ready(), "the server not ready", 30, every_s=0.05)

        for path in ("/v2/health/ready", f"/v2/models/{name}/ready"):
            status, headers, answer = get(s.url, path)
            assert status == 503 and int(headers["retry-after"]) >= 1, (path, status, answer)
            assert "expected a live batcher that has loaded its model, got none" in \
                answer["error"], answer
        assert not c.is_model_ready(name)
        index = c.get_model_repository_index()
        assert [m["state"] for m in index] == ["UNAVAILABLE"]
        out = shmbatch("status", name, "--ready")
        assert out.returncode == 1 and "not ready" in out.stdout, out

        gate.open()  # the replacement loads its model, and serves
        wait_for(c.is_server_ready, "the server ready again", 60, every_s=0.05)
        assert c.is_model_ready(name) and shmbatch("status", name, "--ready").returncode == 0
        x = np.arange(4, dtype=np.float32)[None]
        t = triton.InferInput("INPUT", [1, 4], "FP32")
        t.set_data_from_numpy(x)
        assert np.array_equal(c.infer(name, [t]).as_numpy("OUTPUT"), x * 2 + 1)
    finally:
        gate.open()
        try:
            assert s.stop() == 0, s.stderr()
        finally:
            gate.close()
    assert not [e for e in shm_entries() if name in e]
