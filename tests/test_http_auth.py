"""Who may call the HTTP port: `serve --api-key KEY` (or SHMBATCH_API_KEY) asks every route
but the health probes for `Authorization: Bearer KEY`, and GET /health says whether every
engine serves. The key shows in no child's command line, no log line and no answer."""
import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import psutil
import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
triton = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402
from conftest import Gate, reap, shm_entries, unique_name, wait_for, wait_for_line  # noqa: E402
from openai_served import STEPS, openai_table  # noqa: E402
from test_multi_engine import table, top  # noqa: E402
from test_sidecar import ENV, shmbatch  # noqa: E402

KEY = "sk-test-3f9a1c77e2b04d5d"
WRONG = "sk-wrong-0c1d2e3f4a5b6c7d"
BYTES = {"tokenizer": "openai_models:bytes_tokenizer"}
AFFINE = dict(backend="helpers:affine", input_shape=[4], output_shape=[4])
X = np.arange(4, dtype=np.float32)[None]
HEALTH = ("/health", "/v2/health/live", "/v2/health/ready")


class Serve:
    """`shmbatch serve --config FILE --http-port 0 *flags` with `env` added to its
    environment, until stop(); `url` the HTTP address its ready line names."""

    def __init__(self, folder, config: str, *flags, env=None):
        path = folder / "models.toml"
        path.write_text(config)
        self.errors = folder / "serve.err"
        with open(self.errors, "w") as errors:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine", "serve", "--config", str(path),
                 "--http-port", "0", *flags],
                env={**ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            ready = wait_for_line(self.proc.stdout, "ready")[-1]
        except (EOFError, TimeoutError) as e:
            self.stop()
            raise AssertionError(f"{e}; stderr: {self.stderr()}") from None
        self.url = re.search(r"http://(\S+)$", ready.strip()).group(1)

    def stderr(self) -> str:
        return self.errors.read_text()

    def stop(self) -> int:
        return reap(self.proc, signal.SIGTERM)


def request(url: str, path: str, key=None, method: str = "GET", body=None):
    """(status, headers by lowercase name, the answer's bytes) of one request."""
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{url}{path}", data=data, method=method,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, \
                response.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def infer_body() -> dict:
    return {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 4],
                        "data": X.ravel().tolist()}]}


def oip_status(url: str, engine: str, key=None) -> int:
    return request(url, f"/v2/models/{engine}/infer", key, "POST", infer_body())[0]


def openai_client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{url}/v1", api_key=key, max_retries=0, timeout=60)


def two_engines(folder, *flags, env=None) -> Serve:
    """serve of `echo` on the OpenAI API and `affine` on the OIP, two HTTP workers;
    `names` maps each to its engine's name."""
    names = {"echo": unique_name("auth-echo"), "affine": unique_name("auth-affine")}
    config = (top(http_workers=2)
              + table(names["echo"], backend="openai_models:echo", **STEPS)
              + openai_table(names["echo"], model="echo", **BYTES)
              + table(names["affine"], **AFFINE))
    served = Serve(folder, config, *flags, env=env)
    served.names = names
    return served


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """two_engines() with SHMBATCH_API_KEY=KEY in serve's environment."""
    served = two_engines(tmp_path_factory.mktemp("keyed"), env={"SHMBATCH_API_KEY": KEY})
    yield served
    assert served.stop() == 0, served.stderr()


def affine_serve(folder, *flags, env=None, **keys) -> Serve:
    """serve of one OIP engine, `affine`, its name in `engine`."""
    name = unique_name("auth")
    served = Serve(folder, top(**keys) + table(name, **AFFINE), *flags, env=env)
    served.engine = name
    return served


def test_without_a_key_configured_every_route_answers_as_before(tmp_path):
    served = affine_serve(tmp_path)
    try:
        assert oip_status(served.url, served.engine) == 200
        assert oip_status(served.url, served.engine, WRONG) == 200  # a header nobody asked for
        assert request(served.url, "/v2")[0] == 200
    finally:
        assert served.stop() == 0, served.stderr()


def test_the_openai_client_is_answered_with_the_key_alone(keyed):
    answer = openai_client(keyed.url, KEY).completions.create(model="echo", prompt="hi",
                                                               max_tokens=2)
    assert answer.choices[0].text and answer.usage.completion_tokens == 2
    status, _, body = request(keyed.url, "/v1/completions", None, "POST",
                              {"model": "echo", "prompt": "hi", "max_tokens": 2})
    assert status == 401, body


def test_the_openai_client_with_a_wrong_key_raises_authentication_error(keyed):
    with pytest.raises(openai.AuthenticationError) as refused:
        openai_client(keyed.url, WRONG).completions.create(model="echo", prompt="hi",
                                                            max_tokens=2)
    assert refused.value.status_code == 401
    assert refused.value.response.headers["www-authenticate"] == "Bearer"
    body = refused.value.body
    assert (body["type"], body["param"], body["code"]) == ("invalid_request_error", None,
                                                          "invalid_api_key")
    assert "expected an Authorization: Bearer header" in body["message"]
    assert "not this server's key" in body["message"]
    assert WRONG not in body["message"] and KEY not in body["message"]


def test_an_oip_infer_without_the_header_is_401_in_the_oip_shape(keyed):
    status, headers, body = request(keyed.url, f"/v2/models/{keyed.names['affine']}/infer",
                                    None, "POST", infer_body())
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    error = json.loads(body)
    assert set(error) == {"error"} and isinstance(error["error"], str)
    assert "expected an Authorization: Bearer header" in error["error"]
    assert "got no Authorization header" in error["error"]


def test_tritonclient_infers_with_the_key_in_its_headers_alone(keyed):
    c = triton.InferenceServerClient(keyed.url)
    t = triton.InferInput("INPUT", [1, 4], "FP32")
    t.set_data_from_numpy(X)
    answer = c.infer(keyed.names["affine"], [t], headers={"Authorization": f"Bearer {KEY}"})
    assert np.array_equal(answer.as_numpy("OUTPUT"), X * 2 + 1)
    with pytest.raises(InferenceServerException) as refused:
        c.infer(keyed.names["affine"], [t])
    assert refused.value.status() == "401"


@pytest.mark.parametrize("path, method, with_key", [
    ("/v2", "GET", 200), ("/v2/models/{affine}", "GET", 200),
    ("/v2/models/{affine}/ready", "GET", 200), ("/v2/repository/index", "POST", 200),
    ("/v1/models", "GET", 200), ("/no/such/route", "GET", 404)])
def test_every_route_but_the_health_probes_needs_the_key(keyed, path, method, with_key):
    path = path.format(**keyed.names)
    assert request(keyed.url, path, None, method)[0] == 401
    assert request(keyed.url, path, WRONG, method)[0] == 401
    assert request(keyed.url, path, KEY, method)[0] == with_key


def test_the_health_probes_need_no_key(keyed):
    for path in HEALTH:
        status, _, body = request(keyed.url, path)
        assert status == 200, (path, body)


def test_the_401_is_answered_before_the_body_is_read(keyed):
    host, port = keyed.url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # a body of 1 MB announced, none of it sent: only a refusal made on the head answers
        sock.sendall(f"POST /v2/models/{keyed.names['affine']}/infer HTTP/1.1\r\nHost: x\r\n"
                     f"Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
                     .encode())
        head = sock.recv(4096).decode("latin-1")
    assert head.startswith("HTTP/1.1 401 "), head


def test_the_flags_key_is_in_no_childs_command_line_log_line_answer_or_status(tmp_path):
    served = two_engines(tmp_path, "--api-key", KEY, "--log-level", "DEBUG")
    try:
        affine = served.names["affine"]
        assert oip_status(served.url, affine, WRONG) == 401  # a refusal, logged if anything is
        assert oip_status(served.url, affine, KEY) == 200
        children = psutil.Process(served.proc.pid).children(recursive=True)
        assert len(children) >= 4  # a batcher per engine, two HTTP workers
        for child in children:
            assert not any(KEY in part for part in child.cmdline()), child.cmdline()
        for name in served.names.values():
            out = shmbatch("status", name, "--json")
            assert out.returncode == 0 and KEY not in out.stdout + out.stderr
        _, _, body = request(served.url, "/v1/models", WRONG)
        assert WRONG.encode() not in body and KEY.encode() not in body
    finally:
        assert served.stop() == 0, served.stderr()
    assert "HTTP worker" in served.stderr() and KEY not in served.stderr()


def test_no_child_of_serve_inherits_the_environment_variable(keyed):
    assert oip_status(keyed.url, keyed.names["affine"]) == 401  # the variable's key is serve's
    children = psutil.Process(keyed.proc.pid).children(recursive=True)
    assert len(children) >= 4
    for child in children:
        assert "SHMBATCH_API_KEY" not in child.environ()
        assert KEY not in " ".join(child.cmdline())


def test_the_flag_wins_over_the_environment_variable(tmp_path):
    served = affine_serve(tmp_path, "--api-key", KEY, env={"SHMBATCH_API_KEY": WRONG})
    try:
        assert oip_status(served.url, served.engine, WRONG) == 401
        assert oip_status(served.url, served.engine, KEY) == 200
    finally:
        assert served.stop() == 0, served.stderr()


def test_a_config_files_api_key_is_serves_own_key(tmp_path):
    from engine.cli import commands
    path = tmp_path / "models.toml"
    path.write_text(top(http_port=0, api_key=KEY) + table("a", **AFFINE))
    _, serve = commands.serve_plan(argparse.Namespace(config=str(path), backend_arg=None))
    assert serve["api_key"] == KEY


def test_a_key_that_cannot_travel_in_a_header_fails_the_start_without_showing_it(tmp_path):
    secret = "two words"
    out = subprocess.run([sys.executable, "-m", "engine", "serve", "--name", unique_name("auth"),
                          "--backend", "helpers:affine", "--input-shape", "4",
                          "--output-shape", "4", "--http-port", "0", "--api-key", secret],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "ready" not in out.stdout
    assert "--api-key" in out.stderr and "visible ASCII" in out.stderr, out.stderr
    assert secret not in out.stderr


def test_health_is_200_while_every_engine_serves_and_503_while_one_does_not(tmp_path):
    gate = Gate()
    gate.open()  # the first batcher's factory passes; its replacement's waits for the gate
    other = unique_name("auth-other")
    name = unique_name("auth-gated")
    served = None
    try:
        served = Serve(tmp_path, table(other, **AFFINE)
                       + table(name, backend="helpers:starts_on_gate",
                               backend_args={"gate": gate.name}, input_shape=[4],
                               output_shape=[4]), "--api-key", KEY)
        for method in ("GET", "HEAD"):
            assert request(served.url, "/health", method=method)[0] == 200
        pid = json.loads(shmbatch("status", name, "--json").stdout)["batcher_pids"][0]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: request(served.url, "/health")[0] != 200, "/health not 200", 30,
                 every_s=0.05)
        status, headers, body = request(served.url, "/health")
        assert status == 503 and int(headers["retry-after"]) >= 1, (status, body)
        assert name in json.loads(body)["error"]
        gate.open()  # the replacement loads its model, and serves
        wait_for(lambda: request(served.url, "/health")[0] == 200, "/health 200 again", 60,
                 every_s=0.05)
    finally:
        gate.open()
        try:
            assert served is None or served.stop() == 0, served.stderr()
        finally:
            gate.close()
    assert not [e for e in shm_entries() if name in e or other in e]
