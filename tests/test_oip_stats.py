"""Triton's statistics extension on `shmbatch serve --http-port` (GET /v2/models/NAME/stats,
/v2/models/stats), driven by tritonclient.http and tritonclient.http.aio: after N infers
the counts are N, the executions the engine's batches, read from the engine's segment
whichever of the two HTTP workers answers."""
import asyncio
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytest.importorskip("uvicorn")
triton = pytest.importorskip("tritonclient.http")
import tritonclient.http.aio as triton_aio  # noqa: E402
from conftest import engine_word, shm_entries, unique_name, wait_for  # noqa: E402
from test_multi_engine import Served, table, top  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from engine.shm import codes  # noqa: E402

N = 24
DURATIONS = {"success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss"}
MODEL_STAT = {"name", "version", "last_inference", "inference_count", "execution_count",
              "inference_stats", "batch_stats"}
AFFINE = dict(backend="helpers:affine", input_shape=[4], output_shape=[4], max_batch_size=8)
STEPS = dict(input_shape=[2], input_dtype="int64", output_shape=[], output_dtype="int64")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    names = {tag: unique_name(tag) for tag in ("sync", "aio", "idle", "gen")}
    serve = Served(tmp_path_factory.mktemp("stats"),
                   top(http_workers=2)
                   + table(names["sync"], **AFFINE) + table(names["aio"], **AFFINE)
                   + table(names["idle"], **AFFINE)
                   + table(names["gen"], backend="serve_backends:counting", iterative=True,
                           max_steps=64, **STEPS),
                   "--http-port", "0")
    serve.names = names
    yield serve
    assert serve.stop() == 0, serve.stderr()
    assert "Traceback" not in serve.stderr()
    assert not [e for e in shm_entries() if any(n in e for n in names.values())]


def get(served, path: str):
    try:
        with urllib.request.urlopen(f"http://{served.url}{path}", timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def batches_total(engine: str) -> int:
    return engine_word(engine, codes.W_BATCHES)


def settled(fetch, n: int) -> dict:
    """The model's stats once all n requests are counted: a request's answer
    can reach its caller a moment before its batch's figures are added."""
    got = {}

    def counted():
        got.update(fetch()["model_stats"][0])
        s = got["inference_stats"]
        return s["success"]["count"] >= n and s["compute_infer"]["count"] >= n
    wait_for(counted, f"{n} requests counted in the statistics", timeout_s=30)
    return got


def affine_input(i: int) -> np.ndarray:
    return np.full((1, 4), i, np.float32) + np.arange(4, dtype=np.float32)


def check_counts(stat: dict, name: str, n: int, started_ms: int) -> None:
    s = stat["inference_stats"]
    assert (stat["name"], stat["version"]) == (name, "1")
    assert stat["inference_count"] == s["success"]["count"] == n
    assert s["compute_infer"]["count"] == s["queue"]["count"] == n
    assert s["fail"]["count"] == 0
    # every call the engine made, as its segment counts them, and by size
    executions = batches_total(name)
    assert 1 <= stat["execution_count"] == executions <= n
    sizes = stat["batch_stats"]
    assert sum(b["compute_infer"]["count"] for b in sizes) == executions
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in sizes) == n
    assert all(1 <= b["batch_size"] <= 8 for b in sizes)
    assert sum(b["compute_infer"]["ns"] for b in sizes) > 0
    # a request's time from arrival to its answer holds its wait and its time in the batch
    assert s["success"]["ns"] >= max(s["queue"]["ns"], s["compute_infer"]["ns"])
    assert s["compute_infer"]["ns"] > 0
    assert started_ms <= stat["last_inference"] <= time.time() * 1000 + 1


def test_sync_infers_are_each_counted_and_their_batches_are_the_executions(served):
    name = served.names["sync"]
    client = triton.InferenceServerClient(served.url)
    started_ms = int(time.time() * 1000)
    for i in range(N):
        x = affine_input(i)
        given = triton.InferInput("INPUT", [1, 4], "FP32")
        given.set_data_from_numpy(x)
        answer = client.infer(name, [given]).as_numpy("OUTPUT")
        np.testing.assert_array_equal(answer, x * 2 + 1)
    stat = settled(lambda: client.get_inference_statistics(name), N)
    check_counts(stat, name, N, started_ms)
    assert set(stat) == MODEL_STAT and set(stat["inference_stats"]) == DURATIONS


def test_concurrent_aio_infers_batch_together_and_are_each_counted(served):
    name = served.names["aio"]

    async def main():
        client = triton_aio.InferenceServerClient(served.url)
        try:
            async def one(i):
                x = affine_input(i)
                given = triton_aio.InferInput("INPUT", [1, 4], "FP32")
                given.set_data_from_numpy(x)
                answer = (await client.infer(name, [given])).as_numpy("OUTPUT")
                np.testing.assert_array_equal(answer, x * 2 + 1)
            await asyncio.gather(*(one(i) for i in range(N)))
            deadline = time.monotonic() + 30
            while True:  # bounded: the figures of the last batch land just after its answers
                stat = (await client.get_inference_statistics(name))["model_stats"][0]
                s = stat["inference_stats"]
                if (s["success"]["count"] >= N and s["compute_infer"]["count"] >= N
                        or time.monotonic() > deadline):
                    return stat
                await asyncio.sleep(0.01)
        finally:
            await client.close()
    started_ms = int(time.time() * 1000)
    check_counts(asyncio.run(main()), name, N, started_ms)


def test_an_engine_never_asked_shows_zeros_in_tritons_shape(served):
    name = served.names["idle"]
    status, got = get(served, f"/v2/models/{name}/versions/1/stats")
    assert status == 200
    (stat,) = got["model_stats"]
    assert set(stat) == MODEL_STAT and stat["batch_stats"] == []
    assert (stat["last_inference"], stat["inference_count"], stat["execution_count"]) == (0, 0, 0)
    assert stat["inference_stats"] == {k: {"count": 0, "ns": 0} for k in DURATIONS}


def test_an_iterative_engines_stream_is_one_inference_and_its_steps_the_executions(served):
    name = served.names["gen"]
    request = json.dumps({"INPUT": [5, 3]}).encode()  # counts 5, 6, 7: three steps
    with urllib.request.urlopen(urllib.request.Request(
            f"http://{served.url}/v2/models/{name}/generate", data=request,
            method="POST"), timeout=60) as response:
        assert json.loads(response.read())["OUTPUT"] == [5, 6, 7]
    stat = settled(lambda: get(served, f"/v2/models/{name}/stats")[1], 1)
    assert stat["inference_count"] == stat["inference_stats"]["success"]["count"] == 1
    assert stat["execution_count"] == batches_total(name) == 3
    assert stat["batch_stats"][0]["batch_size"] == 1


def test_every_model_is_listed_by_the_servers_stats(served):
    status, got = get(served, "/v2/models/stats")
    assert status == 200
    assert sorted(s["name"] for s in got["model_stats"]) == sorted(served.names.values())
    assert all(set(s) == MODEL_STAT for s in got["model_stats"])
    _, metadata = get(served, "/v2")
    assert "statistics" in metadata["extensions"]


def test_an_unknown_model_or_version_is_404_in_tritons_words(served):
    client = triton.InferenceServerClient(served.url)
    with pytest.raises(InferenceServerException) as refused:
        client.get_inference_statistics("no-such-model")
    message = str(refused.value)
    assert "Request for unknown model: 'no-such-model' is not found" in message
    assert served.names["sync"] in message  # the helpful tail: the models it has
    status, got = get(served, f"/v2/models/{served.names['sync']}/versions/2/stats")
    assert status == 404 and "expected version 1, got 2" in got["error"]
