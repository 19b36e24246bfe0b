"""`shmbatch manifest kubernetes`: a serve config as Kubernetes objects.

The ConfigMap holds the config file as given; the Deployment runs `shmbatch
serve` on it (engine.tools.manifest_pod sizes that container, its /dev/shm,
probes and grace period), beside the app's container when there is one; a
Service fronts the HTTP port when there is one; an autoscaler scales on the
engines' queue wait (the p90 of shmbatch_queue_wait_seconds, per pod) or,
with keda, on a vLLM or Triton family of `serve --metrics-compat`
(engine.tools.manifest_keda).

With an app container, serve runs as a native sidecar (an init container with
restartPolicy Always, Kubernetes 1.29+): its startupProbe is the readiness
check, so the app starts only once every engine serves (a Client attaches to
a segment that exists) and, at the pod's end, serve is stopped only after the
app has exited, so the app's last requests are answered. The pod shares one
PID namespace: an engine judges a client's death by its pid, and the app's
pids must mean the same processes in both containers. Both run as one user:
a segment is its creator's alone (mode 0600).
"""
import dataclasses
import shlex
from typing import Optional

from engine.tools import manifest_keda
from engine.tools.manifest_keda import QUANTILE, RATE_WINDOW
from engine.tools.manifest_pod import GRACE_MARGIN_S, PRESTOP_SLEEP_S, ServePod, metadata
from engine.tools.manifest_yaml import Comment, documents

METRIC = "shmbatch_queue_wait_seconds_p90"  # the pods metric prometheus-adapter serves
DEFAULT_PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
AUTOSCALERS = ("none", "hpa", "keda")


def app_container(image: str, command: Optional[str]) -> dict:
    out = {"name": "app", "image": image}
    if command is not None:
        out["command"] = shlex.split(command)
        if not out["command"]:
            raise ValueError("--app-command: expected a command, got an empty one")
    out["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    return out


def deployment(pod: ServePod, *, namespace, replicas: int, app_image, app_command,
               run_as_user: int) -> dict:
    spec: dict = {
        Comment(pod.sizing_note()): None,
        Comment(f"grace {pod.grace_s} s: the preStop sleep ({PRESTOP_SLEEP_S} s; the pod leaves "
                f"the Service's endpoints meanwhile),\nthen SIGTERM, on which serve drains "
                f"(at most {pod.stop_bound_s:g} s), + {GRACE_MARGIN_S} s."
                + ("\nThe app stops first (a main container; serve is a sidecar): its own "
                   "stop\nshares this grace; add its time if it needs long." if app_image else "")):
            None,
        "terminationGracePeriodSeconds": pod.grace_s,
    }
    if run_as_user:
        spec["securityContext"] = {"runAsUser": run_as_user, "runAsGroup": run_as_user,
                                   "runAsNonRoot": True}
    else:
        spec["securityContext"] = {"runAsUser": 0, "runAsGroup": 0}
    if app_image:
        spec["shareProcessNamespace"] = True
        serve = pod.container(startup=True)
        serve = {**serve, "restartPolicy": "Always"}
        spec["initContainers"] = [serve]
        spec["containers"] = [app_container(app_image, app_command)]
    else:
        spec["containers"] = [pod.container()]
    spec["volumes"] = pod.volumes()
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(pod.metrics_port),
                   "prometheus.io/path": "/metrics"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(pod.name, pod.labels, namespace),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app.kubernetes.io/name": pod.name}},
            # a new pod serves before an old one goes: capacity holds through a rollout
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": pod.labels, "annotations": annotations},
                         "spec": spec},
        },
    }


def service(pod: ServePod, namespace) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(pod.name, pod.labels, namespace),
            "spec": {"selector": {"app.kubernetes.io/name": pod.name},
                     "ports": [{"name": "http", "port": pod.http_port,
                                "targetPort": pod.http_port, "protocol": "TCP"}] + (
                         [] if pod.grpc_port is None else
                         [{"name": "grpc", "port": pod.grpc_port, "targetPort": pod.grpc_port,
                           "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}])}}


def adapter_rule() -> str:
    """prometheus-adapter's rule that serves METRIC per pod (a comment above the HPA)."""
    return f"""\
prometheus-adapter serves {METRIC} (a pods metric) with this rule:
rules:
  - seriesQuery: 'shmbatch_queue_wait_seconds_bucket{{namespace!="",pod!=""}}'
    resources:
      overrides:
        namespace: {{resource: namespace}}
        pod: {{resource: pod}}
    name:
      matches: ^shmbatch_queue_wait_seconds_bucket$
      as: {METRIC}
    metricsQuery: >-
      histogram_quantile({QUANTILE}, sum(rate(<<.Series>>{{<<.LabelMatchers>>}}[{RATE_WINDOW}]))
      by (le, <<.GroupBy>>)) > 0
      or sum(rate(<<.Series>>{{<<.LabelMatchers>>}}[{RATE_WINDOW}])) by (<<.GroupBy>>) * 0
(an idle pod's quantile is NaN: it reads as 0). Prometheus must scrape the pods by their
prometheus.io annotations, labelling each series with its namespace and pod."""


def target_seconds(ms: float) -> str:
    """ms as a Kubernetes quantity of seconds: 20 -> 20m (0.020 s); no exponent,
    which a quantity cannot hold beside its m."""
    return manifest_keda.decimal_text(ms) + "m"


def hpa(pod: ServePod, namespace, replicas: int, max_replicas: int, target_ms: float) -> dict:
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": metadata(pod.name, pod.labels, namespace),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": pod.name},
                     "minReplicas": replicas, "maxReplicas": max_replicas,
                     "metrics": [{"type": "Pods", "pods": {
                         "metric": {"name": METRIC},
                         "target": {"type": "AverageValue",
                                    "averageValue": target_seconds(target_ms)}}}]}}


def kubernetes(pod: ServePod, config_text: str, *, namespace: Optional[str] = None,
               replicas: int = 1, app_image: Optional[str] = None,
               app_command: Optional[str] = None, autoscaler: str = "none",
               target_queue_wait_ms: Optional[float] = None, max_replicas: Optional[int] = None,
               prometheus_url: str = DEFAULT_PROMETHEUS_URL, run_as_user: int = 1000,
               autoscaler_metric: Optional[str] = None,
               autoscaler_threshold: Optional[float] = None) -> str:
    """The manifest's YAML text; ValueError for settings that make no pod."""
    if autoscaler not in AUTOSCALERS:
        raise ValueError(f"--autoscaler: expected one of {', '.join(AUTOSCALERS)}, "
                         f"got {autoscaler!r}")
    if autoscaler != "keda" and (autoscaler_metric, autoscaler_threshold) != (None, None):
        raise ValueError(f"--autoscaler-metric and --autoscaler-threshold set KEDA's trigger: "
                         f"expected --autoscaler keda, got --autoscaler {autoscaler}")
    if app_command is not None and not app_image:
        raise ValueError("--app-command without --app-image")
    if not app_image and pod.http_port is None:
        raise ValueError("nothing could reach the engines: expected http_port in the config "
                         "(a Service for it) or --app-image (a client in the pod)")
    max_replicas = max_replicas if max_replicas is not None else max(10, 4 * replicas)
    wait_ms = manifest_keda.DEFAULT_QUEUE_WAIT_MS if target_queue_wait_ms is None \
        else target_queue_wait_ms
    if replicas < 1 or max_replicas < replicas or not wait_ms > 0:
        raise ValueError(f"expected 1 <= --replicas <= --max-replicas and "
                         f"--target-queue-wait-ms > 0, got {replicas}, {max_replicas} and "
                         f"{wait_ms:g}")
    if run_as_user < 0:
        raise ValueError(f"--run-as-user: expected a uid >= 0, got {run_as_user}")
    scaled = None
    if autoscaler == "keda":
        scaled = manifest_keda.target(autoscaler_metric, autoscaler_threshold,
                                      target_queue_wait_ms, [cfg for cfg, _ in pod.engines])
        if scaled.kind is not None:  # its /metrics must carry the name the trigger queries
            pod = dataclasses.replace(pod, metrics_compat=manifest_keda.with_kind(
                pod.metrics_compat, scaled.kind))
    docs = [(f"shmbatch serve's config, as given (engines {', '.join(pod.names)})",
             pod.config_map(config_text, namespace)),
            ("", deployment(pod, namespace=namespace, replicas=replicas, app_image=app_image,
                            app_command=app_command, run_as_user=run_as_user))]
    if pod.http_port is not None:
        docs.append(("the Open Inference Protocol (KServe v2) of every engine",
                     service(pod, namespace)))
    if autoscaler == "hpa":
        docs.append((adapter_rule(), hpa(pod, namespace, replicas, max_replicas, wait_ms)))
    elif scaled is not None:
        docs.append((manifest_keda.note(scaled), manifest_keda.scaled_object(
            scaled, pod.name, metadata(pod.name, pod.labels, namespace), namespace, pod.names,
            replicas, max_replicas, prometheus_url)))
    return documents(docs)
