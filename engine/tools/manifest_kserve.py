"""`shmbatch manifest kserve`: a KServe ServingRuntime that runs `shmbatch
serve` as the Open Inference Protocol (v2) server of an InferenceService.

KServe talks to the predictor's container on port 8080, so serve runs with
`--http-port 8080 --http-host 0.0.0.0` over the config's own ports; the pod
gets the same memory-backed /dev/shm, memory and readiness as `manifest
kubernetes` gives the serve container (engine.tools.manifest_pod). Without
grpc_port the container declares the HTTP port alone (Knative, KServe's
serverless mode, takes one): KServe scrapes /metrics by the
prometheus.kserve.io annotations. A ServingRuntime holds no grace period: the InferenceService's predictor
sets it (the comment above the runtime shows one).

With grpc_port in the config, serve also listens for gRPC there, the runtime
says it speaks grpc-v2 beside v2, and the container declares that port as
KServe reads one (a name holding "h2c": its Service port gets appProtocol
kubernetes.io/h2c, and the ingress routes the gRPC calls to it), after the
HTTP port, which KServe's Service answers on port 80. Two ports need KServe's
Standard (RawDeployment) mode: Knative takes one port per container.
"""
from typing import Optional

from engine.tools.manifest_pod import ServePod, metadata
from engine.tools.manifest_yaml import documents

HTTP_PORT = 8080  # KServe's predictor port
SERVICE_PORT = 80  # the port of KServe's Service that reaches HTTP_PORT
MODEL_FORMAT = "shmbatch"
DEPLOYMENT_MODE = "RawDeployment"  # KServe's name before Standard, which it still takes


def ports(pod: ServePod) -> list:
    """The container's ports: HTTP_PORT, and the gRPC port (named h2c) if served."""
    if pod.grpc_port is None:
        return [{"containerPort": HTTP_PORT, "protocol": "TCP"}]
    if pod.grpc_port == SERVICE_PORT:
        raise ValueError(f"grpc_port: KServe's Service answers HTTP on port {SERVICE_PORT}: "
                         f"expected another port for gRPC, got {pod.grpc_port}")
    # a Service of two ports names both
    return [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "h2c", "containerPort": pod.grpc_port, "protocol": "TCP"}]


def container(pod: ServePod) -> dict:
    out = pod.container(name="kserve-container")
    out["ports"] = ports(pod)
    # Knative drains the pod through its queue-proxy before the container's SIGTERM,
    # on which serve drains in turn; a raw Deployment sends SIGTERM at once
    out.pop("lifecycle")
    return out


def serving_runtime(pod: ServePod, namespace: Optional[str]) -> dict:
    return {
        "apiVersion": "serving.kserve.io/v1alpha1", "kind": "ServingRuntime",
        "metadata": metadata(pod.name, pod.labels, namespace),
        "spec": {
            "annotations": {"prometheus.kserve.io/port": str(pod.metrics_port),
                            "prometheus.kserve.io/path": "/metrics"},
            "supportedModelFormats": [{"name": MODEL_FORMAT, "version": "1", "autoSelect": True}],
            "protocolVersions": ["v2"] if pod.grpc_port is None else ["v2", "grpc-v2"],
            "multiModel": False,
            "containers": [container(pod)],
            "volumes": pod.volumes(),
        },
    }


def example_service(pod: ServePod) -> str:
    grpc = "" if pod.grpc_port is None else f"""\
    annotations:   # HTTP and gRPC side by side: Knative takes one port
      serving.kserve.io/deploymentMode: {DEPLOYMENT_MODE}
"""
    calls = f"POST /v2/models/{pod.names[0]}/infer" + (
        "" if pod.grpc_port is None else
        f"; gRPC inference.GRPCInferenceService on port {pod.grpc_port}")
    return f"""\
An InferenceService on this runtime (the model names are the engines': {', '.join(pod.names)};
{calls}):
  apiVersion: serving.kserve.io/v1beta1
  kind: InferenceService
  metadata:
    name: {pod.name}
{grpc}  spec:
    predictor:
      terminationGracePeriodSeconds: {pod.grace_s}   # serve's drain: at most {pod.stop_bound_s:g} s
      model:
        modelFormat:
          name: {MODEL_FORMAT}
        runtime: {pod.name}
{pod.sizing_note()}"""


def kserve(pod: ServePod, config_text: str, *, namespace: Optional[str] = None) -> str:
    """The manifest's YAML text: the config's ConfigMap and the ServingRuntime."""
    return documents([
        (f"shmbatch serve's config, as given (engines {', '.join(pod.names)})",
         pod.config_map(config_text, namespace)),
        (example_service(pod), serving_runtime(pod, namespace)),
    ])
