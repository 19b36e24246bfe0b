"""`shmbatch dashboard`: a Grafana dashboard of the families an engine's
/metrics exports (engine.serving.metrics), for every engine a Prometheus
scrapes or those picked in its `engine` variable.

The datasource is a template variable (DS_PROMETHEUS), so the same file
imports through Grafana's UI and loads from a provisioning folder. Rates and
quantiles sum over the scraped instances (a serve's replicas) by engine.
"""
import json
from typing import List

SCHEMA_VERSION = 39
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
ENGINES = 'engine=~"$engine"'
RATE = "[$__rate_interval]"
QUANTILES = (0.5, 0.9, 0.99)
WIDTH, HEIGHT, COLUMNS = 8, 8, 3  # Grafana's grid is 24 wide


def rate(metric: str, labels: str = "", by: str = "engine") -> str:
    selector = ENGINES + (f", {labels}" if labels else "")
    return f"sum by ({by}) (rate({metric}{{{selector}}}{RATE}))"


def gauge(metric: str, how: str = "sum") -> str:
    """A gauge by engine: summed over the instances scraped (queued requests,
    live batchers), or averaged (a setting each instance holds alike)."""
    return f"{how} by (engine) ({metric}{{{ENGINES}}})"


def target(expr: str, legend: str) -> dict:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True}


def quantiles(histogram: str, by: str = "engine") -> List[dict]:
    """p50, p90 and p99 of a histogram family, by engine (and `by`'s labels)."""
    legend = " ".join("{{%s}}" % label.strip() for label in by.split(","))
    return [target(f"histogram_quantile({q}, {rate(histogram + '_bucket', by=by + ', le')})",
                   f"{legend} p{round(q * 100)}") for q in QUANTILES]


def panel(title: str, description: str, targets: List[dict], unit: str = "short") -> dict:
    return {"type": "timeseries", "title": title, "description": description,
            "datasource": DATASOURCE, "targets": targets,
            "fieldConfig": {"defaults": {"unit": unit, "min": 0,
                                         "custom": {"fillOpacity": 10, "showPoints": "never"}},
                            "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom",
                                   "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def sections() -> list:
    """(row title, its panels), top to bottom."""
    mean_batch = f"{rate('shmbatch_batch_size_sum')} / {rate('shmbatch_batch_size_count')}"
    refused = rate("shmbatch_requests_total", 'outcome="overloaded"')
    predictions = rate("shmbatch_admission_predictions_total")
    predicted = rate("shmbatch_admission_wait_seconds_total", 'kind="predicted"')
    seen = rate("shmbatch_admission_wait_seconds_total", 'kind="seen"')
    return [
        ("Traffic", [
            panel("Requests by outcome", "Requests finished per second, by outcome (ok, "
                  "rejected: queue full, overloaded: refused by admission, timeout, expired, "
                  "error, invalid, withdrawn).",
                  [target(rate("shmbatch_requests_total", by="engine, outcome"),
                          "{{engine}} {{outcome}}")], "reqps"),
            panel("Batch size", "Requests per batch: the mean and quantiles of the batches run, "
                  "and the batch limit (AIMD under slo_ms).",
                  [target(mean_batch, "{{engine}} mean"), *quantiles("shmbatch_batch_size"),
                   target(gauge("shmbatch_batch_limit", "avg"), "{{engine}} limit")]),
            panel("Batches", "Batches run per second.",
                  [target(rate("shmbatch_batches_total"), "{{engine}}")], "ops"),
        ]),
        ("Latency", [
            panel("Queue wait", "Arrival to dispatch, per request.",
                  quantiles("shmbatch_queue_wait_seconds"), "s"),
            panel("Service time", "Dispatch to answers, per batch.",
                  quantiles("shmbatch_service_seconds"), "s"),
            panel("Queue wait by priority", "Arrival to dispatch by priority level (0 first).",
                  quantiles("shmbatch_queue_wait_by_priority_seconds", by="engine, priority"),
                  "s"),
        ]),
        ("Queue and batchers", [
            panel("Queue depth and slots in use", "Requests queued, not yet in a batch; and "
                  "slots queued or in flight (of queue_capacity).",
                  [target(gauge("shmbatch_queue_depth"), "{{engine}} queued"),
                   target(gauge("shmbatch_slots_in_use"), "{{engine}} slots in use")]),
            panel("Batchers alive", "Live batcher processes.",
                  [target(gauge("shmbatch_instances_alive"), "{{engine}}")]),
            panel("Faults", "Per second: batchers restarted, requests retried alone after "
                  "their batcher died, requests that failed alone once their batch was split, "
                  "values in the segment that failed their checks.",
                  [target(rate("shmbatch_batcher_restarts_total"), "{{engine}} restarts"),
                   target(rate("shmbatch_retried_alone_total"), "{{engine}} retried alone"),
                   target(rate("shmbatch_isolated_failures_total"),
                          "{{engine}} failed alone"),
                   target(rate("shmbatch_corrupt_total"), "{{engine}} corrupt values")], "ops"),
        ]),
        ("Admission by deadline", [
            panel("Refused as overloaded", "Share of finished requests that admission refused "
                  "(Overloaded, 503: the predicted wait ended after the deadline).",
                  [target(f"{refused} / {rate('shmbatch_requests_total')}", "{{engine}}")],
                  "percentunit"),
            panel("Predicted and seen waits", "Of the requests admitted on a counted "
                  "prediction: the mean wait predicted and seen, and the share that waited "
                  "longer than predicted.",
                  [target(f"{predicted} / {predictions}", "{{engine}} predicted"),
                   target(f"{seen} / {predictions}", "{{engine}} seen")], "s"),
            panel("Correction", "What admission's predictions are multiplied by (learned "
                  "from the waits seen), and the share of late predictions.",
                  [target(gauge("shmbatch_admission_correction", "avg"),
                          "{{engine}} correction"),
                   target(f"{rate('shmbatch_admission_late_total')} / {predictions}",
                          "{{engine}} late share")]),
        ]),
        ("Streams (iterative engines)", [
            panel("Time to first chunk", "Arrival to a request's first chunk.",
                  quantiles("shmbatch_ttft_seconds"), "s"),
            panel("Time between chunks", "Between a request's chunks.",
                  quantiles("shmbatch_chunk_seconds"), "s"),
            panel("Running batch", "Requests in the running batches; steps and chunks per "
                  "second.",
                  [target(gauge("shmbatch_active"), "{{engine}} active"),
                   target(rate("shmbatch_steps_total"), "{{engine}} steps/s"),
                   target(rate("shmbatch_chunks_total"), "{{engine}} chunks/s")]),
        ]),
        ("Tokens (variable lengths)", [
            panel("Tokens", "Lengths along the variable dim per second: real, and padded as "
                  "the backend saw them (length buckets).",
                  [target(rate("shmbatch_tokens_total", by="engine, kind"),
                          "{{engine}} {{kind}}")]),
        ]),
    ]


def laid_out(rows) -> list:
    """Every panel with an id and a place: a row header, then its panels
    COLUMNS to a line."""
    panels, y, ids = [], 0, iter(range(1, 1000))
    for title, members in rows:
        panels.append({"type": "row", "title": title, "id": next(ids), "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        y += 1
        for k, p in enumerate(members):
            x = (k % COLUMNS) * WIDTH
            if k and not x:
                y += HEIGHT
            panels.append({**p, "id": next(ids),
                           "gridPos": {"h": HEIGHT, "w": WIDTH, "x": x, "y": y}})
        y += HEIGHT
    return panels


def dashboard(title: str = "shmbatch", uid: str = "shmbatch") -> dict:
    engines = "label_values(shmbatch_requests_total, engine)"
    return {
        "title": title, "uid": uid, "tags": ["shmbatch"], "schemaVersion": SCHEMA_VERSION,
        "version": 1, "editable": True, "graphTooltip": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "browser",
        "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1},
            {"name": "engine", "label": "Engine", "type": "query", "datasource": DATASOURCE,
             "definition": engines, "query": {"query": engines, "refId": "engines"},
             "includeAll": True, "allValue": ".*", "multi": True,
             "current": {"text": "All", "value": "$__all"},
             "refresh": 2, "sort": 1, "hide": 0},
        ]},
        "panels": laid_out(sections()),
    }


def text(title: str = "shmbatch", uid: str = "shmbatch") -> str:
    return json.dumps(dashboard(title, uid), indent=2) + "\n"
