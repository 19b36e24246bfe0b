"""`shmbatch manifest kubernetes --autoscaler keda --autoscaler-metric NAME`:
a ScaledObject on a vLLM or Triton family of `serve --metrics-compat`, summed
over this Deployment's pods and engines, that passes KEDA's CRD schema; the
pod's serve writes that family, and a name no family carries is refused."""
import re
import signal
import subprocess
import sys
import urllib.request

import pytest
from conftest import shm_entries, unique_name, wait_for_line
from manifest_helpers import (KUBERNETES_VERSIONS, by_kind, crd_validate, k8s_validate, manifest,
                              run, serve_container, write_config)
from test_sidecar import ENV, free_port

SYNTHETIC = {"backend": '"engine.backends:synthetic"', "input_shape": "[4]",
             "output_shape": "[4]"}
ENGINES = {'"chat.v1"': SYNTHETIC, "embed": SYNTHETIC}  # '.' is a regex character


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path / "models.toml", ENGINES, http_port=8000, metrics_port=9100)


def keda(config, metric, *extra) -> dict:
    return by_kind(manifest("kubernetes", "--config", config, "--image", "i", "--name", "web",
                            "--autoscaler", "keda", "--autoscaler-metric", metric, *extra))


def trigger(kinds: dict) -> dict:
    (one,) = kinds["ScaledObject"]["spec"]["triggers"]
    return one


def flag(container: dict, name: str) -> str:
    args = container["args"]
    return args[args.index(name) + 1]


@pytest.mark.parametrize("metric", ["vllm:num_requests_waiting", "nv_inference_queue_duration_us",
                                    "vllm:time_to_first_token_seconds"])
def test_the_scaled_object_and_the_deployment_pass_their_schemas(config, metric):
    kinds = keda(config, metric, "--autoscaler-threshold", 4)
    crd_validate(kinds["ScaledObject"], "keda_scaledobject.json")
    for version in KUBERNETES_VERSIONS:
        k8s_validate(kinds["Deployment"], version)


def test_a_gauge_is_summed_over_the_pods_engines_and_held_per_pod(config):
    kinds = keda(config, "vllm:num_requests_waiting", "--autoscaler-threshold", 5,
                 "--namespace", "ml")
    t = trigger(kinds)
    assert t["type"] == "prometheus" and t["metricType"] == "AverageValue"  # sum / replicas
    assert t["metadata"]["threshold"] == "5"
    assert t["metadata"]["query"] == (
        'sum(vllm:num_requests_waiting{model_name=~"chat\\\\.v1|embed",'
        'pod=~"web-[a-z0-9]+-[a-z0-9]{5}",namespace="ml"})')
    assert kinds["ScaledObject"]["spec"]["scaleTargetRef"]["name"] == \
        kinds["Deployment"]["metadata"]["name"]


def test_triton_families_are_matched_by_their_model_label(tmp_path):
    path = write_config(tmp_path / "one.toml", {"embed": SYNTHETIC}, http_port=8000)
    t = trigger(keda(path, "nv_inference_pending_request_count", "--autoscaler-threshold", 2.5))
    assert t["metadata"]["query"] == ('sum(nv_inference_pending_request_count{model="embed",'
                                      'pod=~"web-[a-z0-9]+-[a-z0-9]{5}"})')
    assert t["metadata"]["threshold"] == "2.5"


def test_a_histogram_is_held_at_its_p90_and_a_counter_at_its_rate(config):
    t = trigger(keda(config, "vllm:e2e_request_latency_seconds", "--autoscaler-threshold", 0.25))
    assert t["metricType"] == "Value"  # a quantile is not divided among the pods
    assert t["metadata"]["query"].startswith(
        "histogram_quantile(0.9, sum by (le) (rate(vllm:e2e_request_latency_seconds_bucket{")
    assert t["metadata"]["threshold"] == "0.25"
    t = trigger(keda(config, "nv_inference_request_success", "--autoscaler-threshold", 100))
    assert t["metricType"] == "AverageValue"
    assert t["metadata"]["query"].startswith("sum(rate(nv_inference_request_success{model=~")


def test_serve_gets_the_metrics_compat_kind_beside_the_configs_own(tmp_path):
    path = write_config(tmp_path / "m.toml", ENGINES, http_port=8000, metrics_compat='"triton"')
    kinds = keda(path, "vllm:num_requests_running", "--autoscaler-threshold", 8)
    serve = serve_container(kinds["Deployment"])
    assert flag(serve, "--metrics-compat") == "vllm,triton"  # the flag overrides the key
    assert flag(serve, "--metrics-port") == "9090"  # the page the trigger's series are on
    annotations = kinds["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9090"


def test_shmbatchs_own_metric_adds_no_compat_names(config):
    kinds = by_kind(manifest("kubernetes", "--config", config, "--image", "i",
                             "--autoscaler", "keda"))
    assert "--metrics-compat" not in serve_container(kinds["Deployment"])["args"]
    assert trigger(kinds)["metadata"]["query"].startswith(
        "histogram_quantile(0.9, sum by (le) (rate(shmbatch_queue_wait_seconds_bucket{")


@pytest.mark.parametrize("case", ["unknown vllm name", "unknown triton name", "unknown name",
                                  "no threshold", "threshold of own metric", "wait of compat",
                                  "hpa", "no such engine"])
def test_a_metric_or_threshold_that_does_not_fit_is_refused_in_one_line(config, case):
    extra = {
        "unknown vllm name": ["--autoscaler-metric", "vllm:num_requests_swapped",
                              "--autoscaler-threshold", 1],
        "unknown triton name": ["--autoscaler-metric", "nv_gpu_utilization",
                                "--autoscaler-threshold", 1],
        "unknown name": ["--autoscaler-metric", "queue_depth", "--autoscaler-threshold", 1],
        "no threshold": ["--autoscaler-metric", "vllm:num_requests_waiting"],
        "threshold of own metric": ["--autoscaler-threshold", 1],
        "wait of compat": ["--autoscaler-metric", "vllm:num_requests_waiting",
                           "--autoscaler-threshold", 1, "--target-queue-wait-ms", 5],
        "hpa": ["--autoscaler-metric", "vllm:num_requests_waiting"],
        "no such engine": ["--autoscaler-metric", "vllm:generation_tokens_total",
                           "--autoscaler-threshold", 1],
    }[case]
    scaler = "hpa" if case == "hpa" else "keda"
    code, out, err = run("kubernetes", "--config", config, "--image", "i",
                         "--autoscaler", scaler, *extra)
    assert code != 0 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("shmbatch manifest"), err
    expected = {
        "unknown vllm name": ["'vllm:num_requests_swapped'", "vllm:num_requests_waiting"],
        "unknown triton name": ["'nv_gpu_utilization'", "nv_inference_pending_request_count"],
        "unknown name": ["'queue_depth'", "shmbatch_queue_wait_seconds",
                         "vllm:num_requests_waiting", "nv_inference_pending_request_count"],
        "no threshold": ["--autoscaler-threshold"], "threshold of own metric":
            ["--target-queue-wait-ms"], "wait of compat": ["--autoscaler-threshold"],
        "hpa": ["--autoscaler keda"], "no such engine": ["iterative"],
    }[case]
    for word in expected:
        assert word in err
    if case == "unknown vllm name":  # the vLLM set's names, not Triton's
        assert "nv_inference" not in err


def selected(query: str):
    """(metric, {label: regex}) of the query's selector, the pod and namespace
    matchers left out (Prometheus adds those labels as it scrapes)."""
    found = re.search(r"([a-z_:]+)\{(.*?)\}", query)
    matchers = re.findall(r'(\w+)(=~|=)"((?:[^"\\]|\\.)*)"', found[2])
    labels = {k: (v.replace("\\\\", "\\") if op == "=~" else re.escape(v))
              for k, op, v in matchers if k not in ("pod", "namespace")}
    return found[1], labels


@pytest.mark.parametrize("metric", ["vllm:num_requests_waiting",
                                    "nv_inference_pending_request_count"])
def test_the_pods_serve_writes_the_series_the_trigger_queries(tmp_path, metric):
    names = [unique_name("keda") + ".v1", unique_name("keda")]
    tables = {f'"{n}"': {"backend": '"engine.backends:identity"', "input_shape": "[4]",
                         "output_shape": "[4]"} for n in names}
    path = write_config(tmp_path / "models.toml", tables)
    kinds = keda(path, metric, "--autoscaler-threshold", 3, "--app-image", "reg/app:1")
    args = serve_container(kinds["Deployment"])["args"]
    port = free_port()  # the pod's args, on this host: its config file, a free port
    args[args.index("--config") + 1] = str(path)
    args[args.index("--metrics-port") + 1] = str(port)
    args[args.index("--metrics-host") + 1] = "127.0.0.1"
    proc = subprocess.Popen([sys.executable, "-m", "engine", *args], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc.stdout, "ready")
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:  # never an orphan
            proc.kill()
            code = proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    assert code == 0
    from prometheus_client.parser import text_string_to_metric_families
    family, labels = selected(trigger(kinds)["metadata"]["query"])
    samples = [s for f in text_string_to_metric_families(page.decode()) for s in f.samples
               if s.name == family]
    matched = [s for s in samples
               if all(re.fullmatch(rx, s.labels.get(k, "")) for k, rx in labels.items())]
    engine_label = "model_name" if metric.startswith("vllm:") else "model"
    assert sorted(s.labels[engine_label] for s in matched) == sorted(names)
    assert not [e for e in shm_entries() if any(n in e for n in names)]
