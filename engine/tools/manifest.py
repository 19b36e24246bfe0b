"""`shmbatch manifest kubernetes`: a serve config as Kubernetes objects.

The ConfigMap holds the config file as given; the Deployment runs `shmbatch
serve` on it (engine.tools.manifest_pod sizes that container, its /dev/shm,
probes and grace period), beside the app's container when there is one; a
Service fronts the HTTP port when there is one; an autoscaler scales on the
engines' queue wait (the p90 of shmbatch_queue_wait_seconds, per pod).

With an app container, serve runs as a native sidecar (an init container with
restartPolicy Always, Kubernetes 1.29+): its startupProbe is the readiness
check, so the app starts only once every engine serves (a Client attaches to
a segment that exists) and, at the pod's end, serve is stopped only after the
app has exited, so the app's last requests are answered. The pod shares one
PID namespace: an engine judges a client's death by its pid, and the app's
pids must mean the same processes in both containers. Both run as one user:
a segment is its creator's alone (mode 0600).
"""
import shlex
from decimal import Decimal
from typing import Optional

from engine.tools.manifest_pod import GRACE_MARGIN_S, PRESTOP_SLEEP_S, ServePod, metadata
from engine.tools.manifest_yaml import Comment, documents

QUANTILE = 0.9
METRIC = "shmbatch_queue_wait_seconds_p90"  # the pods metric prometheus-adapter serves
RATE_WINDOW = "2m"
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
                                "targetPort": pod.http_port, "protocol": "TCP"}]}}


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
    return format(Decimal(repr(float(ms))).normalize(), "f") + "m"


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


def promql(pod: ServePod, namespace) -> str:
    # a Deployment's pods are NAME-<ReplicaSet hash>-<5 characters>
    where = f'pod=~"{pod.name}-[a-z0-9]+-[a-z0-9]{{5}}"' + (f',namespace="{namespace}"' if namespace else "")
    return (f"histogram_quantile({QUANTILE}, sum by (le) "
            f"(rate(shmbatch_queue_wait_seconds_bucket{{{where}}}[{RATE_WINDOW}])))")


def scaled_object(pod: ServePod, namespace, replicas: int, max_replicas: int, target_ms: float,
                  prometheus_url: str) -> dict:
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": metadata(pod.name, pod.labels, namespace),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": pod.name},
                     "minReplicaCount": replicas, "maxReplicaCount": max_replicas,
                     # Value: replicas grow in proportion to wait / threshold (a quantile
                     # is not divided among pods, as AverageValue would)
                     "triggers": [{"type": "prometheus", "metricType": "Value", "metadata": {
                         "serverAddress": prometheus_url, "query": promql(pod, namespace),
                         "threshold": format(Decimal(repr(float(target_ms))).scaleb(-3)
                                             .normalize(), "f")}}]}}


def kubernetes(pod: ServePod, config_text: str, *, namespace: Optional[str] = None,
               replicas: int = 1, app_image: Optional[str] = None,
               app_command: Optional[str] = None, autoscaler: str = "none",
               target_queue_wait_ms: float = 20.0, max_replicas: Optional[int] = None,
               prometheus_url: str = DEFAULT_PROMETHEUS_URL, run_as_user: int = 1000) -> str:
    """The manifest's YAML text; ValueError for settings that make no pod."""
    if autoscaler not in AUTOSCALERS:
        raise ValueError(f"--autoscaler: expected one of {', '.join(AUTOSCALERS)}, "
                         f"got {autoscaler!r}")
    if app_command is not None and not app_image:
        raise ValueError("--app-command without --app-image")
    if not app_image and pod.http_port is None:
        raise ValueError("nothing could reach the engines: expected http_port in the config "
                         "(a Service for it) or --app-image (a client in the pod)")
    max_replicas = max_replicas if max_replicas is not None else max(10, 4 * replicas)
    if replicas < 1 or max_replicas < replicas or not target_queue_wait_ms > 0:
        raise ValueError(f"expected 1 <= --replicas <= --max-replicas and "
                         f"--target-queue-wait-ms > 0, got {replicas}, {max_replicas} and "
                         f"{target_queue_wait_ms:g}")
    if run_as_user < 0:
        raise ValueError(f"--run-as-user: expected a uid >= 0, got {run_as_user}")
    docs = [(f"shmbatch serve's config, as given (engines {', '.join(pod.names)})",
             pod.config_map(config_text, namespace)),
            ("", deployment(pod, namespace=namespace, replicas=replicas, app_image=app_image,
                            app_command=app_command, run_as_user=run_as_user))]
    if pod.http_port is not None:
        docs.append(("the Open Inference Protocol (KServe v2) of every engine",
                     service(pod, namespace)))
    if autoscaler == "hpa":
        docs.append((adapter_rule(), hpa(pod, namespace, replicas, max_replicas,
                                         target_queue_wait_ms)))
    elif autoscaler == "keda":
        docs.append((f"scales on the p{QUANTILE * 100:g} of the engines' queue wait over "
                     f"the Deployment's pods", scaled_object(
                         pod, namespace, replicas, max_replicas, target_queue_wait_ms,
                         prometheus_url)))
    return documents(docs)
