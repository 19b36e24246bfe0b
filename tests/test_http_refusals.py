"""What the Open Inference Protocol of `shmbatch serve --http-port` refuses, and how: a
request that can never fit is refused (400, 413) before its data is read or converted, a
413 is answered so that a client sending its whole body reads it, a 503 says when to try
again; and what a k-row infer obeys: the priority shares, and its own deadline counted from
its arrival. Driven by plain HTTP (http.client, urllib, raw sockets) and tritonclient, on
one serve with one HTTP worker, so that every request meets the same event loop."""
import concurrent.futures
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("uvicorn")
triton = pytest.importorskip("tritonclient.http")
from conftest import Gate, shm_entries, unique_name, wait_for  # noqa: E402
from test_multi_engine import Served, table, top  # noqa: E402
from test_sidecar import shmbatch  # noqa: E402

X4 = dict(input_shape=[4], output_shape=[4])
# the small engine's derived JSON limit: 8 requests x 4 values x 32 B + 64 KiB
SMALL_JSON_LIMIT = 8 * 4 * 32 + (64 << 10)
WIDE = 4096  # values a request of the wide engine


class Server:
    def __init__(self, folder):
        self.gates = {tag: Gate() for tag in ("full", "shares", "stalled")}
        self.names = {tag: unique_name(tag) for tag in
                      ("small", "wide", "full", "shares", "stalled")}
        n, g = self.names, self.gates
        gated = dict(backend="helpers:gated", max_batch_size=1, admission="none", **X4)
        self.serve = Served(folder, top(http_workers=1) + "".join([
            table(n["small"], backend="helpers:affine", queue_capacity=8, max_batch_size=8,
                  priority_levels=2, **X4),
            table(n["wide"], backend="helpers:affine", input_shape=[WIDE], output_shape=[WIDE],
                  queue_capacity=256),
            table(n["full"], backend_args={"gate": g["full"].name}, queue_capacity=2, **gated),
            table(n["shares"], backend_args={"gate": g["shares"].name}, queue_capacity=16,
                  priority_levels=2, **gated),
            table(n["stalled"], backend_args={"gate": g["stalled"].name}, queue_capacity=128,
                  **gated),
        ]), "--http-port", "0")
        self.url = self.serve.url
        self.host, port = self.url.rsplit(":", 1)
        self.port = int(port)

    def path(self, tag: str, route: str = "infer") -> str:
        return f"/v2/models/{self.names[tag]}/{route}"

    def requests_total(self, tag: str) -> int:
        out = shmbatch("status", self.names[tag], "--json")
        return json.loads(out.stdout)["requests_total"]

    def close(self):
        for gate in self.gates.values():
            gate.open()
        try:
            assert self.serve.stop() == 0, self.serve.stderr()
            assert "Traceback" not in self.serve.stderr(), self.serve.stderr()
        finally:
            for gate in self.gates.values():
                gate.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("refusals"))
    yield s
    s.close()
    assert not [e for e in shm_entries() if any(n in e for n in s.names.values())]


def post(server, path: str, body: bytes, headers=None, timeout: float = 60):
    """(status, headers by lowercase name, JSON body) of one POST."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        response = conn.getresponse()
        return (response.status, {k.lower(): v for k, v in response.getheaders()},
                json.loads(response.read()))
    finally:
        conn.close()


def request(*inputs, outputs=None, parameters=None) -> bytes:
    out = {"inputs": list(inputs)}
    if outputs is not None:
        out["outputs"] = outputs
    if parameters is not None:
        out["parameters"] = parameters
    return json.dumps(out).encode()


def rows(k: int, start: float = 0.0, width: int = 4, datatype="FP32", **extra):
    """The INPUT tensor of k requests of `width` values, as JSON."""
    data = (start + np.arange(k * width, dtype=np.float32)).tolist()
    return {"name": "INPUT", "datatype": datatype, "shape": [k, width], "data": data, **extra}


def answered(result, k: int, start: float = 0.0) -> bool:
    """Whether a JSON infer answer holds 2x + 1 of rows(k, start)."""
    x = start + np.arange(k * 4, dtype=np.float32)
    out = result["outputs"][0]
    return out["shape"] == [k, 4] and np.array_equal(np.array(out["data"]), x * 2 + 1)


def in_thread(fn, *args):
    """fn(*args) started in a thread; join() returns its result (bounded)."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    t.start()

    def join(timeout: float = 60.0):
        t.join(timeout)
        assert box, f"no answer within {timeout} s"
        return box[0]
    return join


def test_an_output_or_input_named_twice_is_refused(server):
    twice = request(rows(1), outputs=[{"name": "OUTPUT"}, {"name": "OUTPUT"}])
    got, _, answer = post(server, server.path("small"), twice)
    assert (got, answer) == (400, {"error": "outputs: expected each output named once, got "
                                            "'OUTPUT' 2 times"})
    got, _, answer = post(server, server.path("small"), request(rows(1), rows(1)))
    assert (got, answer) == (400, {"error": "inputs: expected each input named once, got "
                                            "'INPUT' 2 times"})
    got, _, answer = post(server, server.path("small"), request(rows(1)))
    assert got == 200 and answered(answer, 1)


def test_a_json_body_over_the_engines_limit_is_answered_413_to_a_client_that_sends_it_all(
        server):
    # 32 MiB of JSON for an engine of 8 requests of 4 values: refused from its
    # Content-Length, and read to its end (urllib sends it all before it reads)
    values = b"0," * (16 << 20)
    body = b'{"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [8, 4], "data": [' \
        + values + b'0]}]}'
    req = urllib.request.Request(f"http://{server.url}{server.path('small')}", data=body,
                                 method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=60)
    assert refused.value.code == 413
    error = json.loads(refused.value.read())["error"]
    assert error.startswith(f"expected a body of at most {SMALL_JSON_LIMIT} bytes (model "
                            f"'{server.names['small']}': 8 request(s) x 4 values x 32 B of JSON "
                            f"text + 65536 B), got Content-Length {len(body)}"), error
    got, _, answer = post(server, server.path("small"), request(rows(8)))  # the largest it takes
    assert got == 200 and answered(answer, 8)


def test_binary_tensor_data_is_limited_to_exactly_queue_capacity_requests(server):
    x = np.arange(32, dtype=np.float32).reshape(8, 4)  # 8 requests: 128 B, exactly the limit
    t = triton.InferInput("INPUT", [8, 4], "FP32")
    t.set_data_from_numpy(x, binary_data=True)
    result = triton.InferenceServerClient(server.url).infer(server.names["small"], [t])
    assert np.array_equal(result.as_numpy("OUTPUT"), x * 2 + 1)
    head = request({"name": "INPUT", "datatype": "FP32", "shape": [8, 4],
                    "parameters": {"binary_data_size": 129}})
    got, headers, answer = post(server, server.path("small"), head + bytes(129),
                                {"Inference-Header-Content-Length": str(len(head))})
    assert got == 413 and headers["connection"] == "close"
    assert answer["error"] == (f"expected a body of at most {len(head) + 128} bytes (model "
                               f"'{server.names['small']}': 8 request(s) x 16 B of binary "
                               f"tensor data after the {len(head)} B of JSON), got "
                               f"Content-Length {len(head) + 129}")


def test_a_caller_that_expects_100_continue_is_answered_413_without_sending_its_body(server):
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall((f"POST {server.path('small')} HTTP/1.1\r\nHost: x\r\n"
                      f"Content-Length: {1 << 20}\r\nExpect: 100-continue\r\n\r\n").encode())
        got = b""
        while True:  # the answer, then the close: not one byte of the body was sent
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), got
    assert json.loads(body)["error"].startswith(
        f"expected a body of at most {SMALL_JSON_LIMIT} bytes")


# (what the engine cannot take, the input declaring it, what the 400 says); each one's
# data is strings, which would fail its conversion: the declaration is refused first
DECLARED = [
    ("more requests than queue_capacity", rows(9), "expected at most 8 requests (the engine's "
                                                    "queue_capacity) in one infer, got 9"),
    ("a dim beyond the engine's", rows(1, width=5), "input 'INPUT': expected shape [k, 4] "
                                                    "(k >= 1 requests), got [1, 5]"),
    ("a rank not the engine's", {**rows(1), "shape": [4]}, "input 'INPUT': expected shape "
                                                           "[k, 4] (k >= 1 requests), got [4]"),
    ("a datatype not the engine's", rows(1, datatype="INT32"), "input 'INPUT': expected "
                                                               "datatype FP32, got INT32"),
]


def test_a_declared_shape_or_datatype_the_engine_cannot_take_is_refused_before_its_data(
        server):
    for what, tensor, says in DECLARED:
        tensor = {**tensor, "data": ["x"] * len(tensor["data"])}
        got, _, answer = post(server, server.path("small"), request(tensor))
        assert (got, answer) == (400, {"error": says}), what


def deep(levels: int, inner="1") -> str:
    return "[" * levels + inner + "]" * levels


def raw(data: str, parameters: str = "{}") -> bytes:
    return ('{"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 4], "data": %s}], '
            '"parameters": %s}' % (data, parameters)).encode()


# (what is wrong, route, body, what the 400 says)
MALFORMED = [
    ("lists nested past what JSON parses", "infer", raw(deep(5000)),
     "got lists or objects nested deeper than the parser takes"),
    ("lists nested past the shape", "infer", raw(f"[{deep(60)}, 2, 3, 4]"),
     "as a flat list or as lists nested as its shape, got [[[[["),
    ("a list beside the values of a row", "infer", raw("[[1, [2], 3, 4]]"),
     "as a flat list or as lists nested as its shape, got [[1, [2], 3, 4]]"),
    ("an object for a value", "infer", raw('[{"a": 1}, 2, 3, 4]'),
     "expected 4 numbers (FP32[1, 4]), got [{\"a\": 1}, 2, 3, 4]"),
    ("lists nested past any shape, to generate", "generate", f'{{"INPUT": {deep(100)}}}'.encode(),
     "input 'INPUT': expected a value or lists nested at most 32 deep, got deeper ones"),
    *((f"a timeout of {t}", "infer", raw("[1, 2, 3, 4]", f'{{"timeout": {t}}}'),
       f"timeout: expected microseconds >= 0 and <= 604800000000 (a week; 0: the server's "
       f"default of 30 s), got {shown}")
      for t, shown in (("1e30", "1e+30"), ("1e300", "1e+300"), ("Infinity", "Infinity"),
                       ("-1", "-1"), ('"5"', '"5"'))),
    *((f"a priority of {p}", "infer", raw("[1, 2, 3, 4]", f'{{"priority": {p}}}'),
       "priority: expected 0 (the default) or 1..2") for p in ("3", "-1", "1.5", "true")),
]


def test_malformed_data_and_parameters_are_400_naming_what_was_expected(server):
    for what, route, body, says in MALFORMED:
        got, _, answer = post(server, server.path("small", route), body)
        assert got == 400 and list(answer) == ["error"] and says in answer["error"], \
            (what, got, answer)
    got, _, answer = post(server, server.path("small"), request(rows(2)))
    assert got == 200 and answered(answer, 2)


def test_a_full_queue_is_a_503_that_says_when_to_try_again(server):
    held = [in_thread(post, server, server.path("full"), request(rows(1, start=k)))
            for k in range(2)]  # queue_capacity 2: one held in its batch, one queued
    wait_for(lambda: server.requests_total("full") >= 2, "2 requests queued")
    got, headers, answer = post(server, server.path("full"), request(rows(1)))
    assert got == 503 and answer["error"].startswith("QueueFull")
    assert int(headers["retry-after"]) >= 1
    server.gates["full"].open()
    for k, join in enumerate(held):
        got, _, answer = join()
        assert got == 200 and answered(answer, 1, start=k)


def test_an_infers_timeout_counts_from_its_arrival_not_from_its_body_read(server):
    body = request(rows(2), parameters={"timeout": 200_000})  # 0.2 s
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.putrequest("POST", server.path("small"))
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        conn.send(body[:10])
        time.sleep(0.6)  # the rest of the body comes after the request's deadline
        conn.send(body[10:])
        response = conn.getresponse()
        assert response.status == 504
        assert json.loads(response.read())["error"].startswith("RequestTimeout: expected an "
                                                               "answer within 0.2 s")
    finally:
        conn.close()


def test_a_k_row_infer_keeps_the_priority_shares_and_leaves_room_for_urgent_requests(server):
    # queue_capacity 16, priority 2 (the engine's level 1) may hold 14: its first
    # 8-row infer is queued behind the held batch, its second refused whole
    first = in_thread(post, server, server.path("shares"),
                      request(rows(8), parameters={"priority": 2}))
    wait_for(lambda: server.requests_total("shares") >= 8, "8 requests queued")
    got, headers, answer = post(server, server.path("shares"),
                                request(rows(8), parameters={"priority": 2, "timeout": 2_000_000}))
    assert got == 503 and answer["error"].startswith("QueueFull: priority 1 may hold 14"), answer
    assert int(headers["retry-after"]) >= 1
    # an urgent request still finds a slot: it waits (the batch is held) until its timeout
    got, _, answer = post(server, server.path("shares"),
                          request(rows(1), parameters={"priority": 1, "timeout": 1_000_000}))
    assert got == 504 and answer["error"].startswith("RequestTimeout"), answer
    server.gates["shares"].open()
    got, _, answer = first()
    assert got == 200 and answered(answer, 8)


def test_many_k_row_infers_on_a_stalled_engine_each_time_out_on_its_own_deadline(server):
    # 40 infers of 2 rows, 1 s each, while the engine's batch is held: each is
    # answered 504 once its own second is past, none waits for another's
    def one(k):
        started = time.monotonic()
        got, _, answer = post(server, server.path("stalled"),
                              request(rows(2, start=k), parameters={"timeout": 1_000_000}))
        return got, answer, time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(one, range(40), timeout=120))
    assert {got for got, _, _ in results} == {504}, results
    assert all(answer["error"].startswith("RequestTimeout") for _, answer, _ in results)
    assert max(took for _, _, took in results) < 5.0, sorted(took for *_, took in results)


def test_a_large_json_body_is_parsed_while_the_worker_answers_other_requests(server):
    # 31 MiB of JSON numbers (the wide engine's limit is 32 MiB): seconds of
    # json.loads, after which it is refused (400 rows over queue_capacity 256).
    # The one worker answers a small infer sent meanwhile first.
    value = b"0.30000000000000004"
    data = b",".join([value] * (400 * WIDE))
    body = (b'{"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [400, %d], "data": ['
            % WIDE) + data + b']}]}'
    done = {}
    big = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        big.request("POST", server.path("wide"), body=body)  # sent whole
        time.sleep(0.3)  # and read by the worker, whose parsing takes seconds

        def small():
            got, _, answer = post(server, server.path("small"), request(rows(1)))
            done["small"] = time.monotonic()
            return got, answer
        small_answer = in_thread(small)
        response = big.getresponse()
        done["big"] = time.monotonic()
        assert response.status == 400
        assert json.loads(response.read())["error"] == (
            "expected at most 256 requests (the engine's queue_capacity) in one infer, got 400")
    finally:
        big.close()
    got, answer = small_answer()
    assert got == 200 and answered(answer, 1)
    assert done["small"] < done["big"]
    # a large body the engine takes is answered from the arrays the parser sent back
    x = np.random.default_rng(5).random((64, WIDE), dtype=np.float32)
    body = request({"name": "INPUT", "datatype": "FP32", "shape": [64, WIDE],
                    "data": x.ravel().tolist()}, outputs=[{"name": "OUTPUT",
                                                          "parameters": {"binary_data": True}}])
    assert len(body) > 1 << 20
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", server.path("wide"), body=body)
        response = conn.getresponse()
        raw_answer = response.read()
        assert response.status == 200, raw_answer[:200]
        cut = int(response.getheader("Inference-Header-Content-Length"))
        y = np.frombuffer(raw_answer[cut:], np.float32).reshape(64, WIDE)
        assert np.array_equal(y, x * 2 + 1)
    finally:
        conn.close()
