"""`serve --metrics-compat vllm,triton`: a live engine's /metrics carries
vLLM's and Triton's families, named, typed and labelled as their servers
write them, from the engine's own figures."""
import json
import os
import signal
import urllib.request

import numpy as np
import pytest
from conftest import unique_name, wait_for
from test_sidecar import Serve, free_port, shmbatch

import engine

X = np.arange(16, dtype=np.float32)
VLLM = {"vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram"}
TRITON = {"nv_inference_request_success": "counter", "nv_inference_request_failure": "counter",
          "nv_inference_count": "counter", "nv_inference_exec_count": "counter",
          "nv_inference_request_duration_us": "counter",
          "nv_inference_queue_duration_us": "counter",
          "nv_inference_compute_infer_duration_us": "counter",
          "nv_inference_pending_request_count": "gauge"}


class Served:
    def __init__(self, *flags, backend="helpers:affine"):
        self.port = free_port()
        self.serve = Serve(unique_name("compat"), "--metrics-port", str(self.port), *flags,
                           backend=backend)
        self.name = self.serve.name
        self.sent = 0

    def send(self, n: int) -> None:
        with engine.Client(self.name) as c:
            for k in range(n):
                assert np.array_equal(c.infer(X + k, timeout=10), (X + k) * 2 + 1)
        self.sent += n

    def text(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics",
                                      timeout=10).read().decode()

    def families(self) -> dict:
        """{family name: (type, [(sample name, labels, value)])}, as Prometheus' own
        parser reads the page (strict: a malformed line raises)."""
        from prometheus_client.parser import text_string_to_metric_families
        return {f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
                for f in text_string_to_metric_families(self.text())}

    def value(self, sample: str, **labels) -> float:
        found = [v for _, samples in self.families().values()
                 for name, got, v in samples
                 if name in (sample, sample + "_total") and got == labels]  # the parser's
        assert len(found) == 1, (sample, labels, found)
        return found[0]


@pytest.fixture(scope="module")
def compat():
    s = Served("--metrics-compat", "vllm,triton")
    yield s
    assert s.serve.stop() == 0


@pytest.fixture(scope="module")
def plain():
    s = Served()
    yield s
    assert s.serve.stop() == 0


def type_lines(text: str) -> dict:
    return {line.split()[2]: line.split()[3] for line in text.splitlines()
            if line.startswith("# TYPE ")}


def test_each_family_is_typed_once_as_its_server_types_it(compat):
    compat.send(3)
    text = compat.text()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    declared = type_lines(text)
    for name, kind in {**VLLM, **TRITON}.items():
        assert declared.get(name) == kind, (name, declared.get(name))
    # Triton's counters are written bare, as Triton writes them (no _total sample)
    samples = {line.split("{")[0] for line in text.splitlines() if not line.startswith("#")}
    assert {n for n, k in TRITON.items() if k == "counter"} <= samples
    assert not any(s.startswith("nv_") and s.endswith("_total") for s in samples)
    parsed = compat.families()
    for name, kind in VLLM.items():
        assert parsed[name][0] == kind


def test_labels_are_model_name_for_vllm_and_model_version_for_triton(compat):
    compat.send(1)
    parsed = compat.families()
    for name in VLLM:
        for sample, labels, _ in parsed[name][1]:
            assert set(labels) - {"le"} == {"model_name"}, (sample, labels)
            assert labels["model_name"] == compat.name
    for name in TRITON:
        for sample, labels, _ in parsed[name][1]:
            want = {"model", "version", "reason"} if name.endswith("failure") \
                else {"model", "version"}
            assert set(labels) == want, (sample, labels)
            assert labels["model"] == compat.name and labels["version"] == "1"
    reasons = {labels["reason"] for _, labels, _ in parsed["nv_inference_request_failure"][1]}
    assert reasons == {"REJECTED", "CANCELED", "BACKEND", "OTHER"}


def test_after_n_requests_the_counts_equal_n(compat):
    compat.send(7)
    n = compat.sent
    # a batch's figures are recorded just after its answers: wait for them
    wait_for(lambda: compat.value("vllm:e2e_request_latency_seconds_count",
                                  model_name=compat.name) == n, "the e2e count", 10)
    model = {"model": compat.name, "version": "1"}
    assert compat.value("nv_inference_request_success", **model) == n
    assert compat.value("nv_inference_count", **model) == n
    assert 1 <= compat.value("nv_inference_exec_count", **model) <= n
    for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
        assert compat.value("nv_inference_request_failure", reason=reason, **model) == 0
    for family in ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds"):
        assert compat.value(family + "_count", model_name=compat.name) == n
        assert compat.value(family + "_bucket", model_name=compat.name, le="+Inf") == n
    # a request's queue wait and its time in the backend are parts of its whole time
    whole = compat.value("nv_inference_request_duration_us", **model)
    parts = (compat.value("nv_inference_queue_duration_us", **model)
             + compat.value("nv_inference_compute_infer_duration_us", **model))
    assert 0 < parts <= whole + 2 * n  # each rounded down to a microsecond


def test_the_gauges_read_zero_when_idle(compat):
    compat.send(2)
    assert compat.value("vllm:num_requests_waiting", model_name=compat.name) == 0
    assert compat.value("vllm:num_requests_running", model_name=compat.name) == 0
    assert compat.value("nv_inference_pending_request_count", model=compat.name,
                        version="1") == 0


def test_the_gauges_count_the_requests_queued_and_in_a_batch(gate):
    held = Served("--metrics-compat", "vllm,triton", "--max-batch-size", "1",
                  "--backend-arg", f"gate={gate.name}", backend="helpers:gated")
    try:
        def gauges():
            return (held.value("vllm:num_requests_waiting", model_name=held.name),
                    held.value("vllm:num_requests_running", model_name=held.name),
                    held.value("nv_inference_pending_request_count", model=held.name,
                               version="1"))
        with engine.Client(held.name) as c:
            futures = [c.submit(X + k, timeout=60) for k in range(4)]
            # the first batch (one request) waits for the gate, the other three queue
            wait_for(lambda: gauges()[:2] == (3, 1), "three queued and one in its batch", 60)
            assert gauges()[2] == 3  # Triton's pending: those awaiting execution
            gate.open()
            for k, f in enumerate(futures):
                assert np.array_equal(f.result(60), (X + k) * 2 + 1)
        wait_for(lambda: gauges() == (0, 0, 0), "the gauges back to 0", 60)
    finally:
        gate.open()
        assert held.serve.stop() == 0


def test_the_counters_go_on_across_a_batcher_restart(compat):
    compat.send(2)
    status = json.loads(shmbatch("status", compat.name, "--json").stdout)
    [old] = status["batcher_pids"]
    os.kill(old, signal.SIGKILL)

    def replaced() -> bool:
        pids = json.loads(shmbatch("status", compat.name, "--json").stdout)["batcher_pids"]
        return len(pids) == 1 and pids[0] != old
    wait_for(replaced, "a new batcher", 60, every_s=0.05)
    compat.send(3)
    model = {"model": compat.name, "version": "1"}
    wait_for(lambda: compat.value("nv_inference_count", **model) == compat.sent,
             "the inference count", 10)
    assert compat.value("nv_inference_request_success", **model) == compat.sent


def test_without_the_flag_none_of_them_appear(plain):
    plain.send(2)
    text = plain.text()
    assert "shmbatch_requests_total" in text
    assert "vllm:" not in text and "nv_inference" not in text


@pytest.mark.parametrize("flags, expected", [
    (("--metrics-port", "0", "--metrics-compat", "vllm,tgi"), "'tgi'"),
    (("--metrics-compat", "triton"), "expected --metrics-port"),
])
def test_a_bad_metrics_compat_is_refused_naming_it(flags, expected):
    out = shmbatch("serve", "--name", unique_name("badcompat"), "--backend", "helpers:affine",
                   "--input-shape", "16", "--output-shape", "16", *flags)
    assert out.returncode != 0 and expected in out.stderr, out.stderr
