"""Open parameters on `shmbatch serve --http-port`: a key the server does not know, at
request, input or output level, is ignored (as Triton and KServe do: KServe's clients send
content_type), while the keys it knows are still checked; by raw HTTP and by KServe's own
InferenceRESTClient (where kserve is installed: see tests/test_kserve_client.py)."""
import asyncio
import http.client
import json

import numpy as np
import pytest

pytest.importorskip("uvicorn")
from conftest import unique_name  # noqa: E402
from test_multi_engine import Served, table, top  # noqa: E402

X = [[0.5, 1.0, 1.5, 2.0], [3.0, 4.0, 5.0, 6.0]]
OPEN = {"content_type": "np", "custom": {"a": [1, 2]}, "sequence_id": 7}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    name = unique_name("params")
    serve = Served(tmp_path_factory.mktemp("params"),
                   top() + table(name, backend="helpers:affine", input_shape=[4],
                                 output_shape=[4], max_batch_size=8),
                   "--http-port", "0")
    try:
        yield name, serve.url
    finally:
        assert serve.stop() == 0, serve.stderr()


def infer(url: str, name: str, request: dict):
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", f"/v2/models/{name}/infer", body=json.dumps(request).encode(),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def request(parameters=None, input_parameters=None, output_parameters=None) -> dict:
    given = {"name": "INPUT", "shape": [2, 4], "datatype": "FP32", "data": X}
    if input_parameters is not None:
        given["parameters"] = input_parameters
    out = {"name": "OUTPUT"}
    if output_parameters is not None:
        out["parameters"] = output_parameters
    body = {"inputs": [given], "outputs": [out]}
    if parameters is not None:
        body["parameters"] = parameters
    return body


def affine(x) -> list:
    return (np.asarray(x, np.float32) * 2 + 1).ravel().tolist()  # tests/helpers.py:affine


@pytest.mark.parametrize("level", ["request", "input", "output"])
def test_unknown_keys_at_each_level_are_ignored_and_the_infer_answered(served, level):
    name, url = served
    status, got = infer(url, name, request(**{f"{level}_parameters" if level != "request"
                                              else "parameters": OPEN}))
    assert status == 200, got
    (out,) = got["outputs"]
    assert (out["name"], out["shape"], out["data"]) == ("OUTPUT", [2, 4], affine(X))


def test_known_keys_beside_unknown_ones_still_take_effect(served):
    name, url = served
    status, got = infer(url, name, request(parameters={**OPEN, "timeout": 10_000_000},
                                           output_parameters={**OPEN, "binary_data": False}))
    assert status == 200 and got["outputs"][0]["data"] == affine(X)


@pytest.mark.parametrize("level, parameters, says", [
    ("parameters", {"content_type": "np", "timeout": -1}, "timeout: expected microseconds >= 0"),
    ("parameters", {"content_type": "np", "priority": "high"}, "priority: expected 0"),
    ("parameters", {"binary_data_output": "yes"}, "binary_data_output: expected true or false"),
    ("output_parameters", {"content_type": "np", "binary_data": 1},
     "output 'OUTPUT': binary_data: expected true or false, got 1"),
    ("input_parameters", ["content_type"], "input 'INPUT' parameters: expected a JSON object"),
])
def test_a_known_key_with_a_bad_value_is_still_a_400_naming_it(served, level, parameters, says):
    name, url = served
    status, got = infer(url, name, request(**{level: parameters}))
    assert status == 400 and says in got["error"], got


def test_kserves_rest_client_with_content_type_parameters_is_answered(served):
    kserve = pytest.importorskip("kserve")
    from kserve.protocol.infer_type import RequestedOutput
    name, url = served
    xs = np.asarray(X, np.float32)
    given = kserve.InferInput("INPUT", [2, 4], "FP32", parameters={"content_type": "np"})
    given.set_data_from_numpy(xs, binary_data=False)
    outputs = [RequestedOutput("OUTPUT", parameters={"content_type": "np"})]
    asked = kserve.InferRequest(name, [given], parameters={"content_type": "np"},
                                request_outputs=outputs)

    async def main():
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", timeout=30))
        try:
            return await client.infer(f"http://{url}", asked, model_name=name)
        finally:
            await client.close()
    got = asyncio.run(main())
    (out,) = got.outputs
    assert (out.name, out.shape) == ("OUTPUT", [2, 4])
    np.testing.assert_array_equal(out.as_numpy(), xs * 2 + 1)
