"""An infer whose body comes whole is answered without ASGI messages
(engine.http.server.writes.answer_whole) and keeps HTTP/1.1's rules as every
other answer of the worker does: pipelined requests answered in order, each
its own, whether answered whole or through the app; keep-alive unless the
caller asks to close (or speaks HTTP/1.0); the head says the body's length,
with the server's own headers. Real serve processes and plain sockets; every
answer is checked against its own request."""
import json
import select
import socket
import time

import numpy as np
import pytest

pytest.importorskip("uvicorn")
from test_http_connections import CLOSED_WITHIN_S, Serve, infer_body, until_closed  # noqa: E402


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    s = Serve(tmp_path_factory.mktemp("whole"))
    yield s
    s.close()


def post(name: str, x: np.ndarray, *head: str, version: str = "1.1") -> bytes:
    body = infer_body(x)
    lines = [f"POST /v2/models/{name}/infer HTTP/{version}", "host: a",
             "content-type: application/json", f"content-length: {len(body)}", *head]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def read_responses(sock: socket.socket, count: int) -> list:
    """count whole responses, each (status, headers in lower case, body), as they come."""
    data, out, deadline = b"", [], time.monotonic() + CLOSED_WITHIN_S
    while len(out) < count:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            headers = dict(line.lower().split(": ", 1) for line in lines[1:])
            length = int(headers["content-length"])
            if len(rest) >= length:
                out.append((int(lines[0].split(" ")[1]), headers, rest[:length]))
                data = rest[length:]
                continue
        left = deadline - time.monotonic()
        assert left > 0 and select.select([sock], [], [], left)[0], (out, data)
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed after {len(out)} of {count} answers: {data!r}"
        data += chunk
    return out


def outputs(body: bytes) -> np.ndarray:
    return np.array(json.loads(body)["outputs"][0]["data"], np.float32)


def test_pipelined_infers_and_other_requests_are_answered_in_order_each_its_own(serve):
    xs = [np.arange(16, dtype=np.float32) + 100 * k for k in range(4)]
    ready = b"GET /v2/health/ready HTTP/1.1\r\nhost: a\r\n\r\n"
    with serve.connect() as sock:
        sock.sendall(post(serve.name, xs[0]) + ready + post(serve.name, xs[1]) +
                     post(serve.name, xs[2]) + ready + post(serve.name, xs[3]))
        got = read_responses(sock, 6)
    assert [status for status, _, _ in got] == [200] * 6
    assert got[1][2] == got[4][2] == b'{"ready": true}'
    for (_, _, body), x in zip([got[0], got[2], got[3], got[5]], xs):
        assert np.array_equal(outputs(body), x * 2 + 1)


def test_an_infers_answer_says_its_length_with_the_servers_headers_and_keeps_the_connection(
        serve):
    with serve.connect() as sock:
        for k in range(3):
            sock.sendall(post(serve.name, np.full(16, k, np.float32)))
            [(status, headers, body)] = read_responses(sock, 1)
            assert status == 200 and np.array_equal(outputs(body), np.full(16, 2 * k + 1))
            assert int(headers["content-length"]) == len(body)
            assert headers["content-type"] == "application/json"
            assert "date" in headers and "connection" not in headers


@pytest.mark.parametrize("version, head", [("1.1", ("connection: close",)), ("1.0", ())])
def test_a_caller_that_asks_to_close_is_answered_then_closed(serve, version, head):
    x = np.arange(16, dtype=np.float32) - 7
    with serve.connect() as sock:
        sock.sendall(post(serve.name, x, *head, version=version))
        data = until_closed(sock)
    head_bytes, _, body = data.partition(b"\r\n\r\n")
    assert head_bytes.startswith(b"HTTP/1.1 200") and b"\r\nconnection: close" in head_bytes
    assert np.array_equal(outputs(body), x * 2 + 1)
