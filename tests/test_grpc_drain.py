"""serve's drain and supervision hold for gRPC: on SIGTERM every call in flight (ModelInfer
and an iterative engine's ModelStreamInfer, held in their backends by a Gate) is answered
in full, a call made once the drain began is refused UNAVAILABLE, serve exits 0 and leaves
nothing in /dev/shm; an HTTP worker SIGKILLed under gRPC calls fails them UNAVAILABLE (not
at their deadline), and its replacement serves gRPC again on the same port."""
import functools
import signal

import numpy as np
import psutil
import pytest

pytest.importorskip("uvicorn")
grpc = pytest.importorskip("grpc")
from conftest import import_proto_client  # noqa: E402
grpcclient = import_proto_client("tritonclient.grpc")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from grpc_served import GrpcServed  # noqa: E402
from iterative_helpers import SPEC, bits, wait_held  # noqa: E402
from step_models import HOLD, chunks, request  # noqa: E402
from test_grpc_refusals import answer, infer_request  # noqa: E402
from test_grpc_streams import Collected  # noqa: E402
from test_grpc_streams import chunks as streamed  # noqa: E402

from conftest import Gate, requests_total, shm_entries, unique_name, wait_for  # noqa: E402

WAIT_S = 60.0
CALLS = 3  # ModelInfers held in flight
BIAS = 0.5  # reload_backends:held answers x + BIAS
HELD = dict(backend="reload_backends:held", backend_args={"bias": BIAS}, input_shape=[4],
            output_shape=[4], max_batch_size=8)


@pytest.fixture
def gate():
    g = Gate()
    yield g
    for _ in range(2 * CALLS):  # whatever the test left held goes on (and ends)
        g.open()
    g.close()


def serve(tmp_path, gate, log=None, **engines):
    """serve with one HTTP worker (its gRPC server) over the engines given
    ({tag: keys}); each gets the gate as a backend arg."""
    names = {tag: unique_name(tag) for tag in engines}
    tables = []
    for tag, keys in engines.items():
        args = {"gate": gate.name, **({"log": log} if tag == "steps" else {})}
        tables.append((names[tag], dict(keys, backend_args={**keys.get("backend_args", {}),
                                                            **args})))
    return names, GrpcServed(tmp_path, tables, http_workers=1)


def held_calls(stub, name: str):
    """CALLS ModelInfers of negative rows (held until the gate opens), each a
    future with its request."""
    xs = [np.full((1, 4), -1.0 - k, np.float32) for k in range(CALLS)]
    return [(stub.ModelInfer.future(infer_request(name, x), timeout=WAIT_S), x) for x in xs]


def nothing_left(served, names) -> None:
    assert served.proc.wait(WAIT_S) == 0, served.stderr()
    assert not [e for e in shm_entries() if any(n in e for n in names.values())]


def test_sigterm_answers_every_grpc_call_in_flight_and_refuses_new_ones(tmp_path, gate, log):
    names, served = serve(tmp_path, gate, log, held=HELD,
                          steps=dict(SPEC, max_steps=32))
    channel = grpc.insecure_channel(served.grpc)
    stream_client = grpcclient.InferenceServerClient(served.grpc)
    got = Collected()
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stream_client.start_stream(callback=functools.partial(Collected.callback, got))
        given = grpcclient.InferInput("INPUT", [1, 4], "INT64")
        given.set_data_from_numpy(request(7, 4, HOLD, bits(2))[None])
        stream_client.async_stream_infer(names["steps"], [given], request_id="s",
                                         enable_empty_final_response=True)
        first = [got.take(), got.take()]
        assert [e for _, e in first] == [None, None]
        wait_held(log, 7, 2)  # the stream is in flight, held before its third chunk
        before = requests_total(names["held"])
        calls = held_calls(stub, names["held"])
        wait_for(lambda: requests_total(names["held"]) == before + CALLS, "the infers held", WAIT_S)

        served.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "draining: new connections are refused" in served.stderr(),
                 "the worker draining", WAIT_S, every_s=0.05)
        late = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(served.grpc))
        wait_for(lambda: refused(late), "a new call refused", WAIT_S, every_s=0.05)
        with pytest.raises(grpc.RpcError) as e:
            late.ModelInfer(infer_request(names["held"], np.ones((1, 4), np.float32)),
                            timeout=WAIT_S)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value

        for _ in range(2 * CALLS):
            gate.open()
        for future, x in calls:
            np.testing.assert_array_equal(answer(future.result(WAIT_S)), x + BIAS)
        rest = got.until_final()
        assert streamed([r for r, _ in first] + rest[:-1]) == chunks(7, 4)
        assert {r.get_response().id for r in rest} == {"s"}
        assert rest[-1].get_response().parameters["finish_reason"].string_param == "stop"
        stream_client.stop_stream()  # the caller's half ends: so does the call
        nothing_left(served, names)
    finally:
        stream_client.close()
        channel.close()
        served.stop()


def refused(stub) -> bool:
    """Whether ServerLive is refused UNAVAILABLE (answered: not yet draining;
    any other refusal fails the test)."""
    try:
        stub.ServerLive(service_pb2.ServerLiveRequest(), timeout=WAIT_S)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return True
    return False


def worker(served) -> psutil.Process:
    (proc,) = [p for p in psutil.Process(served.proc.pid).children()
               if "engine.http.worker" in " ".join(p.cmdline())]
    return proc


def test_a_killed_worker_fails_its_grpc_calls_unavailable_and_its_successor_serves(tmp_path,
                                                                                    gate):
    names, served = serve(tmp_path, gate, held=HELD)
    channel = grpc.insecure_channel(served.grpc)
    try:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        before = requests_total(names["held"])
        calls = held_calls(stub, names["held"])
        wait_for(lambda: requests_total(names["held"]) == before + CALLS, "the infers held", WAIT_S)
        killed = worker(served)
        killed.kill()
        for future, _ in calls:  # each ends at once, well before its deadline
            assert future.exception(WAIT_S).code() == grpc.StatusCode.UNAVAILABLE
        for _ in range(2 * CALLS):
            gate.open()  # the held batch ends; its callers are gone
        wait_for(lambda: "started again" in served.stderr(), "the worker replaced", WAIT_S,
                 every_s=0.05)
        assert worker(served).pid != killed.pid
        x = np.arange(4, dtype=np.float32)[None]
        got = stub.ModelInfer(infer_request(names["held"], x), timeout=WAIT_S,
                              wait_for_ready=True)  # the same channel, the same port
        np.testing.assert_array_equal(answer(got), x + BIAS)
        served.proc.send_signal(signal.SIGTERM)
        nothing_left(served, names)
    finally:
        channel.close()
        served.stop()
