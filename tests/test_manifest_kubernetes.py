"""`shmbatch manifest kubernetes`: objects that pass Kubernetes' own schemas
and the KEDA CRD's, carrying the numbers shmbatch knows from the config: the
/dev/shm that holds every segment, memory that counts it, readiness on every
engine, a grace period past the drain, and an autoscaler on queue wait."""
import contextlib
import dataclasses
import io
import math
import shlex
import tomllib

import pytest
from conftest import unique_name
from manifest_helpers import (KUBERNETES_VERSIONS, MIB, by_kind, crd_validate, k8s_validate,
                              manifest, quantity_bytes, run, run_process, serve_container,
                              shm_volume, write_config, yaml)

import engine
from engine.cli import commands
from engine.config import EngineConfig
from engine.segment import Segment
from engine.shm import sizing


def table(**keys) -> dict:
    """An engine's table (TOML values as text) on the synthetic backend."""
    return {"backend": '"engine.backends:synthetic"', **keys}


ENGINES = {  # two engines, unlike in every knob the sizes depend on
    "digits": table(input_shape="[784]", output_shape="[10]", queue_capacity=1024, instances=2,
                    drain_timeout_s=20.0),
    "tokens": table(input_shape='["none"]', max_input_shape="[512]", input_dtype='"int64"',
                    output_shape="[4]", queue_capacity=256, priority_levels=3,
                    drain_timeout_s=45.0),
}


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path / "models.toml", ENGINES, http_port=8000, metrics_port=9100)


@pytest.fixture
def no_http(tmp_path):
    return write_config(tmp_path / "local.toml", ENGINES)


def real_segment_bytes(table: dict) -> int:
    """The bytes a segment of the table's settings commits, as stats()["segment_bytes"]
    reports them: one is made, measured and removed."""
    keys = tomllib.loads("\n".join(f"{k} = {v}" for k, v in table.items()))
    keys = {k: v for k, v in keys.items() if k in {f.name for f in dataclasses.fields(EngineConfig)}}
    seg = Segment.create(EngineConfig(name=unique_name("size"), **keys))
    try:
        return seg.total_bytes
    finally:
        seg.close()
        seg.unlink()


@pytest.mark.parametrize("extra", [
    ["--autoscaler", "hpa"],
    ["--autoscaler", "keda", "--app-image", "reg/app:1", "--app-command", "gunicorn app:app"],
    ["--api-key-secret", "shmbatch-key"],
], ids=["hpa", "keda-app", "api-key"])
def test_every_object_passes_kubernetes_schemas_from_1_30(config, extra):
    docs = manifest("kubernetes", "--config", config, "--image", "reg/shmbatch:1", *extra)
    kinds = by_kind(docs)
    assert {"ConfigMap", "Deployment", "Service"} <= set(kinds)
    for doc in docs:
        if doc["kind"] == "ScaledObject":
            crd_validate(doc, "keda_scaledobject.json")
            continue
        for version in KUBERNETES_VERSIONS:
            k8s_validate(doc, version)


def test_the_schemas_refuse_a_misspelt_field(config):
    kinds = by_kind(manifest("kubernetes", "--config", config, "--image", "i",
                             "--autoscaler", "keda"))
    kv = pytest.importorskip("kubernetes_validate")
    volume = shm_volume(kinds["Deployment"])
    volume["emptyDir"]["sizelimit"] = volume["emptyDir"].pop("sizeLimit")
    with pytest.raises(kv.ValidationError):
        k8s_validate(kinds["Deployment"], "1.30.0")
    kinds["ScaledObject"]["spec"]["minReplicas"] = kinds["ScaledObject"]["spec"].pop(
        "minReplicaCount")
    with pytest.raises(Exception, match="minReplicas"):
        crd_validate(kinds["ScaledObject"], "keda_scaledobject.json")


def test_dev_shm_holds_every_segment_the_headroom_and_the_sixteenth_kept_free(config):
    deployment = by_kind(manifest("kubernetes", "--config", config, "--image", "i",
                                  "--shm-headroom-mib", 32))["Deployment"]
    volume = shm_volume(deployment)
    assert volume["emptyDir"]["medium"] == "Memory"
    limit = quantity_bytes(volume["emptyDir"]["sizeLimit"])
    used = 32 * MIB  # the headroom, taken by the pod's other users first
    for table in ENGINES.values():  # each engine's own check, as it starts, in the pod's tmpfs
        size = real_segment_bytes(table)
        margin = max(sizing.SHM_MARGIN_MIN_BYTES, limit // sizing.SHM_MARGIN_DIVISOR)
        assert size <= limit - used - margin, (size, limit, used)
        used += size
    # and no more than a MiB over that
    margin = max(sizing.SHM_MARGIN_MIN_BYTES, limit // sizing.SHM_MARGIN_DIVISOR)
    assert limit - used - margin < 2 * MIB


def test_memory_request_and_limit_count_the_empty_dir_and_each_process(config):
    deployment = by_kind(manifest("kubernetes", "--config", config, "--image", "i",
                                  "--process-memory-mib", 100))["Deployment"]
    resources = serve_container(deployment)["resources"]
    shm = quantity_bytes(shm_volume(deployment)["emptyDir"]["sizeLimit"])
    request = quantity_bytes(resources["requests"]["memory"])
    assert request == quantity_bytes(resources["limits"]["memory"])
    processes = 1 + 2 + 1 + 1  # serve, digits' two batchers, tokens' one, one HTTP worker
    assert request == shm + processes * 100 * MIB


def test_the_grace_period_outlasts_prestop_and_the_longest_drain(config, no_http):
    for path, http in ((config, True), (no_http, False)):
        extra = () if http else ("--app-image", "reg/app:1")
        deployment = by_kind(manifest("kubernetes", "--config", path, "--image", "i",
                                      *extra))["Deployment"]
        pod = deployment["spec"]["template"]["spec"]
        serve = serve_container(deployment)
        sleep_s = serve["lifecycle"]["preStop"]["sleep"]["seconds"]
        drain_s = max(t["drain_timeout_s"] for t in ENGINES.values())
        # HTTP workers get drain_timeout_s + 10 s before the engines drain (engine.http.server.workers)
        stop_s = drain_s + (math.ceil(drain_s) + 10 if http else 0)
        assert pod["terminationGracePeriodSeconds"] > sleep_s + stop_s
        assert sleep_s > 0


def test_with_an_http_port_readiness_is_the_ready_route_behind_the_service(config):
    kinds = by_kind(manifest("kubernetes", "--config", config, "--image", "i"))
    serve = serve_container(kinds["Deployment"])
    assert serve["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8000}
    args = serve["args"]
    assert args[args.index("--http-port") + 1] == "8000"
    assert args[args.index("--http-host") + 1] == "0.0.0.0"  # the Service reaches it
    assert kinds["Service"]["spec"]["ports"][0]["targetPort"] == 8000
    assert kinds["Service"]["spec"]["selector"] == \
        kinds["Deployment"]["spec"]["selector"]["matchLabels"]


def test_an_api_key_secret_reaches_serve_as_its_environment_variable_alone(config):
    kinds = by_kind(manifest("kubernetes", "--config", config, "--image", "i",
                             "--api-key-secret", "shmbatch-key"))
    serve = serve_container(kinds["Deployment"])
    assert serve["env"] == [{"name": "SHMBATCH_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "shmbatch-key", "key": "api-key"}}}]
    assert not any("key" in arg for arg in serve["args"])  # the key in no command line
    assert serve["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"  # needs no key


def test_without_an_http_port_there_is_no_service_and_the_probe_asks_every_engine(no_http):
    kinds = by_kind(manifest("kubernetes", "--config", no_http, "--image", "i",
                             "--app-image", "reg/app:1"))
    assert "Service" not in kinds
    serve = serve_container(kinds["Deployment"])
    command = serve["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"]
    steps = [shlex.split(step) for step in command[2].split("&&")]
    assert steps == [["shmbatch", "status", name, "--ready"] for name in ENGINES]
    assert serve["startupProbe"]["exec"] == serve["readinessProbe"]["exec"]


def test_the_exec_probe_succeeds_only_while_every_engine_serves(tmp_path):
    names = [unique_name("probe") for _ in range(2)]
    tables = {n: {"backend": '"engine.backends:identity"', "input_shape": "[4]",
                  "output_shape": "[4]"} for n in names}
    path = write_config(tmp_path / "models.toml", tables)
    deployment = by_kind(manifest("kubernetes", "--config", path, "--image", "i",
                                  "--app-image", "reg/app:1"))["Deployment"]
    script = serve_container(deployment)["readinessProbe"]["exec"]["command"][2]

    def probe() -> bool:
        """The script's `shmbatch status NAME --ready` steps, run by this process's
        main() as `sh -c` would run them: each must exit 0."""
        with contextlib.redirect_stdout(io.StringIO()):
            return all(commands.main(shlex.split(step)[1:]) == 0 for step in script.split("&&"))

    first = engine.Engine(names[0], backend="engine.backends:identity", input_shape=(4,),
                          output_shape=(4,)).start()
    try:
        assert not probe()  # the second engine does not run
        second = engine.Engine(names[1], backend="engine.backends:identity", input_shape=(4,),
                               output_shape=(4,)).start()
        try:
            assert probe()
        finally:
            second.stop()
    finally:
        first.stop()


def test_the_app_runs_beside_serve_as_a_native_sidecar_in_one_pid_namespace(config):
    deployment = by_kind(manifest("kubernetes", "--config", config, "--image", "reg/serve:1",
                                  "--app-image", "reg/app:1", "--app-command",
                                  "gunicorn 'app:make()' -w 4", "--run-as-user", 1234))["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (serve,) = pod["initContainers"]
    (app,) = pod["containers"]
    assert serve["restartPolicy"] == "Always" and serve["image"] == "reg/serve:1"
    # the app starts once every engine serves: its startup waits on the ready route
    assert serve["startupProbe"]["httpGet"] == serve["readinessProbe"]["httpGet"]
    assert app["image"] == "reg/app:1"
    assert app["command"] == ["gunicorn", "app:make()", "-w", "4"]
    assert [m["mountPath"] for m in app["volumeMounts"]] == ["/dev/shm"]
    assert app["volumeMounts"][0]["name"] == shm_volume(deployment)["name"]
    # clients are judged by pid, and a segment is its creator's user's alone
    assert pod["shareProcessNamespace"] is True
    assert pod["securityContext"]["runAsUser"] == 1234


def test_prometheus_scrapes_the_metrics_port_serve_listens_on(config, no_http):
    for path, port in ((config, 9100), (no_http, 9090)):  # 9090: the default
        deployment = by_kind(manifest("kubernetes", "--config", path, "--image", "i",
                                      "--app-image", "a"))["Deployment"]
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                               "prometheus.io/path": "/metrics"}
        args = serve_container(deployment)["args"]
        assert args[args.index("--metrics-port") + 1] == str(port)
        assert args[args.index("--metrics-host") + 1] == "0.0.0.0"


def test_the_config_map_holds_the_config_serve_reads(config):
    kinds = by_kind(manifest("kubernetes", "--config", config, "--image", "i"))
    data = kinds["ConfigMap"]["data"]
    assert data == {"models.toml": config.read_text()}
    serve = serve_container(kinds["Deployment"])
    path = serve["args"][serve["args"].index("--config") + 1]
    mount = next(m for m in serve["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in kinds["Deployment"]["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == kinds["ConfigMap"]["metadata"]["name"]
    assert path.rsplit("/", 1)[1] in data


def test_the_hpa_holds_the_queue_wait_p90_at_the_target(config):
    code, out, _ = run("kubernetes", "--config", config, "--image", "i", "--replicas", 3,
                       "--max-replicas", 12, "--autoscaler", "hpa",
                       "--target-queue-wait-ms", 35)
    assert code == 0
    kinds = by_kind(list(yaml.safe_load_all(out)))
    hpa, deployment = kinds["HorizontalPodAutoscaler"], kinds["Deployment"]
    assert deployment["spec"]["replicas"] == 3
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "shmbatch_queue_wait_seconds_p90"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "35m"}
    # prometheus-adapter's rule for that metric rides along, as comments
    rule = [line[2:] for line in out.splitlines() if line.startswith("#   ")]
    adapter = yaml.safe_load("\n".join(rule))[0]
    assert adapter["name"]["as"] == "shmbatch_queue_wait_seconds_p90"
    assert "shmbatch_queue_wait_seconds_bucket" in adapter["seriesQuery"]
    assert adapter["metricsQuery"].startswith("histogram_quantile(0.9,")


def test_the_scaled_object_queries_prometheus_for_the_queue_wait_p90(config):
    kinds = by_kind(manifest("kubernetes", "--config", config, "--image", "i", "--name", "web",
                             "--namespace", "ml", "--replicas", 1, "--autoscaler", "keda",
                             "--target-queue-wait-ms", 2.5))
    spec = kinds["ScaledObject"]["spec"]
    assert spec["scaleTargetRef"]["name"] == "web" and spec["minReplicaCount"] == 1
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert float(trigger["metadata"]["threshold"]) == 0.0025
    query = trigger["metadata"]["query"]
    assert query.startswith("histogram_quantile(0.9, sum by (le) (rate("
                            "shmbatch_queue_wait_seconds_bucket{")
    assert 'pod=~"web-[a-z0-9]+-[a-z0-9]{5}"' in query and 'namespace="ml"' in query
    assert {d["metadata"].get("namespace") for d in kinds.values()} == {"ml"}


@pytest.mark.parametrize("case", ["missing file", "bad toml", "unsized engine",
                                  "unknown autoscaler", "unknown key", "nobody reaches it"])
def test_a_bad_config_exits_non_zero_with_one_line_and_prints_nothing(tmp_path, case):
    path = tmp_path / "models.toml"
    extra = []
    if case == "bad toml":
        path.write_text("[engines.a\ninput_shape = [4]\n")
    elif case == "unsized engine":  # a slot of 2^40 B: the C refuses the layout
        write_config(path, {"huge": table(input_shape=f"[{1 << 40}]", output_shape="[1]")},
                     http_port=8000)
    elif case == "unknown key":
        write_config(path, {"a": table(input_shape="[4]", output_shape="[4]", queue_capacty=8)},
                     http_port=8000)
    elif case == "nobody reaches it":  # no HTTP port, no app: no client could attach
        write_config(path, {"a": table(input_shape="[4]", output_shape="[4]")})
    else:
        write_config(path, ENGINES, http_port=8000)
        if case == "missing file":
            path = tmp_path / "absent.toml"
        else:
            extra = ["--autoscaler", "knative"]
    code, out, err = run("kubernetes", "--config", path, "--image", "i", *extra)
    assert code != 0
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("shmbatch manifest")
    expected = {"missing file": "absent.toml", "bad toml": "models.toml",
                "unsized engine": "'huge'", "unknown autoscaler": "knative",
                "unknown key": "queue_capacty", "nobody reaches it": "http_port"}[case]
    assert expected in err


def test_the_command_itself_exits_non_zero_with_one_line_and_prints_nothing(tmp_path):
    done = run_process("kubernetes", "--config", tmp_path / "absent.toml", "--image", "i")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"shmbatch manifest: [Errno 2] No such file or directory: '{tmp_path / 'absent.toml'}'"]
