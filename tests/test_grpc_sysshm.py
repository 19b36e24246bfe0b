"""Triton's system shared-memory extension over gRPC (`serve --grpc-port`, 2 HTTP workers):
tritonclient.grpc's own calls and tritonclient's shared-memory utilities, unchanged, with
inputs and outputs in regions, each answer checked against its own request; one table of
regions with the HTTP routes'. The checks of a region's object and of each size are the HTTP
front's (tests/test_sysshm_refusals.py); a few are asked here through gRPC."""
import contextlib
import json
import re
import urllib.request

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("grpc")
from conftest import import_proto_client, unique_name  # noqa: E402
grpcclient = import_proto_client("tritonclient.grpc")
import tritonclient.utils.shared_memory as shm  # noqa: E402
from grpc_served import AFFINE, GrpcServed, affine  # noqa: E402
from test_sysshm import stop_resource_tracker  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

F32 = np.dtype(np.float32)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    names = {"single": unique_name("gshm-single"), "named": unique_name("gshm-named")}
    serve = GrpcServed(tmp_path_factory.mktemp("grpcshm"), [
        (names["single"], AFFINE),
        (names["named"], dict(backend="serve_backends:mixed",
                              inputs={"x": ["float32", [4]], "n": ["int64", [2]]},
                              outputs={"s": ["float32", []], "t": ["int64", [2]],
                                       "flag": ["bool", []]}))], http_workers=2)
    try:
        yield names, serve
    finally:
        assert serve.stop() == 0
        stop_resource_tracker()


@pytest.fixture(scope="module")
def client(served):
    c = grpcclient.InferenceServerClient(served[1].grpc)
    yield c
    c.close()


@contextlib.contextmanager
def region(client, name: str, byte_size: int, offset: int = 0):
    """A region made by tritonclient's utilities, registered over gRPC as `name`
    (its bytes from offset on); unregistered and destroyed after."""
    key = "/" + unique_name("gshm-key")
    handle = shm.create_shared_memory_region(name, key, byte_size)
    try:
        client.register_system_shared_memory(name, key, byte_size - offset, offset)
        try:
            yield key, handle
        finally:
            client.unregister_system_shared_memory(name)
    finally:
        shm.destroy_shared_memory_region(handle)


def test_the_server_says_it_serves_system_shared_memory(client):
    assert "system_shared_memory" in client.get_server_metadata(as_json=True)["extensions"]


def test_inputs_and_outputs_in_regions_answer_each_request(served, client):
    for k in range(3):  # each request its own values, read back from the output's region
        x = np.arange(2 * 4, dtype=np.float32).reshape(2, 4) * (k + 1) - 3.5
        with region(client, "in", 64 + x.nbytes, offset=64) as (_, ih), \
                region(client, "out", x.nbytes) as (_, oh):
            shm.set_shared_memory_region(ih, [x], offset=64)
            given = grpcclient.InferInput("INPUT", list(x.shape), "FP32")
            given.set_shared_memory("in", x.nbytes)
            asked = grpcclient.InferRequestedOutput("OUTPUT")
            asked.set_shared_memory("out", x.nbytes)
            result = client.infer(served[0]["single"], [given], outputs=[asked])
            assert np.array_equal(shm.get_contents_as_numpy(oh, F32, [2, 4]), affine(x))
            out = result.get_output("OUTPUT")
            assert out.parameters["shared_memory_region"].string_param == "out"
            assert out.parameters["shared_memory_byte_size"].int64_param == x.nbytes
            # its data is in the region: its buffer (found by position) is empty
            assert result.get_response().raw_output_contents == [b""]


def test_a_region_input_beside_a_raw_one_and_a_region_output_at_an_offset(served, client):
    x = np.array([[1, 2, 3, 4], [-5, -6, -7, 8]], np.float32)
    n = np.array([[1, 2], [30, 40]], np.int64)
    with region(client, "x", x.nbytes) as (_, xh), region(client, "t", 256) as (_, th):
        shm.set_shared_memory_region(xh, [x])
        ix = grpcclient.InferInput("x", [2, 4], "FP32")
        ix.set_shared_memory("x", x.nbytes)
        i_n = grpcclient.InferInput("n", [2, 2], "INT64")
        i_n.set_data_from_numpy(n)  # the one buffer of raw_input_contents
        ot = grpcclient.InferRequestedOutput("t")
        ot.set_shared_memory("t", 128, offset=96)  # room for more than it needs
        result = client.infer(served[0]["named"], [i_n, ix], outputs=[
            grpcclient.InferRequestedOutput("s"), ot, grpcclient.InferRequestedOutput("flag")])
        assert np.array_equal(shm.get_contents_as_numpy(th, np.int64, [2, 2], offset=96), n * 3)
        assert np.array_equal(result.as_numpy("s"), x.sum(axis=1))
        assert np.array_equal(result.as_numpy("flag"), x.sum(axis=1) > 0)


def test_status_lists_the_regions_in_tritons_shape_and_unregister_removes_them(client):
    with region(client, "a", 4096, offset=1024) as (key, _), region(client, "b", 512):
        every = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert every["a"] == {"name": "a", "key": key, "offset": "1024", "byte_size": "3072"}
        assert set(every) == {"a", "b"}
        one = client.get_system_shared_memory_status("b", as_json=True)["regions"]
        assert list(one) == ["b"]
        client.unregister_system_shared_memory()  # every region (then the contexts' own
        assert client.get_system_shared_memory_status(as_json=True) == {}  # are no error)


def test_a_region_registered_over_grpc_is_the_http_routes_own(served, client):
    with region(client, "shared", 256) as (key, _):
        http_at = re.search(r"(http://\S+) and gRPC", served[1].ready_line).group(1)
        with urllib.request.urlopen(f"{http_at}/v2/systemsharedmemory/status",
                                    timeout=30) as response:
            shown = json.loads(response.read())
        assert {"name": "shared", "key": key, "offset": 0, "byte_size": 256} in shown


def test_an_input_regions_byte_size_that_is_not_its_tensors_is_refused(served, client):
    with region(client, "short", 64):
        given = grpcclient.InferInput("INPUT", [1, 4], "FP32")
        given.set_shared_memory("short", 8)  # a [1, 4] FP32 tensor is 16 bytes
        with pytest.raises(InferenceServerException,
                           match=r"shared_memory_byte_size: expected 16 bytes .*got 8"):
            client.infer(served[0]["single"], [given])


def test_an_unregistered_region_is_refused_naming_it(served, client):
    given = grpcclient.InferInput("INPUT", [1, 4], "FP32")
    given.set_shared_memory("nowhere", 16)
    with pytest.raises(InferenceServerException, match="nowhere"):
        client.infer(served[0]["single"], [given])
