"""`manifest kubernetes --autoscaler keda`: KEDA's ScaledObject, one
prometheus trigger over the Deployment's pods, on shmbatch's own queue wait
or on a family `serve --metrics-compat` writes (vLLM's or Triton's names,
engine.serving.metrics_compat), so a recipe written for either scales
shmbatch unchanged.

What the trigger asks of Prometheus, by the family's type:
- shmbatch_queue_wait_seconds (the default): its p90 over the pods, in
  seconds (metricType Value: replicas grow in proportion to wait /
  threshold; a quantile is not divided among pods, as AverageValue would).
- a gauge (vllm:num_requests_waiting, nv_inference_pending_request_count):
  its sum over the pods' engines, metricType AverageValue: KEDA divides the
  sum by the replicas, so the threshold is per pod (replicas = ceil(sum /
  threshold)), as vLLM's recipes scale on the waiting requests.
- a counter: its rate summed over the pods, AverageValue (per pod, per s).
- a histogram: its p90 over the pods, Value, in its own unit (seconds).
Every series is of this Deployment's pods and, for a compat family, of its
engines (label model_name for vLLM's, model for Triton's). The pod's serve
gets `--metrics-compat` with the family's kind (and the config's own kinds):
the name the trigger queries is on its /metrics.
"""
import dataclasses
from decimal import Decimal
from typing import Dict, Optional, Tuple

from engine.serving import metrics_compat

QUANTILE = 0.9
RATE_WINDOW = "2m"
OWN_METRIC = "shmbatch_queue_wait_seconds"
LABELS = {"vllm": "model_name", "triton": "model"}  # the label naming the engine, as each writes it
WHAT = {"gauge": "per pod", "counter": "per pod per second",
        "histogram": f"the p{QUANTILE * 100:g} over the pods, in seconds"}
DEFAULT_QUEUE_WAIT_MS = 20.0  # the p90 queue wait the default trigger holds


def compat_metrics() -> Dict[str, Tuple[str, str]]:
    """{family name: (its compat kind, its type)}: every family
    `serve --metrics-compat` writes, read off the families themselves."""
    out = {}
    for kind, families in (("vllm", metrics_compat.vllm_families),
                           ("triton", metrics_compat.triton_families)):
        for family in families(()):
            out[family.name] = (kind, family.kind)
    return out


@dataclasses.dataclass(frozen=True)
class Target:
    """The family a ScaledObject scales on: its name, its compat kind (None:
    shmbatch's own) and type, and the threshold's text."""

    name: str
    kind: Optional[str]
    type: str
    threshold: str

    @property
    def metric_type(self) -> str:
        return "AverageValue" if self.type in ("gauge", "counter") else "Value"


def decimal_text(value: float, scale: int = 0) -> str:
    """value x 10^scale as plain decimal text, no exponent (a KEDA threshold's,
    a Kubernetes quantity's)."""
    return format(Decimal(repr(float(value))).scaleb(scale).normalize(), "f")


def target(metric: Optional[str], threshold: Optional[float],
           target_queue_wait_ms: Optional[float], engines) -> Target:
    """The checked Target of --autoscaler-metric, --autoscaler-threshold and
    --target-queue-wait-ms (engines: the pod's EngineConfigs); ValueError,
    one line, for a name no family carries or a threshold that does not fit."""
    if metric is None or metric == OWN_METRIC:
        if threshold is not None:
            raise ValueError(f"--autoscaler-threshold: {OWN_METRIC} (the default metric) "
                             f"takes --target-queue-wait-ms, got --autoscaler-threshold "
                             f"{threshold:g}")
        wait_ms = DEFAULT_QUEUE_WAIT_MS if target_queue_wait_ms is None else target_queue_wait_ms
        return Target(OWN_METRIC, None, "histogram", decimal_text(wait_ms, -3))
    known = compat_metrics()
    kind = "vllm" if metric.startswith("vllm:") else "triton" if metric.startswith("nv_") \
        else None
    if metric not in known:
        names = [n for n, (k, _) in known.items() if kind in (None, k)]
        where = f"--metrics-compat {kind}" if kind else "shmbatch or --metrics-compat"
        raise ValueError(f"--autoscaler-metric: {where} exports no {metric!r}; it knows "
                         f"{', '.join(([OWN_METRIC] if kind is None else []) + names)}")
    kind, kind_type = known[metric]
    only, why = metrics_compat.ONLY_WHERE.get(metric, (None, ""))
    if only is not None and not any(only(cfg) for cfg in engines):
        raise ValueError(f"--autoscaler-metric: no engine of this config has {metric!r} "
                         f"({why})")
    if target_queue_wait_ms is not None:
        raise ValueError(f"--target-queue-wait-ms is {OWN_METRIC}'s; --autoscaler-metric "
                         f"{metric} takes --autoscaler-threshold")
    if threshold is None or not threshold > 0:
        got = "none" if threshold is None else f"{threshold:g}"
        raise ValueError(f"--autoscaler-metric {metric}: expected --autoscaler-threshold > 0 "
                         f"({WHAT[kind_type]}), got {got}")
    return Target(metric, kind, kind_type, decimal_text(threshold))


def with_kind(kinds, kind: str) -> Tuple[str, ...]:
    """The --metrics-compat kinds serve needs: the config's own and this one
    (the flag overrides the config's key: its dashboards keep their names)."""
    return tuple(k for k in metrics_compat.KINDS if k in kinds or k == kind)


def pods(name: str, namespace: Optional[str]) -> str:
    """The label matchers of a Deployment's pods (NAME-<ReplicaSet hash>-<5 characters>)."""
    return f'pod=~"{name}-[a-z0-9]+-[a-z0-9]{{5}}"' + (f',namespace="{namespace}"'
                                                      if namespace else "")


def engines_matcher(label: str, names) -> str:
    """label = the one engine, or =~ any of them ('.', the one regex character
    an engine's name may hold, escaped: a backslash doubled in PromQL's string)."""
    if len(names) == 1:
        return f'{label}="{names[0]}"'
    return f'{label}=~"{"|".join(n.replace(".", chr(92) * 2 + ".") for n in names)}"'


def promql(t: Target, name: str, namespace: Optional[str], engine_names) -> str:
    where = pods(name, namespace)
    if t.kind is not None:
        where = f"{engines_matcher(LABELS[t.kind], engine_names)},{where}"
    if t.type == "gauge":
        return f"sum({t.name}{{{where}}})"
    if t.type == "counter":
        return f"sum(rate({t.name}{{{where}}}[{RATE_WINDOW}]))"
    return (f"histogram_quantile({QUANTILE}, sum by (le) "
            f"(rate({t.name}_bucket{{{where}}}[{RATE_WINDOW}])))")


def note(t: Target) -> str:
    """The ScaledObject's comment: what it scales on."""
    if t.kind is None:
        return (f"scales on the p{QUANTILE * 100:g} of the engines' queue wait over the "
                f"Deployment's pods")
    return (f"scales on {t.name} ({t.type}; threshold {t.threshold} {WHAT[t.type]}), which "
            f"serve writes with --metrics-compat {t.kind}")


def scaled_object(t: Target, name: str, meta: dict, namespace: Optional[str], engine_names,
                  replicas: int, max_replicas: int, prometheus_url: str) -> dict:
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": meta,
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment",
                                        "name": name},
                     "minReplicaCount": replicas, "maxReplicaCount": max_replicas,
                     "triggers": [{"type": "prometheus", "metricType": t.metric_type,
                                   "metadata": {"serverAddress": prometheus_url,
                                                "query": promql(t, name, namespace, engine_names),
                                                "threshold": t.threshold}}]}}
