"""The gRPC front through grpcio directly: typed contents beside raw ones, and each
refusal as its status code, saying what was expected and what came (the HTTP front's
texts): a bad datatype, a wrong shape, an oversize message (unary or streamed, the limit
named: what the largest engine can take), a deadline past, a full queue (with when to try
again), an unknown model, an RPC not served.

The messages are tritonclient's (the same proto), so that one process never holds two
builds of it in protobuf's pool."""
import threading

import numpy as np
import pytest

pytest.importorskip("uvicorn")
grpc = pytest.importorskip("grpc")
from conftest import import_proto_client  # noqa: E402
service_pb2 = import_proto_client("tritonclient.grpc.service_pb2")
from tritonclient.grpc import service_pb2_grpc  # noqa: E402
from grpc_served import AFFINE, GrpcServed, affine  # noqa: E402

from conftest import engine_word, requests_total, unique_name, wait_for  # noqa: E402

from engine.http.body import HEADER_BYTES  # noqa: E402
from engine.shm import codes  # noqa: E402

SLOW_MS = 1000.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    names = {tag: unique_name(tag) for tag in ("fast", "slow")}
    serve = GrpcServed(tmp_path_factory.mktemp("grpc-refusals"), [
        (names["fast"], dict(AFFINE, queue_capacity=64)),
        # one batch at a time, each SLOW_MS: a second request waits, a third finds it full
        (names["slow"], dict(backend="helpers:slow_affine", backend_args={"fixed_ms": SLOW_MS},
                             input_shape=[4], output_shape=[4], max_batch_size=1,
                             queue_capacity=2, admission="none")),
    ], http_workers=1)
    try:
        yield names, serve.grpc
    finally:
        assert serve.stop() == 0


@pytest.fixture(scope="module")
def stub(served):
    channel = grpc.insecure_channel(served[1])
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def infer_request(name: str, xs: np.ndarray, datatype: str = "FP32", raw: bool = True,
                  **params):
    r = service_pb2.ModelInferRequest(model_name=name)
    tensor = r.inputs.add(name="INPUT", datatype=datatype, shape=list(xs.shape))
    if raw:
        r.raw_input_contents.append(xs.tobytes())
    else:
        tensor.contents.fp32_contents.extend(xs.ravel().tolist())
    for key, value in params.items():
        r.parameters[key].int64_param = value
    return r


def refusal(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call(*args, **kwargs)
    return e.value


def answer(response) -> np.ndarray:
    (out,) = response.outputs
    assert (out.name, out.datatype) == ("OUTPUT", "FP32")
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(out.shape)


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "typed"])
def test_an_infer_answers_each_row_in_raw_output_contents(served, stub, raw):
    xs = np.arange(8, dtype=np.float32).reshape(2, 4) - 3.5
    got = stub.ModelInfer(infer_request(served[0]["fast"], xs, raw=raw), timeout=30)
    np.testing.assert_array_equal(answer(got), affine(xs))


def test_a_wrong_datatype_is_invalid_argument(served, stub):
    e = refusal(stub.ModelInfer, infer_request(served[0]["fast"], np.zeros((1, 4)), "FP64"),
                timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == "input 'INPUT': expected datatype FP32, got FP64"


def test_a_wrong_shape_is_invalid_argument(served, stub):
    e = refusal(stub.ModelInfer, infer_request(served[0]["fast"], np.zeros((1, 5), np.float32)),
                timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.details() == "input 'INPUT': expected shape [k, 4] (k >= 1 requests), got [1, 5]"


def test_raw_contents_that_do_not_fill_the_shape_are_invalid_argument(served, stub):
    r = infer_request(served[0]["fast"], np.zeros((2, 4), np.float32))
    r.raw_input_contents[0] = b"\0" * 12
    e = refusal(stub.ModelInfer, r, timeout=30)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expected 32 bytes (FP32[2, 4]), got 12" in e.details()


# what the largest engine here can take: "fast"'s 64 requests of 4 values, each value at
# most a varint's 10 bytes in typed contents, and the room for a message's header
LIMIT_BYTES = 64 * 4 * 10 + HEADER_BYTES


def test_a_message_over_what_the_engines_can_take_is_resource_exhausted_naming_the_limit(
        served, stub):
    r = infer_request(served[0]["fast"], np.zeros((1 << 16, 4), np.float32))  # 1 MiB
    e = refusal(stub.ModelInfer, r, timeout=30)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"larger than max ({r.ByteSize()} vs. {LIMIT_BYTES})" in e.details(), e.details()


def test_a_stream_message_over_the_limit_ends_the_stream_resource_exhausted(served, stub):
    r = infer_request(served[0]["fast"], np.zeros((1 << 16, 4), np.float32))
    e = refusal(lambda: list(stub.ModelStreamInfer(iter([r]), timeout=30)))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"larger than max ({r.ByteSize()} vs. {LIMIT_BYTES})" in e.details(), e.details()


def test_the_most_requests_an_engine_takes_fit_in_a_message_in_typed_contents(served, stub):
    xs = np.arange(64 * 4, dtype=np.float32).reshape(64, 4)  # queue_capacity requests
    got = stub.ModelInfer(infer_request(served[0]["fast"], xs, raw=False), timeout=30)
    np.testing.assert_array_equal(answer(got), affine(xs))


def test_an_unknown_model_is_not_found(stub):
    e = refusal(stub.ModelInfer, infer_request("no-such-model", np.zeros((1, 4), np.float32)),
                timeout=30)
    assert e.code() == grpc.StatusCode.NOT_FOUND
    assert "'no-such-model' is not found" in e.details()


def test_an_rpc_not_served_is_unimplemented(stub):
    e = refusal(stub.RepositoryIndex, service_pb2.RepositoryIndexRequest(), timeout=30)
    assert e.code() == grpc.StatusCode.UNIMPLEMENTED


def in_flight(stub, name: str, xs: np.ndarray):
    """A ModelInfer sent from a thread of its own: (thread, its outcome)."""
    outcome: dict = {}

    def call():
        try:
            outcome["answer"] = answer(stub.ModelInfer(infer_request(name, xs), timeout=60))
        except grpc.RpcError as e:
            outcome["error"] = e
    thread = threading.Thread(target=call)
    thread.start()
    return thread, outcome


def test_a_full_queue_is_resource_exhausted_with_when_to_try_again(served, stub):
    name = served[0]["slow"]
    before = requests_total(name)
    x0 = np.full((2, 4), 5, np.float32)  # both slots: one computing, one waiting
    thread, outcome = in_flight(stub, name, x0)
    try:
        wait_for(lambda: requests_total(name) >= before + 2, "two requests enqueued", 60)
        e = refusal(stub.ModelInfer, infer_request(name, np.ones((1, 4), np.float32)),
                    timeout=30)
    finally:
        thread.join(60)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert e.details().startswith("QueueFull: ")
    trailers = dict(e.trailing_metadata())
    assert int(trailers["retry-after"]) >= 1
    assert int(trailers["grpc-retry-pushback-ms"]) == 1000 * int(trailers["retry-after"])
    np.testing.assert_array_equal(outcome["answer"], affine(x0))


def test_a_timeout_parameter_past_before_its_batch_is_deadline_exceeded(served, stub):
    name = served[0]["slow"]
    before = requests_total(name)
    x0 = np.full((1, 4), 2, np.float32)
    thread, outcome = in_flight(stub, name, x0)  # holds the batcher for SLOW_MS
    try:
        wait_for(lambda: requests_total(name) >= before + 1, "the first request enqueued", 60)
        # 100 ms: it waits behind the first's batch of SLOW_MS
        e = refusal(stub.ModelInfer, infer_request(name, np.ones((1, 4), np.float32),
                                                   timeout=100_000), timeout=30)
    finally:
        thread.join(60)
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert e.details().startswith("RequestTimeout: ")
    np.testing.assert_array_equal(outcome["answer"], affine(x0))


def test_a_calls_own_deadline_is_its_requests_and_the_engine_never_computes_it(served, stub):
    name = served[0]["slow"]
    before = requests_total(name)
    ended = lambda: sum(engine_word(name, w) for w in (codes.W_EXPIRED, codes.W_TIMEOUTS,  # noqa: E731
                                                codes.W_WITHDRAWN))
    ended_before, answered_before = ended(), engine_word(name, codes.W_ANSWERED)
    x0 = np.full((1, 4), 3, np.float32)
    thread, outcome = in_flight(stub, name, x0)
    try:
        wait_for(lambda: requests_total(name) >= before + 1, "the first request enqueued", 60)
        e = refusal(stub.ModelInfer, infer_request(name, np.ones((1, 4), np.float32)),
                    timeout=0.2)  # grpc-timeout: 200 ms, behind a batch of SLOW_MS
    finally:
        thread.join(60)
    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    np.testing.assert_array_equal(outcome["answer"], affine(x0))
    wait_for(lambda: ended() == ended_before + 1, "the second request ended unanswered", 60)
    assert engine_word(name, codes.W_ANSWERED) == answered_before + 1  # the first alone
