"""ModelStreamInfer (Triton's bidirectional stream) through tritonclient.grpc's
start_stream/async_stream_infer and its aio stream_infer, on an iterative engine: each
chunk its own response as it comes, the last one marked when asked, max_steps as a
request parameter, a refusal as the stream's error while the stream goes on, and a
stream the caller cancels withdraws its request."""
import asyncio
import functools
import queue
import time

import numpy as np
import pytest

pytest.importorskip("uvicorn")
from conftest import import_proto_client  # noqa: E402
grpcclient = import_proto_client("tritonclient.grpc")
import tritonclient.grpc.aio as aioclient  # noqa: E402
from grpc_served import AFFINE, STEPS, GrpcServed, affine  # noqa: E402

from conftest import engine_word, unique_name, wait_for  # noqa: E402

from engine.shm import codes  # noqa: E402

WAIT_S = 60.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    names = {tag: unique_name(tag) for tag in ("count", "endless", "affine")}
    serve = GrpcServed(tmp_path_factory.mktemp("grpc-streams"), [
        (names["count"], dict(backend="serve_backends:counting", iterative=True, max_steps=64,
                              **STEPS)),
        # one slot, 10 ms a step, 65536 steps: held for minutes unless withdrawn
        (names["endless"], dict(backend="serve_backends:counting",
                                backend_args={"step_ms": 10.0}, iterative=True,
                                max_steps=65536, queue_capacity=1, max_batch_size=1, **STEPS)),
        (names["affine"], AFFINE),
    ], http_workers=1)
    try:
        yield names, serve.grpc
    finally:
        assert serve.stop() == 0


def count_input(start: int, steps: int, module=grpcclient):
    given = module.InferInput("INPUT", [1, 2], "INT64")
    given.set_data_from_numpy(np.array([[start, steps]], np.int64))
    return [given]


class Collected:
    """A stream's callback: each (result, error) put on a queue, taken with a bound."""

    def __init__(self) -> None:
        self.got: queue.Queue = queue.Queue()

    def callback(self, result, error) -> None:
        self.got.put((result, error))

    def take(self):
        return self.got.get(timeout=WAIT_S)

    def until_final(self) -> list:
        """The results up to the one marked final (errors fail the test)."""
        out = []
        while True:
            result, error = self.take()
            assert error is None, error
            out.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out


@pytest.fixture
def stream(served):
    client = grpcclient.InferenceServerClient(served[1])
    got = Collected()
    client.start_stream(callback=functools.partial(Collected.callback, got), stream_timeout=120)
    yield client, got
    client.stop_stream(cancel_requests=True)
    client.close()


def chunks(results) -> list:
    """Each result's OUTPUT, which holds one chunk: shape [1]."""
    values = []
    for r in results:
        out = r.as_numpy("OUTPUT")
        assert out.shape == (1,), out.shape
        values.append(int(out[0]))
    return values


def test_each_chunk_is_a_response_and_the_last_says_it_is_final(served, stream):
    client, got = stream
    client.async_stream_infer(served[0]["count"], count_input(7, 4), request_id="a",
                              enable_empty_final_response=True)
    results = got.until_final()
    assert chunks(results[:-1]) == [7, 8, 9, 10]
    assert [r.get_response().id for r in results] == ["a"] * 5
    final = results[-1].get_response()
    assert list(final.outputs) == [] and final.parameters["finish_reason"].string_param == "stop"


def test_each_requests_timeout_counts_from_its_own_arrival_not_the_streams(served, stream):
    client, got = stream
    timeout_us = 1_000_000
    opened = time.monotonic()
    client.async_stream_infer(served[0]["count"], count_input(1, 2), request_id="early",
                              timeout=timeout_us, enable_empty_final_response=True)
    assert chunks(got.until_final()[:-1]) == [1, 2]
    # the condition is the clock itself: the stream outlives a request's timeout
    time.sleep(max(0.0, opened + 1.5 * timeout_us / 1e6 - time.monotonic()))
    client.async_stream_infer(served[0]["count"], count_input(5, 3), request_id="late",
                              timeout=timeout_us, enable_empty_final_response=True)
    results = got.until_final()
    assert chunks(results[:-1]) == [5, 6, 7]
    assert [r.get_response().id for r in results] == ["late"] * 4


def test_max_steps_is_a_request_parameter_and_ends_it_as_length(served, stream):
    client, got = stream
    client.async_stream_infer(served[0]["count"], count_input(3, 50), parameters={"max_steps": 2},
                              enable_empty_final_response=True)
    results = got.until_final()
    assert chunks(results[:-1]) == [3, 4]
    assert results[-1].get_response().parameters["finish_reason"].string_param == "length"


def test_requests_in_one_stream_run_beside_each_other_each_answered_by_its_id(served, stream):
    client, got = stream
    starts = {f"r{k}": 100 * k for k in range(4)}
    for rid, start in starts.items():
        client.async_stream_infer(served[0]["count"], count_input(start, 3), request_id=rid)
    seen: dict = {rid: [] for rid in starts}
    for _ in range(3 * len(starts)):
        result, error = got.take()
        assert error is None, error
        seen[result.get_response().id] += chunks([result])
    assert seen == {rid: [s, s + 1, s + 2] for rid, s in starts.items()}


def test_a_refused_request_is_the_streams_error_and_the_stream_goes_on(served, stream):
    client, got = stream
    bad = grpcclient.InferInput("INPUT", [1, 3], "INT64")
    bad.set_data_from_numpy(np.zeros((1, 3), np.int64))
    client.async_stream_infer(served[0]["count"], [bad])
    result, error = got.take()
    assert result is None and "expected shape [k, 2]" in str(error)
    client.async_stream_infer(served[0]["count"], count_input(1, 2),
                              enable_empty_final_response=True)
    assert chunks(got.until_final()[:-1]) == [1, 2]


def test_an_input_in_a_shared_memory_region_is_the_streams_error(served, stream):
    client, got = stream
    given = grpcclient.InferInput("INPUT", [1, 2], "INT64")
    given.set_shared_memory("anywhere", 16)  # refused before any region is looked up
    client.async_stream_infer(served[0]["count"], [given])
    result, error = got.take()
    assert result is None and "ModelInfer reads and writes them" in str(error)


def test_a_one_shot_engine_answers_a_stream_request_with_one_response(served, stream):
    client, got = stream
    x = np.arange(4, dtype=np.float32)[None]
    given = grpcclient.InferInput("INPUT", [1, 4], "FP32")
    given.set_data_from_numpy(x)
    client.async_stream_infer(served[0]["affine"], [given], enable_empty_final_response=True)
    results = got.until_final()
    assert len(results) == 2
    np.testing.assert_array_equal(results[0].as_numpy("OUTPUT"), affine(x))


def test_the_aio_stream_answers_each_request_chunk_by_chunk(served):
    name, address = served[0]["count"], served[1]

    async def main():
        async def sent():
            for start in (10, 20):
                yield {"model_name": name, "inputs": count_input(start, 3, aioclient),
                       "request_id": str(start)}
        async with aioclient.InferenceServerClient(address) as c:
            seen: dict = {"10": [], "20": []}
            async for result, error in c.stream_infer(sent(), stream_timeout=WAIT_S):
                assert error is None, error
                seen[result.get_response().id] += chunks([result])
            return seen

    assert asyncio.run(asyncio.wait_for(main(), WAIT_S)) == {"10": [10, 11, 12],
                                                             "20": [20, 21, 22]}


def test_a_stream_the_caller_cancels_withdraws_its_request(served):
    name, address = served[0]["endless"], served[1]
    before = engine_word(name, codes.W_WITHDRAWN)
    client = grpcclient.InferenceServerClient(address)
    got = Collected()
    try:
        client.start_stream(callback=functools.partial(Collected.callback, got))
        client.async_stream_infer(name, count_input(0, 0), timeout=600_000_000)
        result, error = got.take()  # running: its first chunk came
        assert error is None and chunks([result]) == [0]
        client.stop_stream(cancel_requests=True)
        wait_for(lambda: engine_word(name, codes.W_WITHDRAWN) == before + 1,
                 "the request withdrawn", WAIT_S)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
