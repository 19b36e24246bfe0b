"""`shmbatch manifest kserve`: a ServingRuntime that passes KServe's CRD
schema and runs serve as an Open Inference Protocol (v2) server on KServe's
port, with the /dev/shm, memory and readiness that `manifest kubernetes` gives."""
import pytest
import yaml
from manifest_helpers import (KUBERNETES_VERSIONS, by_kind, crd_validate, k8s_validate, manifest,
                              run, serve_container, shm_volume, write_config)

ENGINES = {"digits": {"backend": '"engine.backends:synthetic"', "input_shape": "[784]",
                      "output_shape": "[10]", "queue_capacity": 512, "instances": 2}}


@pytest.fixture
def config(tmp_path):  # the config's own HTTP port is not KServe's: 8080 stands in for it
    return write_config(tmp_path / "digits.toml", ENGINES, http_port=8000, metrics_port=9100)


def test_the_runtime_passes_kserves_crd_schema_and_the_config_map_kubernetes(config):
    kinds = by_kind(manifest("kserve", "--config", config, "--image", "reg/shmbatch:1"))
    assert set(kinds) == {"ConfigMap", "ServingRuntime"}
    assert kinds["ConfigMap"]["data"] == {"models.toml": config.read_text()}
    crd_validate(kinds["ServingRuntime"], "kserve_servingruntime.json")
    for version in KUBERNETES_VERSIONS:
        k8s_validate(kinds["ConfigMap"], version)


def test_the_crd_schema_refuses_a_misspelt_field(config):
    runtime = by_kind(manifest("kserve", "--config", config, "--image", "i"))["ServingRuntime"]
    runtime["spec"]["protocolVersion"] = runtime["spec"].pop("protocolVersions")
    with pytest.raises(Exception, match="protocolVersion"):
        crd_validate(runtime, "kserve_servingruntime.json")


def test_serve_speaks_v2_on_kserves_port_to_every_interface(config):
    runtime = by_kind(manifest("kserve", "--config", config, "--image", "reg/shmbatch:1"))[
        "ServingRuntime"]
    spec = runtime["spec"]
    assert spec["protocolVersions"] == ["v2"]
    assert {"name": "shmbatch", "version": "1", "autoSelect": True} in spec["supportedModelFormats"]
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container" and container["image"] == "reg/shmbatch:1"
    assert container is serve_container(runtime)
    args = container["args"]
    assert args[:3] == ["serve", "--config", "/etc/shmbatch/models.toml"]
    assert args[args.index("--http-port") + 1] == "8080"
    assert args[args.index("--http-host") + 1] == "0.0.0.0"
    assert container["ports"] == [{"containerPort": 8080, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert spec["annotations"] == {"prometheus.kserve.io/port": "9100",
                                   "prometheus.kserve.io/path": "/metrics"}


def test_the_pod_gets_the_same_dev_shm_and_memory_as_the_kubernetes_manifest(config):
    runtime = by_kind(manifest("kserve", "--config", config, "--image", "i"))["ServingRuntime"]
    deployment = by_kind(manifest("kubernetes", "--config", config, "--image", "i"))["Deployment"]
    assert shm_volume(runtime) == shm_volume(deployment)
    assert shm_volume(runtime)["emptyDir"]["medium"] == "Memory"
    assert serve_container(runtime)["resources"] == serve_container(deployment)["resources"]


@pytest.fixture
def grpc_config(tmp_path):
    return write_config(tmp_path / "digits.toml", ENGINES, http_port=8000, grpc_port=8001)


def test_a_grpc_port_is_declared_h2c_after_the_http_port_and_the_runtime_speaks_grpc_v2(
        grpc_config):
    code, out, err = run("kserve", "--config", grpc_config, "--image", "i")
    assert code == 0 and err == "", err
    runtime = by_kind(list(yaml.safe_load_all(out)))["ServingRuntime"]
    crd_validate(runtime, "kserve_servingruntime.json")
    assert runtime["spec"]["protocolVersions"] == ["v2", "grpc-v2"]
    container = serve_container(runtime)
    args = container["args"]
    assert args[args.index("--grpc-port") + 1] == "8001"
    assert args[args.index("--grpc-host") + 1] == "0.0.0.0"
    # KServe's Service: the first port on 80, a port whose name holds h2c as gRPC (h2c);
    # a Service of two ports needs each named
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                                  {"name": "h2c", "containerPort": 8001, "protocol": "TCP"}]
    assert "serving.kserve.io/deploymentMode: RawDeployment" in out  # Knative takes one port


def test_a_grpc_port_on_kserves_http_service_port_is_refused(tmp_path):
    config = write_config(tmp_path / "digits.toml", ENGINES, http_port=8000, grpc_port=80)
    code, _, err = run("kserve", "--config", config, "--image", "i")
    assert code != 0 and "grpc_port" in err and "got 80" in err
