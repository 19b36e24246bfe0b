"""Every fault of the system shared-memory extension through plain HTTP: a 400 (404, 405,
413 where HTTP says) naming what was expected and what came; never a crash of a worker,
never an engine's segment, never a byte written outside a region."""
import contextlib
import http.client
import os

import numpy as np
import pytest

pytest.importorskip("uvicorn")
from conftest import requests_total, unique_name  # noqa: E402
from test_sysshm import Server, request  # noqa: E402


X = np.arange(16, dtype=np.float32)[None]
ROW = X.nbytes  # one request of the single engine: 64 bytes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("sysshm-refusals"))
    yield s
    s.close()
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"t{os.getpid()}-sysshm-")]


@pytest.fixture
def conn(server):
    c = http.client.HTTPConnection(server.host, int(server.port), timeout=30)
    yield c
    request(c, "POST", "/v2/systemsharedmemory/unregister")
    c.close()


@contextlib.contextmanager
def shm_object(byte_size: int, fill: int = 0):
    """A file in /dev/shm of the test's own (key, path), removed after."""
    name = unique_name("sysshm-obj")
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, bytes([fill]) * byte_size)
        yield "/" + name, path
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def register(conn, name: str, body) -> tuple:
    return request(conn, "POST", f"/v2/systemsharedmemory/region/{name}/register", body)


def infer(conn, server, inputs_params=None, output_params=None, tag="single") -> tuple:
    tensor = {"name": "INPUT", "datatype": "FP32", "shape": [1, 16]}
    if inputs_params is None:
        tensor["data"] = X.ravel().tolist()
    else:
        tensor["parameters"] = inputs_params
    body = {"inputs": [tensor]}
    if output_params is not None:
        body["outputs"] = [{"name": "OUTPUT", "parameters": output_params}]
    return request(conn, "POST", f"/v2/models/{server.names[tag]}/infer", body)


def shm_params(region: str, byte_size: int = ROW, offset=None) -> dict:
    p = {"shared_memory_region": region, "shared_memory_byte_size": byte_size}
    if offset is not None:
        p["shared_memory_offset"] = offset
    return p


@pytest.mark.parametrize("key", ["a/b", "/../etc/passwd", "..", "/", "", "x" * 256, "a\nb",
                                 3, None])
def test_a_key_that_is_no_name_in_dev_shm_is_refused(conn, key):
    status, answer = register(conn, "r", {"key": key, "offset": 0, "byte_size": 1})
    assert status == 400 and answer["error"].startswith("key: expected"), answer


def test_an_engines_segment_is_refused_by_its_name(conn, server):
    status, answer = register(conn, "r", {"key": f"/shmbatch-{server.names['single']}",
                                          "offset": 0, "byte_size": 64})
    assert status == 400 and "engines' own segments" in answer["error"], answer


def test_an_engines_segment_under_another_name_is_refused(conn, server):
    alias = f"/dev/shm/{unique_name('sysshm-alias')}"
    os.link(f"/dev/shm/shmbatch-{server.names['single']}", alias)
    try:
        status, answer = register(conn, "r", {"key": alias[8:], "offset": 0, "byte_size": 64})
    finally:
        os.unlink(alias)
    assert status == 400 and "of one name, got one of 2" in answer["error"], answer


def test_a_symbolic_link_is_refused_not_followed(conn):
    with shm_object(64) as (key, path):
        link = f"/dev/shm/{unique_name('sysshm-link')}"
        os.symlink(path, link)
        try:
            status, answer = register(conn, "r", {"key": link[8:], "offset": 0, "byte_size": 64})
        finally:
            os.unlink(link)
    assert status == 400 and "symbolic link" in answer["error"], answer


def test_a_fifo_is_refused_without_waiting_for_a_writer(conn):
    fifo = f"/dev/shm/{unique_name('sysshm-fifo')}"
    os.mkfifo(fifo, 0o600)
    try:
        status, answer = register(conn, "r", {"key": fifo[8:], "offset": 0, "byte_size": 1})
    finally:
        os.unlink(fifo)
    assert status == 400 and "expected a regular file" in answer["error"], answer


def test_a_key_of_no_object_is_refused(conn):
    status, answer = register(conn, "r", {"key": "/" + unique_name("sysshm-none"),
                                          "offset": 0, "byte_size": 1})
    assert status == 400 and "No such file" in answer["error"], answer


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_an_object_of_another_user_is_refused(conn):
    with shm_object(64) as (key, path):
        os.chown(path, 12345, -1)
        status, answer = register(conn, "r", {"key": key, "offset": 0, "byte_size": 64})
    assert status == 400 and "got one of uid 12345" in answer["error"], answer


@pytest.mark.parametrize("offset, byte_size", [(0, 65), (60, 5), (-1, 4), (0, -1), (0, "8"),
                                               (True, 4), (0, 1.5), (0, None)])
def test_a_region_past_its_object_or_of_no_byte_count_is_refused(conn, offset, byte_size):
    with shm_object(64) as (key, _):
        status, answer = register(conn, "r", {"key": key, "offset": offset,
                                              "byte_size": byte_size})
    assert status == 400, answer
    assert "within the object's 64 bytes" in answer["error"] or \
        "expected a byte count" in answer["error"], answer


def test_a_name_registered_twice_is_refused_until_unregistered(conn):
    with shm_object(64) as (key, _):
        body = {"key": key, "offset": 0, "byte_size": 64}
        assert register(conn, "r", body)[0] == 200
        status, answer = register(conn, "r", body)
        assert status == 400 and "not registered, got one that is" in answer["error"], answer
        assert request(conn, "POST", "/v2/systemsharedmemory/region/r/unregister")[0] == 200
        assert register(conn, "r", body)[0] == 200


@pytest.mark.parametrize("name", ["x" * 129, "a%20b", "caf%C3%A9"])
def test_a_region_name_too_long_or_not_printable_ascii_is_refused(conn, name):
    with shm_object(64) as (key, _):
        status, answer = register(conn, name, {"key": key, "offset": 0, "byte_size": 64})
    assert status == 400 and answer["error"].startswith("region name: expected"), answer


def test_the_257th_region_is_refused(conn):
    with shm_object(64) as (key, _):
        for i in range(256):
            assert register(conn, f"r{i}", {"key": key, "offset": 0, "byte_size": 64})[0] == 200
        status, answer = register(conn, "r256", {"key": key, "offset": 0, "byte_size": 64})
    assert status == 400 and "at most 256 regions" in answer["error"], answer


def test_a_malformed_or_oversized_register_body_is_refused(conn):
    conn.request("POST", "/v2/systemsharedmemory/region/r/register", body=b"{nope")
    response = conn.getresponse()
    assert response.status == 400 and b"malformed JSON" in response.read()
    conn.request("POST", "/v2/systemsharedmemory/region/r/register", body=b" " * 5000)
    response = conn.getresponse()
    assert response.status == 413 and b"at most 4096 bytes" in response.read()


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v2/systemsharedmemory/region/nowhere/status", 404),
    ("GET", "/v2/systemsharedmemory/elsewhere", 404),
    ("GET", "/v2/systemsharedmemory/region/r/register", 405),
    ("POST", "/v2/systemsharedmemory/status", 405)])
def test_an_unknown_region_route_or_method_is_refused(server, method, path, status):
    c = http.client.HTTPConnection(server.host, int(server.port), timeout=30)
    try:
        got, answer = request(c, method, path)
    finally:
        c.close()
    assert got == status and answer["error"], answer


def test_an_infer_naming_an_unregistered_region_is_refused(conn, server):
    status, answer = infer(conn, server, shm_params("nowhere"))
    assert status == 400 and "got 'nowhere'" in answer["error"], answer


@pytest.mark.parametrize("params, says", [
    (shm_params("r", ROW - 4), "expected 64 bytes (FP32[1, 16]), got 60"),
    (shm_params("r", ROW, offset=4), "within region 'r''s 64 bytes, got 4 + 64"),
    ({"shared_memory_region": "r"}, "got no shared_memory_byte_size"),
    ({"shared_memory_byte_size": ROW}, "got no shared_memory_region"),
    ({"shared_memory_offset": 0}, "got neither"),
    ({**shm_params("r"), "binary_data_size": ROW}, "binary_data_size and shared_memory_region"),
    (shm_params("r", ROW, offset=-1), "shared_memory_offset: expected a byte count")])
def test_an_input_region_of_the_wrong_size_place_or_parameters_is_refused(conn, server,
                                                                          params, says):
    with shm_object(ROW) as (key, _):
        assert register(conn, "r", {"key": key, "offset": 0, "byte_size": ROW})[0] == 200
        status, answer = infer(conn, server, params)
    assert status == 400 and says in answer["error"], answer


def test_an_output_region_too_small_is_refused_before_anything_is_enqueued(conn, server):
    before = requests_total(server.names["single"])
    with shm_object(ROW) as (key, _):
        assert register(conn, "r", {"key": key, "offset": 0, "byte_size": ROW})[0] == 200
        status, answer = infer(conn, server, None, shm_params("r", ROW - 1))
    assert status == 400 and "expected at least 64 bytes" in answer["error"], answer
    assert requests_total(server.names["single"]) == before


def test_an_input_object_truncated_after_register_is_a_400_and_the_worker_serves_on(
        conn, server):
    pids = sorted(p.pid for p in server.workers())
    with shm_object(ROW) as (key, path):
        assert register(conn, "r", {"key": key, "offset": 0, "byte_size": ROW})[0] == 200
        os.truncate(path, 8)
        status, answer = infer(conn, server, shm_params("r"))
        assert status == 400 and "expected 64 bytes at byte 0 of its object, got 8" in \
            answer["error"], answer
    status, answer = infer(conn, server)
    assert status == 200 and answer["outputs"][0]["data"] == (X * 2 + 1).ravel().tolist()
    assert sorted(p.pid for p in server.workers()) == pids


def test_an_output_object_truncated_after_register_is_a_400_and_not_grown_back(conn, server):
    with shm_object(ROW) as (key, path):
        assert register(conn, "r", {"key": key, "offset": 0, "byte_size": ROW})[0] == 200
        os.truncate(path, 8)
        status, answer = infer(conn, server, None, shm_params("r"))
        size = os.stat(path).st_size
    assert status == 400 and "at least 64 bytes to write 64 at byte 0, got 8" in \
        answer["error"], answer
    assert size == 8


def test_an_output_is_written_inside_its_region_and_nowhere_else(conn, server):
    with shm_object(3 * ROW, fill=0xAB) as (key, path):
        # the region is the middle third; the output at offset 0 of it
        assert register(conn, "r", {"key": key, "offset": ROW, "byte_size": ROW})[0] == 200
        status, answer = infer(conn, server, None, shm_params("r"))
        with open(path, "rb") as f:
            raw = f.read()
    assert status == 200, answer
    assert raw[:ROW] == raw[2 * ROW:] == b"\xab" * ROW
    assert np.array_equal(np.frombuffer(raw[ROW:2 * ROW], np.float32), (X * 2 + 1).ravel())


def test_an_object_replaced_after_register_is_refused_by_a_worker_that_did_not_open_it(server):
    a, b = [p.pid for p in server.workers()]
    on_a, on_b = server.connection_on(a), server.connection_on(b)
    try:
        with shm_object(ROW) as (key, path):
            assert register(on_a, "r", {"key": key, "offset": 0, "byte_size": ROW})[0] == 200
            os.unlink(path)  # its owner removes it, and another object takes its name
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.write(fd, b"\0" * ROW)
            os.close(fd)
            status, answer = infer(on_b, server, shm_params("r"))
        assert status == 400 and "got another of that name" in answer["error"], answer
    finally:
        request(on_a, "POST", "/v2/systemsharedmemory/unregister")
        on_a.close()
        on_b.close()


