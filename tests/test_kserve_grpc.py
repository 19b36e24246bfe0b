"""KServe's own gRPC client (`kserve.InferenceGRPCClient`, the Open Inference Protocol's
`inference.GRPCInferenceService`) against `shmbatch serve --grpc-port`: live, ready, an
unknown model not ready, and infers of several rows, each answer checked against its own
request, 32 callers at once.

kserve is not in the test extra (see tests/test_kserve_client.py: its protobuf and psutil
pins cannot share one environment with ray[serve]'s); these run where it is installed."""
import asyncio

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("grpc")
from conftest import import_proto_client  # noqa: E402
kserve = import_proto_client("kserve")
from grpc_served import AFFINE, GrpcServed, affine  # noqa: E402

from conftest import unique_name  # noqa: E402

CALLERS = 32


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    name = unique_name("kserve-grpc")
    serve = GrpcServed(tmp_path_factory.mktemp("kserve-grpc"),
                       [(name, dict(AFFINE, queue_capacity=256))], http_workers=1)
    try:
        yield name, serve.grpc
    finally:
        assert serve.stop() == 0


def run(address: str, coroutine_of):
    async def main():
        client = kserve.InferenceGRPCClient(address, timeout=30, retries=0)
        try:
            return await coroutine_of(client)
        finally:
            await client.close()
    return asyncio.run(main())


def request(name: str, xs: np.ndarray):
    given = kserve.InferInput("INPUT", list(xs.shape), "FP32")
    given.set_data_from_numpy(xs)
    return kserve.InferRequest(name, [given])


def test_the_server_is_live_and_ready_and_so_is_its_model(served):
    name, address = served
    assert run(address, lambda c: c.is_server_live()) is True
    assert run(address, lambda c: c.is_server_ready()) is True
    assert run(address, lambda c: c.is_model_ready(name)) is True


def test_an_unknown_model_is_not_ready(served):
    assert run(served[1], lambda c: c.is_model_ready("no-such-model")) is False


def test_an_infer_of_several_rows_answers_each_row(served):
    name, address = served
    xs = np.arange(12, dtype=np.float32).reshape(3, 4)
    answer = run(address, lambda c: c.infer(request(name, xs)))
    assert np.array_equal(answer.outputs[0].as_numpy(), affine(xs))


def test_many_callers_at_once_each_get_their_own_answer(served):
    name, address = served
    xs = [np.full((1, 4), float(k), np.float32) for k in range(CALLERS)]

    async def all_of(client):
        return await asyncio.gather(*(client.infer(request(name, x)) for x in xs))
    answers = run(address, all_of)
    for x, answer in zip(xs, answers):
        assert np.array_equal(answer.outputs[0].as_numpy(), affine(x))
