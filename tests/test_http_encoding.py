"""Compressed request bodies on `shmbatch serve --http-port`: Content-Encoding gzip and
deflate are decoded within the body limit, for every POST route (the Open Inference
Protocol's and OpenAI's), as tritonclient sends them (request_compression_algorithm, with
binary tensor data after an uncompressed JSON length); a body that inflates past the limit
is refused 413 before the rest of it comes, any other coding 415, a broken stream 400."""
import asyncio
import gzip
import http.client
import json
import zlib

import numpy as np
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("openai")
triton = pytest.importorskip("tritonclient.http")
import tritonclient.http.aio as triton_aio  # noqa: E402
from conftest import shm_entries  # noqa: E402
from openai_served import EMBED, serve  # noqa: E402

MAX_BODY_BYTES = 1 << 20
BYTES = {"tokenizer": "openai_models:bytes_tokenizer"}
AFFINE = dict(backend="helpers:affine", input_shape=[4], output_shape=[4], max_batch_size=8)
X = np.arange(8, dtype=np.float32).reshape(2, 4) / 4
COMPRESS = {"gzip": gzip.compress, "deflate": zlib.compress}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    s = serve(tmp_path_factory.mktemp("encoding"),
              {"affine": (AFFINE, None), "vectors": (EMBED, BYTES)},
              http_max_body_bytes=MAX_BODY_BYTES)
    yield s
    assert s.stop() == 0, s.stderr()
    assert "Traceback" not in s.stderr()
    assert not [e for e in shm_entries() if any(n in e for n in s.names.values())]


def post(served, path: str, data: bytes, headers: dict):
    """(status, headers, JSON answer) of one POST of data as it is."""
    host, port = served.url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json",
                                                       **headers})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        conn.close()


def infer_body(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT", "shape": list(x.shape), "datatype": "FP32",
                                   "data": x.ravel().tolist()}]}).encode()


def given(module, x: np.ndarray, binary: bool):
    t = module.InferInput("INPUT", list(x.shape), "FP32")
    t.set_data_from_numpy(x, binary_data=binary)
    return t


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_tritonclients_compressed_infers_are_answered(served, coding, binary):
    name = served.names["affine"]
    client = triton.InferenceServerClient(served.url)
    got = client.infer(name, [given(triton, X, binary)], request_compression_algorithm=coding)
    np.testing.assert_array_equal(got.as_numpy("OUTPUT"), X * 2 + 1)


def test_tritonclients_aio_gzip_infers_are_each_answered(served):
    name = served.names["affine"]

    async def main():
        client = triton_aio.InferenceServerClient(served.url)
        try:
            xs = [X + k for k in range(8)]
            got = await asyncio.gather(*(client.infer(
                name, [given(triton_aio, x, k % 2 == 0)], request_compression_algorithm="gzip")
                for k, x in enumerate(xs)))
            return xs, got
        finally:
            await client.close()
    xs, answers = asyncio.run(main())
    for x, got in zip(xs, answers):
        np.testing.assert_array_equal(got.as_numpy("OUTPUT"), x * 2 + 1)


@pytest.mark.parametrize("coding", ["identity", "gzip", "deflate", "x-gzip", "GZIP, identity"])
def test_each_coding_taken_answers_as_the_plain_body_does(served, coding):
    name = served.names["affine"]
    compress = COMPRESS.get(coding.split(",")[0].strip().lower().replace("x-", ""), bytes)
    status, _, got = post(served, f"/v2/models/{name}/infer", compress(infer_body(X)),
                          {"Content-Encoding": coding})
    assert status == 200, got
    assert got["outputs"][0]["data"] == (X * 2 + 1).ravel().tolist()


def test_an_openai_route_takes_a_gzip_body_and_answers_as_for_the_plain_one(served):
    request = json.dumps({"model": "vectors", "input": "héllo"}).encode()
    plain = post(served, "/v1/embeddings", request, {})
    zipped = post(served, "/v1/embeddings", gzip.compress(request), {"Content-Encoding": "gzip"})
    assert plain[0] == zipped[0] == 200, zipped
    assert zipped[2]["data"] == plain[2]["data"]


@pytest.mark.parametrize("path", ["/v2/models/{affine}/infer", "/v1/embeddings"])
def test_a_coding_not_taken_is_415_saying_which_are(served, path):
    status, headers, got = post(served, path.format(**served.names), b"\x00" * 64,
                                {"Content-Encoding": "br"})
    assert status == 415
    message = got["error"] if isinstance(got["error"], str) else got["error"]["message"]
    assert "Content-Encoding: expected identity, gzip or deflate, got 'br'" in message
    assert headers.get("accept-encoding") == "gzip, deflate"


@pytest.mark.parametrize("broken, says", [
    (b"not gzip at all", "got bytes that do not decode"),
    (gzip.compress(b'{"inputs": []}')[:-6], "got one cut short"),
    (gzip.compress(b"{}") + b"trailing", "got data after its end"),
])
def test_a_stream_that_does_not_decode_is_a_400(served, broken, says):
    status, _, got = post(served, f"/v2/models/{served.names['affine']}/infer", broken,
                          {"Content-Encoding": "gzip"})
    assert status == 400 and says in got["error"], got


def test_a_body_inflating_past_the_limit_is_413_before_the_rest_of_it_comes(served):
    # 4 MiB of zeros, compressed to a few KiB: the first part alone inflates past 1 MiB
    bomb = zlib.compress(b"0" * (4 * MAX_BODY_BYTES), 9)
    head = bomb[:len(bomb) // 2]
    assert len(head) < 64 << 10 and len(zlib.decompressobj().decompress(head)) > MAX_BODY_BYTES
    host, port = served.url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest("POST", f"/v2/models/{served.names['affine']}/infer")
        for key, value in (("Content-Type", "application/json"), ("Content-Encoding", "deflate"),
                           ("Content-Length", str(len(bomb)))):
            conn.putheader(key, value)
        conn.endheaders()
        conn.send(head)  # the rest is never sent: the answer comes without it
        response = conn.getresponse()
        got = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 413
    assert f"expected a body of at most {MAX_BODY_BYTES} bytes" in got["error"]
    assert "once decoded from deflate, got more" in got["error"]


def test_a_compressed_body_declared_past_the_wire_limit_is_413_before_it_is_read(served):
    status, _, got = post(served, f"/v2/models/{served.names['affine']}/infer",
                          b"\x1f\x8b", {"Content-Encoding": "gzip",
                                        "Content-Length": str(4 * MAX_BODY_BYTES)})
    assert status == 413 and "expected a gzip body of at most" in got["error"], got
