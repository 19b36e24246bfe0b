"""`shmbatch manifest kserve`: a KServe ServingRuntime that runs `shmbatch
serve` as the Open Inference Protocol (v2) server of an InferenceService.

KServe talks to the predictor's container on port 8080, so serve runs with
`--http-port 8080 --http-host 0.0.0.0` over the config's own ports; the pod
gets the same memory-backed /dev/shm, memory and readiness as `manifest
kubernetes` gives the serve container (engine.tools.manifest_pod). The
container declares the HTTP port alone (Knative, KServe's serverless mode,
takes one): KServe scrapes /metrics by the prometheus.kserve.io annotations.
A ServingRuntime holds no grace period: the InferenceService's predictor
sets it (the comment above the runtime shows one).
"""
from typing import Optional

from engine.tools.manifest_pod import ServePod, metadata
from engine.tools.manifest_yaml import documents

HTTP_PORT = 8080  # KServe's predictor port
MODEL_FORMAT = "shmbatch"


def container(pod: ServePod) -> dict:
    out = pod.container(name="kserve-container")
    out["ports"] = [{"containerPort": HTTP_PORT, "protocol": "TCP"}]
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
            "protocolVersions": ["v2"],
            "multiModel": False,
            "containers": [container(pod)],
            "volumes": pod.volumes(),
        },
    }


def example_service(pod: ServePod) -> str:
    return f"""\
An InferenceService on this runtime (the model names are the engines': {', '.join(pod.names)};
POST /v2/models/{pod.names[0]}/infer):
  apiVersion: serving.kserve.io/v1beta1
  kind: InferenceService
  metadata:
    name: {pod.name}
  spec:
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
