"""`serve --grpc-port` as a command: what it refuses before anything starts, a port in
use failing the start with nothing left behind, and `shmbatch manifest kubernetes`
exposing the port of a config's grpc_port."""
import socket

import pytest
from conftest import shm_entries, unique_name
from manifest_helpers import by_kind, k8s_validate, manifest, run, serve_container, write_config
from test_multi_engine import failed_serve, table, top

pytest.importorskip("uvicorn")
pytest.importorskip("grpc")

ENGINE = dict(backend="engine.backends:synthetic", input_shape=[4], output_shape=[4])
POD_ENGINES = {"digits": {"backend": '"engine.backends:synthetic"', "input_shape": "[64]",
                          "output_shape": "[10]"}}  # TOML values as text


@pytest.mark.parametrize("flags, reason", [
    (("--grpc-port", "0"), "--grpc-port without --http-port"),
    (("--http-port", "0", "--grpc-host", "127.0.0.1"), "--grpc-host without --grpc-port"),
], ids=["no-http-port", "host-alone"])
def test_a_grpc_flag_serve_cannot_honour_starts_nothing(tmp_path, flags, reason):
    name = unique_name("grpc-flags")
    code, lines = failed_serve(tmp_path, table(name, **ENGINE), *flags)
    assert code != 0 and any(reason in line for line in lines), lines
    assert not [e for e in shm_entries() if name in e]


def test_a_grpc_port_in_use_fails_the_start_before_any_engine_starts(tmp_path):
    name = unique_name("grpc-busy")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, lines = failed_serve(tmp_path, top(grpc_port=port) + table(name, **ENGINE),
                                   "--http-port", "0")
    assert code != 0 and any(f"--grpc-port {port}: cannot listen" in line for line in lines), \
        lines
    assert not [e for e in shm_entries() if name in e]


@pytest.fixture
def grpc_config(tmp_path):
    return write_config(tmp_path / "models.toml", POD_ENGINES, http_port=8000, grpc_port=8001)


def test_the_manifest_exposes_the_grpc_port_on_the_pod_and_the_service(grpc_config):
    kinds = by_kind(manifest("kubernetes", "--config", grpc_config, "--image", "i"))
    serve = serve_container(kinds["Deployment"])
    args = serve["args"]
    assert args[args.index("--grpc-port") + 1] == "8001"
    assert args[args.index("--grpc-host") + 1] == "0.0.0.0"
    assert {"name": "grpc", "containerPort": 8001, "protocol": "TCP"} in serve["ports"]
    ports = {p["name"]: p for p in kinds["Service"]["spec"]["ports"]}
    assert (ports["grpc"]["port"], ports["grpc"]["targetPort"]) == (8001, 8001)
    for doc in (kinds["Deployment"], kinds["Service"]):
        k8s_validate(doc, "latest")


def test_a_manifest_refuses_a_grpc_port_without_an_http_port(tmp_path):
    config = write_config(tmp_path / "models.toml", POD_ENGINES, grpc_port=8001)
    code, _, err = run("kubernetes", "--config", config, "--image", "i", "--app-image", "a")
    assert code != 0 and "grpc_port" in err and "expected http_port" in err
