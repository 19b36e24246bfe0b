"""KServe's own Python client (`kserve.InferenceRESTClient`, protocol v2) against
`shmbatch serve --http-port`: live, ready, the model's metadata (in KServe's own
data model: its REST client has no call for it), and infers in JSON and in
binary tensor data, each answer checked against its own request.

kserve is not in the test extra: kserve 0.21 declares protobuf < 7 and psutil < 6, and
ray[serve]'s grpcio-reflection needs protobuf >= 7.35, so pip cannot resolve both into
one environment; these tests run where kserve is installed (`pip install kserve`)."""
import asyncio

import numpy as np
import pytest

pytest.importorskip("uvicorn")
from conftest import import_proto_client  # noqa: E402
kserve = import_proto_client("kserve")
import httpx  # noqa: E402  (kserve's client is built on it)
from kserve.protocol.rest.v2_datamodels import ModelMetadataResponse  # noqa: E402

from conftest import unique_name  # noqa: E402
from test_multi_engine import Served, table, top  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    name = unique_name("kserve")
    serve = Served(tmp_path_factory.mktemp("kserve"),
                   top() + table(name, backend="helpers:affine", input_shape=[4],
                                 output_shape=[4], max_batch_size=8),
                   "--http-port", "0")
    try:
        yield name, f"http://{serve.url}"
    finally:
        assert serve.stop() == 0


def run(coroutine_of):
    async def main():
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", timeout=30))
        try:
            return await coroutine_of(client)
        finally:
            await client.close()
    return asyncio.run(main())


def affine(x: np.ndarray) -> np.ndarray:
    return x * 2 + 1  # tests/helpers.py:affine


def request(name: str, xs: np.ndarray, binary: bool):
    given = kserve.InferInput("INPUT", list(xs.shape), "FP32")
    given.set_data_from_numpy(xs, binary_data=binary)
    # binary: the answer's tensors come as binary data too
    return kserve.InferRequest(name, [given], parameters={"binary_data_output": binary})


def test_the_server_is_live_and_ready_and_so_is_its_model(served):
    name, url = served
    assert run(lambda c: c.is_server_live(url)) is True
    assert run(lambda c: c.is_server_ready(url)) is True
    assert run(lambda c: c.is_model_ready(url, name)) is True


def test_an_unknown_model_is_not_ready(served):
    _, url = served
    assert run(lambda c: c.is_model_ready(url, "no-such-model")) is False


def test_the_models_metadata_is_kserves_data_model(served):
    name, url = served
    got = ModelMetadataResponse.model_validate(
        httpx.get(f"{url}/v2/models/{name}", timeout=30).json())
    assert got.name == name
    assert [(t.name, t.datatype, t.shape) for t in got.inputs] == [("INPUT", "FP32", [-1, 4])]
    assert [(t.name, t.datatype, t.shape) for t in got.outputs] == [("OUTPUT", "FP32", [-1, 4])]


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_an_infer_of_several_rows_answers_each_row(served, binary):
    name, url = served
    xs = np.arange(12, dtype=np.float32).reshape(3, 4) / 4
    headers: dict = {}
    got = run(lambda c: c.infer(url, request(name, xs, binary), model_name=name,
                                response_headers=headers))
    assert ("inference-header-content-length" in headers) == binary, headers
    (out,) = got.outputs
    assert (out.name, out.datatype, out.shape) == ("OUTPUT", "FP32", [3, 4])
    np.testing.assert_array_equal(out.as_numpy(), affine(xs))


def test_concurrent_infers_each_get_their_own_answer(served):
    name, url = served

    async def many(client):
        xs = [np.full((1, 4), k, np.float32) for k in range(16)]
        answers = await asyncio.gather(*(client.infer(url, request(name, x, k % 2 == 0),
                                                      model_name=name)
                                         for k, x in enumerate(xs)))
        return xs, answers

    xs, answers = run(many)
    for x, got in zip(xs, answers):
        np.testing.assert_array_equal(got.outputs[0].as_numpy(), affine(x))


def test_a_wrong_shape_is_a_400_that_says_what_was_expected(served):
    name, url = served
    xs = np.zeros((1, 5), np.float32)
    with pytest.raises(httpx.HTTPStatusError) as e:
        run(lambda c: c.infer(url, request(name, xs, False), model_name=name))
    assert e.value.response.status_code == 400
    assert "expected shape" in e.value.response.text
