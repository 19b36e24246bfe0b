"""Triton's own gRPC client (tritonclient.grpc, sync and aio) against `shmbatch serve
--grpc-port`: health, metadata, configuration, infers of several rows, and 64 callers at
once, every answer checked against its own request."""
import asyncio

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("grpc")
from conftest import import_proto_client  # noqa: E402
grpcclient = import_proto_client("tritonclient.grpc")
import tritonclient.grpc.aio as aioclient  # noqa: E402
from grpc_served import AFFINE, GrpcServed, affine  # noqa: E402

from conftest import unique_name  # noqa: E402

CALLERS = 64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    name = unique_name("grpc")
    serve = GrpcServed(tmp_path_factory.mktemp("grpc"), [(name, dict(AFFINE, queue_capacity=256))],
                       http_workers=1)
    try:
        yield name, serve.grpc
    finally:
        assert serve.stop() == 0


@pytest.fixture(scope="module")
def client(served):
    c = grpcclient.InferenceServerClient(served[1])
    yield c
    c.close()


def request(xs: np.ndarray, client_module=grpcclient):
    given = client_module.InferInput("INPUT", list(xs.shape), "FP32")
    given.set_data_from_numpy(xs)
    return [given]


def test_the_server_is_live_and_ready_and_so_is_its_model(served, client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(served[0])


def test_an_unknown_model_is_not_ready(client):
    assert client.is_model_ready("no-such-model") is False


def test_the_server_names_itself_and_the_extensions_it_serves(client):
    got = client.get_server_metadata(as_json=True)
    assert got["name"] == "shmbatch"
    assert set(got["extensions"]) == {"model_configuration", "statistics", "system_shared_memory"}


def test_the_models_metadata_shows_its_tensors_with_a_first_dim_of_requests(served, client):
    got = client.get_model_metadata(served[0], as_json=True)
    assert (got["name"], got["versions"], got["platform"]) == (served[0], ["1"], "shmbatch")
    assert [(t["name"], t["datatype"], t["shape"]) for t in got["inputs"]] == \
        [("INPUT", "FP32", ["-1", "4"])]
    assert [(t["name"], t["datatype"], t["shape"]) for t in got["outputs"]] == \
        [("OUTPUT", "FP32", ["-1", "4"])]


def test_the_models_configuration_is_tritons(served, client):
    got = client.get_model_config(served[0], as_json=True)["config"]
    assert (got["name"], got["max_batch_size"]) == (served[0], 8)
    assert [(t["name"], t["data_type"], t["dims"]) for t in got["input"]] == \
        [("INPUT", "TYPE_FP32", ["4"])]


def test_an_infer_of_several_rows_answers_each_row(served, client):
    xs = np.arange(12, dtype=np.float32).reshape(3, 4) / 4
    got = client.infer(served[0], request(xs), request_id="r-3", timeout=10_000_000,
                       client_timeout=30)
    np.testing.assert_array_equal(got.as_numpy("OUTPUT"), affine(xs))
    assert got.get_response().id == "r-3"


def test_the_statistics_count_the_requests_answered(served, client):
    before = client.get_inference_statistics(served[0], as_json=True)
    client.infer(served[0], request(np.ones((2, 4), np.float32)), client_timeout=30)
    after = client.get_inference_statistics(served[0], as_json=True)
    count = lambda s: int(s["model_stats"][0].get("inference_count", 0))  # noqa: E731
    assert count(after) - count(before) >= 2


def test_64_aio_callers_at_once_each_get_their_own_answer(served):
    name, address = served

    async def main():
        async with aioclient.InferenceServerClient(address) as c:
            xs = [np.full((1 + k % 3, 4), k, np.float32) + np.arange(4, dtype=np.float32)
                  for k in range(CALLERS)]
            answers = await asyncio.gather(*(c.infer(name, request(x, aioclient),
                                                     client_timeout=60) for x in xs))
            return xs, answers

    xs, answers = asyncio.run(main())
    for x, got in zip(xs, answers):
        np.testing.assert_array_equal(got.as_numpy("OUTPUT"), affine(x))


def test_the_aio_client_reads_health_and_metadata(served):
    name, address = served

    async def main():
        async with aioclient.InferenceServerClient(address) as c:
            return (await c.is_server_ready(), await c.is_model_ready(name),
                    await c.get_model_metadata(name, as_json=True))

    ready, model_ready, meta = asyncio.run(main())
    assert ready and model_ready and meta["name"] == name
