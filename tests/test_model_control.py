"""`serve --model-control explicit`: Triton's model repository extension through tritonclient.http.
A load with a config reloads a running engine (its answers show the new args) or starts
one; an unload drains (what it holds is answered), then every worker answers 404; a load
brings it back. The index says each engine's state; a bad config key is refused naming it;
without the flag load and unload are refused; the API key guards these routes too."""
import concurrent.futures
import json

import numpy as np
import pytest

pytest.importorskip("uvicorn")
triton = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402
from conftest import Gate, unique_name, wait_for  # noqa: E402
from test_http_auth import Serve, request  # noqa: E402
from test_multi_engine import table, top  # noqa: E402
from test_sidecar import shmbatch  # noqa: E402

KEY = "sk-test-model-control-5d1e"
AUTH = {"authorization": f"Bearer {KEY}"}
OFFSET = dict(backend="reload_backends:offset", input_shape=[4], output_shape=[4])
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def gate():
    g = Gate()
    yield g
    g.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, gate):
    """One serve of three engines, two HTTP workers, explicit model control, an API key."""
    names = {k: unique_name(f"mc-{k}") for k in ("reload", "unload", "drain")}
    config = (top(api_key=KEY) + table(names["reload"], **OFFSET)
              + table(names["unload"], **OFFSET, backend_args={"bias": 3.0})
              + table(names["drain"], backend="reload_backends:held", input_shape=[4],
                      output_shape=[4], backend_args={"gate": gate.name, "bias": 1.0},
                      max_batch_size=2))
    s = Serve(tmp_path_factory.mktemp("model-control"), config, "--model-control", "explicit",
              "--http-workers", "2")
    s.names = names
    yield s
    assert s.stop() == 0, s.stderr()


def client(served):
    return triton.InferenceServerClient(served.url, network_timeout=TIMEOUT_S,
                                        connection_timeout=TIMEOUT_S)


def infer(c, name: str, x: np.ndarray) -> np.ndarray:
    inp = triton.InferInput("INPUT", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return c.infer(name, [inp], headers=AUTH).as_numpy("OUTPUT")


def index(c) -> dict:
    return {e["name"]: e for e in c.get_model_repository_index(headers=AUTH)}


def rows(k: int, start: float = 0.0) -> np.ndarray:
    return (np.arange(k * 4, dtype=np.float32) + start).reshape(k, 4)


def test_a_load_with_a_config_reloads_a_running_engine_with_it(served):
    name, c, x = served.names["reload"], client(served), rows(3)
    assert np.array_equal(infer(c, name, x), x)
    c.load_model(name, config=json.dumps({"backend_args": {"bias": 5.0, "scale": 2.0}}),
                 headers=AUTH)
    assert c.is_model_ready(name, headers=AUTH)
    assert np.array_equal(infer(c, name, x), 2 * x + 5)
    assert index(c)[name]["state"] == "READY"


def test_an_unloaded_engine_is_404_on_every_worker_until_loaded_again(served):
    name, c, x = served.names["unload"], client(served), rows(2, 7.0)
    assert np.array_equal(infer(c, name, x), x + 3)
    c.unload_model(name, headers=AUTH)
    entry = index(c)[name]
    assert (entry["state"], entry["reason"]) == ("UNAVAILABLE", "unloaded")
    assert name not in {e["name"] for e in c.get_model_repository_index(headers=AUTH)
                        if e["state"] == "READY"}
    for _ in range(20):  # fresh connections: the kernel hands them to either worker
        status, _, answer = request(served.url, f"/v2/models/{name}/infer", KEY, "POST", {
            "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 4],
                        "data": [0, 1, 2, 3]}]})
        assert status == 404, answer
    assert not c.is_model_ready(name, headers=AUTH)
    c.load_model(name, headers=AUTH)  # its last settings: bias 3
    assert np.array_equal(infer(c, name, x), x + 3)
    for _ in range(20):
        status, _, answer = request(served.url, f"/v2/models/{name}/ready", KEY)
        assert status == 200, answer


def test_a_new_engine_loads_from_its_config_alone(served):
    name, c, x = unique_name("mc-new"), client(served), rows(4, -2.0)
    with pytest.raises(InferenceServerException) as refused:
        c.load_model(name, headers=AUTH)  # no config: nothing to start it from
    assert refused.value.status() == "400" and "parameters.config" in refused.value.message()
    c.load_model(name, config=json.dumps({**OFFSET, "backend_args": {"bias": -1.5}}),
                 headers=AUTH)
    assert np.array_equal(infer(c, name, x), x - 1.5)
    assert index(c)[name]["state"] == "READY"
    c.unload_model(name, headers=AUTH)
    assert shmbatch("status", name).returncode != 0  # stopped: no engine of that name


def plain_infer(served, name: str, x: np.ndarray) -> np.ndarray:
    """One infer in plain HTTP JSON (tritonclient.http's gevent keeps to one thread)."""
    status, _, answer = request(served.url, f"/v2/models/{name}/infer", KEY, "POST", {
        "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(x.shape),
                    "data": x.ravel().tolist()}]})
    assert status == 200, answer
    out = json.loads(answer)["outputs"][0]
    return np.array(out["data"], dtype=np.float32).reshape(out["shape"])


def test_requests_an_unload_finds_in_flight_are_all_answered(served, gate):
    name, c = served.names["drain"], client(served)
    xs = [-rows(1, 10.0 * i) for i in range(6)]  # negative: the gate holds their batches
    with concurrent.futures.ThreadPoolExecutor(len(xs) + 1) as pool:
        answers = [pool.submit(plain_infer, served, name, x) for x in xs]
        wait_for(lambda: json.loads(shmbatch("status", name, "--json").stdout)
                 ["slots_in_use"] == len(xs), "every request in the engine", every_s=0.05)
        unloading = pool.submit(request, served.url, f"/v2/repository/models/{name}/unload",
                                KEY, "POST", {})
        wait_for(lambda: index(c)[name]["state"] == "UNLOADING", "the unload began",
                 every_s=0.05)
        for _ in xs:  # each held batch passes on one opening; at most one batch a request
            gate.open()
        for x, answer in zip(xs, answers):
            assert np.array_equal(answer.result(TIMEOUT_S), x + 1)
        assert unloading.result(TIMEOUT_S)[0] == 200
    assert index(c)[name]["state"] == "UNAVAILABLE"
    with pytest.raises(InferenceServerException) as gone:
        infer(c, name, xs[0])
    assert gone.value.status() == "404"


def test_a_bad_config_key_is_refused_naming_it_and_the_engine_serves_on(served):
    name, c, x = served.names["reload"], client(served), rows(1)
    before = infer(c, name, x)
    with pytest.raises(InferenceServerException) as refused:
        c.load_model(name, config=json.dumps({"max_batch_sise": 8}), headers=AUTH)
    message = refused.value.message()
    assert refused.value.status() == "400" and "max_batch_sise" in message
    assert "\n" not in message
    assert np.array_equal(infer(c, name, x), before)


def test_a_load_that_changes_what_a_reload_cannot_is_refused(served):
    name, c = served.names["reload"], client(served)
    with pytest.raises(InferenceServerException) as refused:
        c.load_model(name, config={"input_shape": [8], "output_shape": [8]}, headers=AUTH)
    assert refused.value.status() == "400"
    assert "input_shape" in refused.value.message() and "unload" in refused.value.message()


def test_a_start_that_fails_answers_why_and_leaves_the_others_serving(served):
    name, c = unique_name("mc-broken"), client(served)
    with pytest.raises(InferenceServerException) as refused:
        c.load_model(name, config=json.dumps({**OFFSET, "backend": "reload_backends:broken"}),
                     headers=AUTH)
    assert refused.value.status() == "500" and "no weights" in refused.value.message()
    entry = index(c)[name]
    assert entry["state"] == "UNAVAILABLE" and "no weights" in entry["reason"]
    assert c.is_model_ready(served.names["reload"], headers=AUTH)


def test_model_control_needs_the_api_key(served):
    name = served.names["reload"]
    for path in (f"/v2/repository/models/{name}/load", f"/v2/repository/models/{name}/unload",
                 "/v2/repository/index"):
        status, _, _ = request(served.url, path, None, "POST", {})
        assert status == 401
    assert client(served).is_model_ready(name, headers=AUTH)


def test_without_explicit_model_control_load_and_unload_are_refused(tmp_path):
    name = unique_name("mc-fixed")
    s = Serve(tmp_path, table(name, **OFFSET))
    try:
        for op in ("load", "unload"):
            status, _, answer = request(s.url, f"/v2/repository/models/{name}/{op}", None,
                                        "POST", {})
            assert status == 400 and "fixed at serve time" in json.loads(answer)["error"]
        status, _, answer = request(s.url, "/v2/repository/index", None, "POST", {})
        assert status == 200 and json.loads(answer)[0]["state"] == "READY"
    finally:
        assert s.stop() == 0, s.stderr()


@pytest.mark.parametrize("body, says", [
    ({"parameters": {"config": "{not json"}}, "config"),
    ({"parameters": {"config": "[1, 2]"}}, "object"),
    ({"parameters": {"config": {"max_batch_sise": 8}}}, "max_batch_sise"),
    ({"parameters": {"config": {"max_batch_size": "eight"}}}, "max_batch_size"),
])
def test_a_bad_load_body_in_plain_http_is_400_saying_what_was_wrong(served, body, says):
    name = served.names["reload"]
    status, _, answer = request(served.url, f"/v2/repository/models/{name}/load", KEY, "POST",
                                body)
    assert status == 400 and says in json.loads(answer)["error"], answer
    assert client(served).is_model_ready(name, headers=AUTH)


def test_the_asyncio_client_loads_infers_unloads_and_loads_again(served):
    import asyncio
    aio = pytest.importorskip("tritonclient.http.aio")
    name, x = unique_name("mc-aio"), rows(2, 1.0)
    config = json.dumps({**OFFSET, "backend_args": {"bias": 4.0}})

    async def infer_aio(c):
        inp = aio.InferInput("INPUT", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        return (await c.infer(name, [inp], headers=AUTH)).as_numpy("OUTPUT")

    async def scenario():
        c = aio.InferenceServerClient(served.url, conn_timeout=TIMEOUT_S)
        try:
            await c.load_model(name, config=config, headers=AUTH)
            first = await infer_aio(c)
            await c.unload_model(name, headers=AUTH)
            with pytest.raises(InferenceServerException) as gone:
                await infer_aio(c)
            await c.load_model(name, headers=AUTH)  # its last settings again
            again = await infer_aio(c)
            await c.unload_model(name, headers=AUTH)
            return first, gone.value, again
        finally:
            await c.close()

    first, gone, again = asyncio.run(asyncio.wait_for(scenario(), 2 * TIMEOUT_S))
    assert np.array_equal(first, x + 4) and np.array_equal(again, x + 4)
    assert "unknown model" in str(gone)
