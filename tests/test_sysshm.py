"""Triton's system shared-memory extension on `shmbatch serve --http-port` (2 HTTP workers):
tritonclient's own shared-memory utilities and clients (sync and asyncio), unchanged, with
inputs and outputs in regions, each answer checked against its own request; status in
Triton's shape; a region registered through one worker used through the other. The faults
are tests/test_sysshm_refusals.py's."""
import asyncio
import contextlib
import http.client
import json
import os
import pathlib

import numpy as np
import psutil
import pytest

pytest.importorskip("uvicorn")
triton = pytest.importorskip("tritonclient.http")
import tritonclient.http.aio as triton_aio  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402
from conftest import shm_entries, unique_name  # noqa: E402
from test_multi_engine import AFFINE, Served, table, top  # noqa: E402

F32 = np.dtype(np.float32)
BIG = 1 << 16


class Server:
    """One serve, 2 HTTP workers: `single` y = 2x + 1 on float32[16], `named` the
    mixed engine (x float32[4], n int64[2] -> s float32, t int64[2], flag bool),
    `big` y = 2x + 1 on float32[65536] (256 KiB a request)."""

    def __init__(self, folder):
        self.names = {tag: unique_name(f"sysshm-{tag}") for tag in ("single", "named", "big")}
        self.serve = Served(
            folder, top(http_workers=2)
            + table(self.names["single"], **AFFINE, max_batch_size=8)
            + table(self.names["named"], backend="serve_backends:mixed",
                    inputs={"x": ["float32", [4]], "n": ["int64", [2]]},
                    outputs={"s": ["float32", []], "t": ["int64", [2]], "flag": ["bool", []]})
            + table(self.names["big"], backend="helpers:affine", input_shape=[BIG],
                    output_shape=[BIG], queue_capacity=8, max_batch_size=8),
            "--http-port", "0")
        self.url = self.serve.url
        self.host, self.port = self.url.rsplit(":", 1)

    def workers(self):
        return [p for p in psutil.Process(self.serve.proc.pid).children()
                if "engine.http.worker" in " ".join(p.cmdline())]

    def connection_on(self, pid: int, tries: int = 64) -> http.client.HTTPConnection:
        """A keep-alive connection that worker `pid` accepted (the kernel
        hands each to one worker: up to `tries` are opened to find one)."""
        opened = []
        try:
            for _ in range(tries):
                conn = http.client.HTTPConnection(self.host, int(self.port), timeout=30)
                conn.request("GET", "/v2/health/live")
                conn.getresponse().read()
                opened.append(conn)
                if worker_of(conn, self.workers()) == pid:
                    opened.remove(conn)
                    return conn
            raise AssertionError(f"no connection of {tries} reached worker {pid}")
        finally:
            for conn in opened:
                conn.close()

    def close(self):
        assert self.serve.stop() == 0, self.serve.stderr()
        assert "Traceback" not in self.serve.stderr(), self.serve.stderr()


def worker_of(conn: http.client.HTTPConnection, workers) -> int:
    """The pid of the worker that holds conn's other end."""
    port = conn.sock.getsockname()[1]
    for proc in workers:
        if any(c.raddr and c.raddr.port == port for c in proc.net_connections("tcp")):
            return proc.pid
    raise AssertionError(f"no worker holds the connection from port {port}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("sysshm"))
    yield s
    s.close()
    stop_resource_tracker()
    assert not [e for e in shm_entries() if any(n in e for n in s.names.values())]
    assert not regions_left(), "a test left a region's object in /dev/shm"


def stop_resource_tracker():
    """tritonclient's utilities make regions with multiprocessing.shared_memory,
    which starts the stdlib's resource tracker, a helper process that lives
    until the interpreter exits; stopped here (the stdlib's own way, as its
    tests do) so that the suite's check for orphan processes holds."""
    from multiprocessing import resource_tracker
    resource_tracker._resource_tracker._stop()


def regions_left():
    return sorted(p.name for p in pathlib.Path("/dev/shm").glob(f"t{os.getpid()}-sysshm-*"))


@contextlib.contextmanager
def region(byte_size: int, register_as=None, client=None, offset: int = 0):
    """A region made by tritonclient's utilities (a unique key), registered
    when register_as names it; unregistered and destroyed after."""
    key = "/" + unique_name("sysshm-key")
    handle = shm.create_shared_memory_region(register_as or key[1:], key, byte_size)
    try:
        if register_as is not None:
            client.register_system_shared_memory(register_as, key, byte_size - offset, offset)
        yield key, handle
    finally:
        try:
            if register_as is not None:
                client.unregister_system_shared_memory(register_as)
        finally:
            shm.destroy_shared_memory_region(handle)


def request(conn: http.client.HTTPConnection, method: str, path: str, body=None):
    """(status, the answer's JSON or None) over one connection."""
    data = None if body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"content-type": "application/json"})
    response = conn.getresponse()
    raw = response.read()
    return response.status, (json.loads(raw) if raw else None)


def test_inputs_and_outputs_in_regions_answer_each_request_through_tritonclient(server):
    x = np.arange(3 * 16, dtype=np.float32).reshape(3, 16) - 7.5
    c = triton.InferenceServerClient(server.url)
    name = server.names["single"]
    # the input at an offset inside its region, the output region exactly its size
    with region(64 + x.nbytes, "in", c, offset=64) as (_, ih), \
            region(x.nbytes, "out", c) as (_, oh):
        shm.set_shared_memory_region(ih, [x], offset=64)
        i = triton.InferInput("INPUT", list(x.shape), "FP32")
        i.set_shared_memory("in", x.nbytes)
        o = triton.InferRequestedOutput("OUTPUT", binary_data=True)
        o.set_shared_memory("out", x.nbytes)
        result = c.infer(name, [i], outputs=[o])
        got = shm.get_contents_as_numpy(oh, F32, [3, 16])
        assert np.array_equal(got, x * 2 + 1)
        answer = result.get_output("OUTPUT")
        assert answer["parameters"] == {"shared_memory_region": "out",
                                        "shared_memory_byte_size": x.nbytes}
        assert "data" not in answer
    c.close()


def test_named_tensors_mix_regions_with_body_data_each_answer_its_own(server):
    x = np.array([[1, 2, 3, 4], [-5, -6, -7, 8]], np.float32)
    n = np.array([[1, 2], [30, 40]], np.int64)
    c = triton.InferenceServerClient(server.url)
    with region(x.nbytes, "x", c) as (_, xh), region(256, "t", c) as (_, th):
        shm.set_shared_memory_region(xh, [x])
        ix = triton.InferInput("x", [2, 4], "FP32")
        ix.set_shared_memory("x", x.nbytes)
        i_n = triton.InferInput("n", [2, 2], "INT64")
        i_n.set_data_from_numpy(n, binary_data=True)
        ot = triton.InferRequestedOutput("t")
        ot.set_shared_memory("t", 128, offset=96)  # room for more than it needs
        result = c.infer(server.names["named"], [ix, i_n],
                         outputs=[triton.InferRequestedOutput("s", binary_data=False), ot,
                                  triton.InferRequestedOutput("flag")])
        assert np.array_equal(shm.get_contents_as_numpy(th, np.int64, [2, 2], offset=96), n * 3)
        assert result.get_output("t")["parameters"] == {
            "shared_memory_region": "t", "shared_memory_byte_size": n.nbytes,
            "shared_memory_offset": 96}
        assert np.array_equal(result.as_numpy("s"), x.sum(axis=1))
        assert np.array_equal(result.as_numpy("flag"), x.sum(axis=1) > 0)
    c.close()


def test_regions_past_a_mebibyte_are_copied_off_the_loop_and_answer_the_same(server):
    x = np.random.default_rng(7).standard_normal((5, BIG)).astype(np.float32)  # 1.25 MiB
    c = triton.InferenceServerClient(server.url)
    with region(x.nbytes, "big-in", c) as (_, ih), region(x.nbytes, "big-out", c) as (_, oh):
        shm.set_shared_memory_region(ih, [x])
        i = triton.InferInput("INPUT", list(x.shape), "FP32")
        i.set_shared_memory("big-in", x.nbytes)
        o = triton.InferRequestedOutput("OUTPUT")
        o.set_shared_memory("big-out", x.nbytes)
        c.infer(server.names["big"], [i], outputs=[o])
        assert np.array_equal(shm.get_contents_as_numpy(oh, F32, list(x.shape)), x * 2 + 1)
    c.close()


def test_the_asyncio_client_registers_infers_and_unregisters(server):
    x = np.linspace(-1, 1, 16, dtype=np.float32)[None]

    async def run(key, ih, oh):
        c = triton_aio.InferenceServerClient(server.url)
        try:
            await c.register_system_shared_memory("aio", key, 2 * x.nbytes)
            shm.set_shared_memory_region(ih, [x])
            i = triton_aio.InferInput("INPUT", [1, 16], "FP32")
            i.set_shared_memory("aio", x.nbytes)
            o = triton_aio.InferRequestedOutput("OUTPUT")
            o.set_shared_memory("aio", x.nbytes, offset=x.nbytes)  # the same region, after
            await c.infer(server.names["single"], [i], outputs=[o])
            status = await c.get_system_shared_memory_status("aio")
            await c.unregister_system_shared_memory("aio")
            return status, await c.get_system_shared_memory_status()
        finally:
            await c.close()

    key = "/" + unique_name("sysshm-key")
    handle = shm.create_shared_memory_region("aio", key, 2 * x.nbytes)
    try:
        status, after = asyncio.run(run(key, handle, handle))
        got = shm.get_contents_as_numpy(handle, F32, [1, 16], offset=x.nbytes).copy()
    finally:
        shm.destroy_shared_memory_region(handle)
    assert np.array_equal(got, x * 2 + 1)
    assert status == [{"name": "aio", "key": key, "offset": 0, "byte_size": 2 * x.nbytes}]
    assert after == []


def test_status_is_tritons_list_and_unregister_without_a_name_removes_every_region(server):
    c = triton.InferenceServerClient(server.url)
    with region(100) as (k1, h1), region(200) as (k2, h2):
        c.register_system_shared_memory("a", k1, 100)
        c.register_system_shared_memory("b", k2, 150, offset=50)
        try:
            every = c.get_system_shared_memory_status()
            one = c.get_system_shared_memory_status("b")
        finally:
            c.unregister_system_shared_memory()
        after = c.get_system_shared_memory_status()
    c.close()
    assert sorted(every, key=lambda r: r["name"]) == [
        {"name": "a", "key": k1, "offset": 0, "byte_size": 100},
        {"name": "b", "key": k2, "offset": 50, "byte_size": 150}]
    assert one == [{"name": "b", "key": k2, "offset": 50, "byte_size": 150}]
    assert after == []


def test_server_metadata_names_the_extension(server):
    c = triton.InferenceServerClient(server.url)
    assert "system_shared_memory" in c.get_server_metadata()["extensions"]
    c.close()


def test_a_region_registered_through_one_worker_serves_through_the_other(server):
    a, b = [p.pid for p in server.workers()]
    on_a, on_b = server.connection_on(a), server.connection_on(b)
    x = np.arange(16, dtype=np.float32)[None]
    try:
        with region(2 * x.nbytes) as (key, handle):
            shm.set_shared_memory_region(handle, [x])
            assert request(on_a, "POST", "/v2/systemsharedmemory/region/r/register",
                           {"key": key, "offset": 0, "byte_size": 2 * x.nbytes})[0] == 200
            infer = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 16],
                                 "parameters": {"shared_memory_region": "r",
                                                "shared_memory_byte_size": x.nbytes}}],
                     "outputs": [{"name": "OUTPUT", "parameters": {
                         "shared_memory_region": "r", "shared_memory_byte_size": x.nbytes,
                         "shared_memory_offset": x.nbytes}}]}
            path = f"/v2/models/{server.names['single']}/infer"
            status, answer = request(on_b, "POST", path, infer)
            assert status == 200, answer
            assert np.array_equal(shm.get_contents_as_numpy(handle, F32, [1, 16],
                                                             offset=x.nbytes), x * 2 + 1)
            # unregistered through b: a no longer finds it
            assert request(on_b, "POST", "/v2/systemsharedmemory/region/r/unregister")[0] == 200
            status, answer = request(on_a, "POST", path, infer)
            assert status == 400 and "'r'" in answer["error"], answer
    finally:
        on_a.close()
        on_b.close()
