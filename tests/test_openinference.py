"""The Open Inference Protocol (KServe v2 REST) of `shmbatch serve --http-port`, driven by
tritonclient (sync and asyncio), and by raw HTTP for the bodies no client sends and for
Triton's generate extension (server-sent events)."""
import asyncio
import http.client
import json
import signal

import numpy as np
import pytest

pytest.importorskip("uvicorn")
triton = pytest.importorskip("tritonclient.http")
import tritonclient.http.aio as triton_aio  # noqa: E402
from conftest import Gate, shm_entries, unique_name, wait_for  # noqa: E402
from test_multi_engine import Served, table, top  # noqa: E402
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

from engine.segment import Segment  # noqa: E402
from engine.serving import metrics
from engine.shm import codes  # noqa: E402

X = np.arange(16, dtype=np.float32)
FIXED = dict(input_shape=[16], output_shape=[16])
DTYPES = {"echo_a": ("bool", "uint8", "uint16", "uint32", "uint64", "int8"),
          "echo_b": ("int16", "int32", "int64", "float16", "float32", "float64")}
MAX_BODY_BYTES = 1 << 20
# a counting step model's request (start, steps) and its chunks, one int64 a step
STEPS = dict(input_shape=[2], input_dtype="int64", output_shape=[], output_dtype="int64")


class Server:
    """One serve of every engine the tests below use, with 2 HTTP workers."""

    def __init__(self, folder):
        self.gates = {"held": Gate(), "full": Gate()}
        self.names = {tag: unique_name(tag) for tag in
                      ("single", "named", "var", "slow", "held", "full", "gen", "endless",
                       *DTYPES)}
        n = self.names
        tables = [
            table(n["single"], backend="helpers:failing", max_batch_size=8, queue_capacity=64,
                  priority_levels=2, **FIXED),
            table(n["named"], backend="serve_backends:mixed",
                  inputs={"x": ["float32", [4]], "n": ["int64", [2]]},
                  outputs={"s": ["float32", []], "t": ["int64", [2]], "flag": ["bool", []]}),
            table(n["var"], backend="helpers:masked_sum", input_shape=["none"],
                  max_input_shape=[8], output_shape=[]),
            table(n["slow"], backend="helpers:slow_affine", backend_args={"fixed_ms": 100.0},
                  admission="none", max_batch_size=4, **FIXED),
            table(n["held"], backend="helpers:gated",
                  backend_args={"gate": self.gates["held"].name}, max_batch_size=16, **FIXED),
            table(n["full"], backend="helpers:gated",
                  backend_args={"gate": self.gates["full"].name}, max_batch_size=1,
                  queue_capacity=2, **FIXED),
            table(n["gen"], backend="serve_backends:counting", iterative=True, max_steps=64,
                  **STEPS),
            table(n["endless"], backend="serve_backends:counting",
                  backend_args={"step_ms": 20.0}, iterative=True, max_steps=65536,
                  queue_capacity=4, max_batch_size=4, **STEPS),
            *(table(n[tag], backend="serve_backends:echo",
                    inputs={d: [d, [3]] for d in dtypes},
                    outputs={f"{d}_out": [d, [3]] for d in dtypes})
              for tag, dtypes in DTYPES.items()),
        ]
        self.serve = Served(folder, top(http_workers=2, http_max_body_bytes=MAX_BODY_BYTES)
                            + "".join(tables), "--http-port", "0")
        self.url = self.serve.url

    def client(self):
        return triton.InferenceServerClient(self.url)

    def requests_total(self, tag: str) -> int:
        seg = Segment.attach(self.names[tag], header_only=True)
        try:
            return seg.ring.word(codes.W_REQUESTS)
        finally:
            seg.close()

    def stats(self, tag: str) -> dict:
        seg = Segment.attach(self.names[tag])
        try:
            return metrics.read_stats(seg)
        finally:
            seg.close()

    def close(self):
        for g in self.gates.values():
            g.open()  # a batch a failed test left held goes on, and the drain ends
        try:
            assert self.serve.stop() == 0, self.serve.stderr()
            assert "Traceback" not in self.serve.stderr(), self.serve.stderr()
        finally:
            for g in self.gates.values():
                g.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("oip"))
    yield s
    s.close()
    assert not [e for e in shm_entries() if any(n in e for n in s.names.values())]


def tensor(name: str, x: np.ndarray, binary: bool = True):
    t = triton.InferInput(name, list(x.shape), np_to_triton_dtype(x.dtype))
    t.set_data_from_numpy(x, binary_data=binary)
    return t


def wanted(*names, binary=True):
    return [triton.InferRequestedOutput(name, binary_data=binary) for name in names]


def test_health_metadata_and_config_describe_each_engine_as_triton_tools_read_them(server):
    c, n = server.client(), server.names
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(n["single"])
    assert "binary_tensor_data" in c.get_server_metadata()["extensions"]
    meta = c.get_model_metadata(n["single"])
    assert meta["inputs"] == [{"name": "INPUT", "datatype": "FP32", "shape": [-1, 16]}]
    assert meta["outputs"] == [{"name": "OUTPUT", "datatype": "FP32", "shape": [-1, 16]}]
    assert c.get_model_metadata(n["var"])["inputs"][0]["shape"] == [-1, -1]
    config = c.get_model_config(n["named"])
    assert config["max_batch_size"] == 32
    assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]},
                               {"name": "n", "data_type": "TYPE_INT64", "dims": [2]}]
    assert {"name": "flag", "data_type": "TYPE_BOOL", "dims": [1],
            "reshape": {"shape": []}} in config["output"]
    index = c.get_model_repository_index()
    assert sorted(m["name"] for m in index) == sorted(n.values())
    assert {m["state"] for m in index} == {"READY"}


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_a_single_array_engine_answers_k_requests_stacked_in_order(server, binary):
    c, name = server.client(), server.names["single"]
    for k in (1, 5):
        xs = X + np.arange(k, dtype=np.float32)[:, None]
        result = c.infer(name, [tensor("INPUT", xs, binary)], outputs=wanted("OUTPUT", binary=binary))
        assert np.array_equal(result.as_numpy("OUTPUT"), xs * 2 + 1)
    result = c.infer(name, [tensor("INPUT", X[None], binary)])  # no outputs named: all, binary
    assert result.get_response()["outputs"][0]["parameters"] == {"binary_data_size": 64}
    assert np.array_equal(result.as_numpy("OUTPUT"), X[None] * 2 + 1)


def test_named_tensors_answer_by_name_with_only_the_outputs_asked_for(server):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4)).astype(np.float32)
    n = rng.integers(-100, 100, (3, 2))
    result = server.client().infer(server.names["named"], [tensor("x", x), tensor("n", n, False)],
                                   outputs=[*wanted("t", binary=False), *wanted("flag")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["t", "flag"]
    assert np.array_equal(result.as_numpy("t"), n * 3)
    assert np.array_equal(result.as_numpy("flag"), x.sum(axis=1) > 0)
    assert result.as_numpy("s") is None


def test_a_variable_dim_takes_each_length_up_to_its_bound(server):
    c, name = server.client(), server.names["var"]
    for length in (1, 5, 8):
        xs = np.arange(3 * length, dtype=np.float32).reshape(3, length)
        result = c.infer(name, [tensor("INPUT", xs)])
        assert np.array_equal(result.as_numpy("OUTPUT"), xs.sum(axis=1))
    with pytest.raises(InferenceServerException, match=r"expected shape \[k, 1\.\.8\]"):
        c.infer(name, [tensor("INPUT", np.ones((1, 9), np.float32))])


def extremes(dtype: str) -> np.ndarray:
    """Two requests of three values each: the dtype's least, greatest and a middle one."""
    if dtype == "bool":
        return np.array([[True, False, True], [False, True, False]])
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else np.finfo(dtype)
    low, high = info.min, info.max
    middle = np.array(high, dtype) // 3 if np.dtype(dtype).kind in "iu" else info.tiny
    return np.array([[low, high, middle], [high, middle, low]], dtype)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_every_datatype_goes_both_ways_unchanged(server, binary):
    c = server.client()
    for tag, dtypes in DTYPES.items():
        name = server.names[tag]
        meta = {t["name"]: t["datatype"] for t in c.get_model_metadata(name)["inputs"]}
        assert meta == {d: np_to_triton_dtype(np.dtype(d)) for d in dtypes}
        result = c.infer(name, [tensor(d, extremes(d), binary) for d in dtypes],
                         outputs=wanted(*(f"{d}_out" for d in dtypes), binary=binary))
        for d in dtypes:
            got = result.as_numpy(f"{d}_out")
            assert got.dtype == np.dtype(d) and np.array_equal(got, extremes(d)), d


def test_concurrent_asyncio_requests_on_both_workers_batch_together(server):
    name = server.names["held"]

    async def run():
        c = triton_aio.InferenceServerClient(server.url)
        try:
            calls = [asyncio.create_task(c.infer(name, [tensor("INPUT", (X + k)[None])]))
                     for k in range(12)]
            # the first batch is held at the gate until all 12 are queued
            await asyncio.to_thread(wait_for, lambda: server.requests_total("held") >= 12,
                                    "12 requests queued")
            server.gates["held"].open()
            return await asyncio.gather(*calls)
        finally:
            await c.close()

    results = asyncio.run(run())
    for k, result in enumerate(results):
        assert np.array_equal(result.as_numpy("OUTPUT"), (X + k)[None] * 2 + 1)
    assert max(server.stats("held")["batch_size_counts"]) > 1


def test_the_timeout_and_priority_parameters_take_triton_meanings(server):
    c, n = server.client(), server.names
    with pytest.raises(InferenceServerException) as timed_out:
        c.infer(n["slow"], [tensor("INPUT", X[None])], timeout=20_000)  # microseconds
    assert timed_out.value.status() == "504" and "RequestTimeout" in timed_out.value.message()
    result = c.infer(n["slow"], [tensor("INPUT", X[None])])  # the server's default: 30 s
    assert np.array_equal(result.as_numpy("OUTPUT"), X[None] * 2 + 1)
    for priority in (1, 2):  # 1 the most urgent: the engine's levels 0 and 1
        result = c.infer(n["single"], [tensor("INPUT", X[None])], priority=priority)
        assert np.array_equal(result.as_numpy("OUTPUT"), X[None] * 2 + 1)
    with pytest.raises(InferenceServerException, match=r"priority: expected 0 .* or 1\.\.2"):
        c.infer(n["single"], [tensor("INPUT", X[None])], priority=3)


def test_a_backend_error_is_500_and_a_full_queue_503(server):
    c, n = server.client(), server.names
    with pytest.raises(InferenceServerException) as failed:
        c.infer(n["single"], [tensor("INPUT", -X[None] - 1)])
    assert failed.value.status() == "500"
    assert "BackendError: ValueError: negative input" in failed.value.message()

    async def run():
        client = triton_aio.InferenceServerClient(server.url)
        try:  # queue_capacity 2: one request held in its batch, one queued, the third refused
            calls = [asyncio.create_task(client.infer(n["full"], [tensor("INPUT", (X + k)[None])]))
                     for k in range(2)]
            await asyncio.to_thread(wait_for, lambda: server.requests_total("full") >= 2,
                                    "2 requests queued")
            try:
                await client.infer(n["full"], [tensor("INPUT", X[None])])
            except InferenceServerException as e:
                refused = e
            server.gates["full"].open()
            return refused, await asyncio.gather(*calls)
        finally:
            await client.close()

    refused, results = asyncio.run(run())
    assert refused.status() == "503" and "QueueFull" in refused.message()
    for k, result in enumerate(results):
        assert np.array_equal(result.as_numpy("OUTPUT"), (X + k)[None] * 2 + 1)


def body(*inputs, outputs=None, parameters=None) -> bytes:
    request = {"inputs": list(inputs)}
    if outputs is not None:
        request["outputs"] = outputs
    if parameters is not None:
        request["parameters"] = parameters
    return json.dumps(request).encode()


def single(shape=(1, 16), datatype="FP32", data=None, **extra):
    return {"name": "INPUT", "shape": list(shape), "datatype": datatype,
            **({"data": [0.0] * int(np.prod(shape)) if data is None else data} if
               "parameters" not in extra else {}), **extra}


def binary(size: int, sent: int):
    """A body of one binary FP32[1, 16] tensor that declares `size` bytes and sends `sent`."""
    head = body(single(parameters={"binary_data_size": size}))
    return head + bytes(sent), {"Inference-Header-Content-Length": str(len(head))}


# (what is wrong, model tag, body, headers, status, what the error says)
BAD = [
    ("malformed JSON", "single", b'{"inputs": [', {}, 400, "got malformed JSON"),
    ("JSON that is not an object", "single", b"[1, 2]", {}, 400,
     "expected a JSON object, got a JSON list"),
    ("a wrong datatype", "single", body(single(datatype="FP64")), {}, 400,
     "expected datatype FP32, got FP64"),
    ("a wrong shape", "single", body(single(shape=(1, 15))), {}, 400,
     "expected shape [k, 16] (k >= 1 requests), got [1, 15]"),
    ("no requests", "single", body(single(shape=(0, 16))), {}, 400, "got [0, 16]"),
    ("data short of its shape", "single", body(single(data=[1.0] * 15)), {}, 400,
     "expected 16 numbers (FP32[1, 16]), got 15 numbers"),
    ("strings for numbers", "single", body(single(data=["1"] * 16)), {}, 400,
     "expected 16 numbers (FP32[1, 16]), got [\"1\""),
    ("floats for integers", "named", body(
        {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
        {"name": "n", "shape": [1, 2], "datatype": "INT64", "data": [1.5, 2]}), {}, 400,
     "input 'n': expected 2 integers (INT64[1, 2]), got 2 numbers"),
    ("an integer out of range", "echo_a", body(*(
        {"name": d, "shape": [1, 3], "datatype": np_to_triton_dtype(np.dtype(d)),
         "data": {"uint8": [256, 0, 0], "bool": [False] * 3}.get(d, [0, 0, 0])}
        for d in DTYPES["echo_a"])), {}, 400,
     "input 'uint8': expected UINT8 values in 0..255, got 0..256"),
    ("BYTES", "single", body(single(datatype="BYTES", data=["a"] * 16)), {}, 400,
     "datatype BYTES is not served"),
    ("binary data shorter than declared", "single", *binary(64, 60), 400,
     "binary_data_size 64 at byte 0 of the binary data, which holds 60 bytes"),
    ("binary data longer than declared", "single", *binary(64, 68), 400,
     "the binary data after the JSON is 68 bytes, the inputs' binary_data_size parameters add "
     "up to 64"),
    ("a binary size not the tensor's", "single", *binary(60, 60), 400,
     "binary_data_size: expected 64 bytes (FP32[1, 16]), got 60"),
    ("a JSON length past the body", "single", body(single()),
     {"Inference-Header-Content-Length": str(1 << 40)}, 400,
     "Inference-Header-Content-Length: expected a byte count in 0.."),
    ("an unknown model", None, body(single()), {}, 404,
     "Request for unknown model: 'no-such-model' is not found"),
    ("an unknown output", "single", body(single(), outputs=[{"name": "NOPE"}]), {}, 400,
     "expected outputs among ['OUTPUT'], got \"NOPE\""),
    ("a missing input", "named", body(
        {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}), {}, 400,
     "expected inputs ['x', 'n'], got ['x']"),
    ("first dims that differ", "named", body(
        {"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [0] * 8},
        {"name": "n", "shape": [3, 2], "datatype": "INT64", "data": [0] * 6}), {}, 400,
     "input 'n': expected 2 requests in its first dim, as input 'x' has, got 3"),
    ("more requests than the queue holds", "single", body(single(shape=(65, 16))), {}, 400,
     "expected at most 64 requests (the engine's queue_capacity) in one infer, got 65"),
    ("a negative timeout", "single", body(single(), parameters={"timeout": -1}), {}, 400,
     "timeout: expected microseconds >= 0"),
]


def post(url: str, path: str, data: bytes, headers: dict, method: str = "POST"):
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("what, tag, data, headers, status, says", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_its_4xx_naming_what_was_expected_and_the_engine_stays_right(
        server, what, tag, data, headers, status, says):
    name = server.names[tag] if tag else "no-such-model"
    before = server.requests_total(tag or "single")
    got, answer = post(server.url, f"/v2/models/{name}/infer", data, headers)
    assert (got, list(answer)) == (status, ["error"]) and says in answer["error"], answer
    assert server.requests_total(tag or "single") == before  # nothing reached the engine
    result = server.client().infer(server.names["single"], [tensor("INPUT", X[None])])
    assert np.array_equal(result.as_numpy("OUTPUT"), X[None] * 2 + 1)


def test_a_declared_size_over_the_limit_is_refused_before_the_body_is_sent(server):
    host, port = server.url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest("POST", f"/v2/models/{server.names['single']}/infer")
        conn.putheader("Content-Length", str(1 << 40))
        conn.endheaders()  # and not one byte of the terabyte it declares
        response = conn.getresponse()
        assert response.status == 413
        assert f"at most {MAX_BODY_BYTES} bytes" in json.loads(response.read())["error"]
    finally:
        conn.close()


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v2/models/{single}/infer", 405), ("POST", "/v2/models/{single}", 405),
    ("GET", "/v2/models/{single}/versions/2", 404), ("GET", "/v1/models", 404),
])
def test_a_wrong_route_or_method_is_refused_by_name(server, method, path, status):
    got, answer = post(server.url, path.format(**server.names), b"", {}, method)
    assert got == status and list(answer) == ["error"]


def test_sigterm_with_requests_in_flight_answers_them_or_fails_them_typed(tmp_path):
    name = unique_name("term")
    s = Served(tmp_path, table(name, backend="helpers:slow_affine",
                               backend_args={"fixed_ms": 30.0}, max_batch_size=2, **FIXED),
               "--http-port", "0", "--http-workers", "2")
    seg = Segment.attach(name, header_only=True)

    async def run():
        c = triton_aio.InferenceServerClient(s.url)
        try:
            calls = [asyncio.create_task(c.infer(name, [tensor("INPUT", (X + k)[None])]))
                     for k in range(16)]
            await asyncio.to_thread(wait_for, lambda: seg.ring.word(codes.W_REQUESTS) >= 16,
                                    "16 requests queued")
            s.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*calls, return_exceptions=True)
        finally:
            await c.close()

    try:
        results = asyncio.run(run())
    finally:
        seg.close()
        rc = s.stop()
    assert rc == 0, s.stderr()
    for k, result in enumerate(results):
        if isinstance(result, InferenceServerException):
            assert result.status() == "503", result
        else:
            assert np.array_equal(result.as_numpy("OUTPUT"), (X + k)[None] * 2 + 1)
    assert not [e for e in shm_entries() if name in e]


def events(response) -> list:
    """The server-sent events of a response, each one's JSON."""
    text = response.read().decode()
    assert response.getheader("content-type") == "text/event-stream"
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n") if e]


def open_post(url: str, path: str, request: dict):
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, body=json.dumps(request).encode())
    return conn, conn.getresponse()


def test_generate_answers_the_whole_answer_and_generate_stream_each_chunk_as_an_event(server):
    n = server.names
    got, answer = post(server.url, f"/v2/models/{n['gen']}/generate",
                       json.dumps({"INPUT": [10, 5], "id": "a"}).encode(), {})
    assert (got, answer) == (200, {"model_name": n["gen"], "model_version": "1", "id": "a",
                                   "OUTPUT": [10, 11, 12, 13, 14], "finish_reason": "stop"})
    got, answer = post(server.url, f"/v2/models/{n['gen']}/generate",
                       json.dumps({"INPUT": [10, 5], "parameters": {"max_steps": 3}}).encode(), {})
    assert answer["OUTPUT"] == [10, 11, 12]  # the request's own max_steps
    assert answer["finish_reason"] == "length"
    conn, response = open_post(server.url, f"/v2/models/{n['gen']}/generate_stream",
                               {"INPUT": [7, 4]})
    try:
        assert response.status == 200
        assert [e["OUTPUT"] for e in events(response)] == [7, 8, 9, 10]
    finally:
        conn.close()
    # a one-shot engine answers both with its one answer
    got, answer = post(server.url, f"/v2/models/{n['single']}/generate",
                       json.dumps({"INPUT": X.tolist()}).encode(), {})
    assert answer["OUTPUT"] == (X * 2 + 1).tolist()
    conn, response = open_post(server.url, f"/v2/models/{n['single']}/generate_stream",
                               {"INPUT": X.tolist()})
    try:
        assert [e["OUTPUT"] for e in events(response)] == [(X * 2 + 1).tolist()]
    finally:
        conn.close()


@pytest.mark.parametrize("path, request_, says", [
    ("infer", {"inputs": []}, "is iterative: expected POST"),
    ("generate", {"INPUT": [1, 2], "extra": 3}, "expected keys ['INPUT']"),
    ("generate", {"INPUT": [1.5, 2]}, "expected 2 integers (INT64[2])"),
    ("generate", {"INPUT": [1, 2, 3]}, "InvalidInput: expected int64[2], got int64[3]"),
    ("generate_stream", {"INPUT": [1, 2], "parameters": {"max_steps": 0}},
     "max_steps: expected an integer >= 1, got 0"),
])
def test_a_bad_generate_gets_a_400_naming_what_was_expected(server, path, request_, says):
    got, answer = post(server.url, f"/v2/models/{server.names['gen']}/{path}",
                       json.dumps(request_).encode(), {})
    assert got == 400 and says in answer["error"], answer


def test_a_stream_past_its_timeout_ends_with_a_typed_error_after_the_chunks_in_time(server):
    conn, response = open_post(server.url, f"/v2/models/{server.names['endless']}/"
                               "generate_stream", {"INPUT": [0, 0],
                                                   "parameters": {"timeout": 500_000}})
    try:
        if response.status != 200:  # expired before its first chunk: an ordinary error
            assert response.status == 504
            return
        *chunks, last = events(response)
        assert [c["OUTPUT"] for c in chunks] == list(range(len(chunks)))
        assert last.keys() == {"error"} and last["error"].startswith("RequestTimeout")
    finally:
        conn.close()


def test_a_caller_that_disconnects_from_a_stream_withdraws_its_request(server):
    conn, response = open_post(server.url, f"/v2/models/{server.names['endless']}/"
                               "generate_stream", {"INPUT": [0, 0],  # never done by itself
                                                   "parameters": {"timeout": 600_000_000}})
    try:
        assert response.status == 200
        assert response.fp.readline()  # the first chunk came: the request runs
    finally:
        conn.close()
    # withdrawn at the batcher's next step (its own end is 65536 steps of 20 ms away)
    wait_for(lambda: server.stats("endless")["active"] == 0, "the request withdrawn")
