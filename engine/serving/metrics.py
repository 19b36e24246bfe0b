"""The engine's figures, read from its segment.

Counters and histograms live in the segment, written by clients and
batchers with relaxed atomics, so any process of the same user can read
them with no help from the engine (``shmbatch status``). Percentiles come
from the log-linear histograms (4 steps per power of two, so a figure is
within 25 % of the truth) and are clamped to the exact recorded maximum.
"""
import numpy as np

from engine.shm import codes, liveness, ring

_LOWER_NS, _UPPER_NS = ring.hist_bounds_ns()

# The counters, each named once: (stats() key, header word, Prometheus outcome
# of shmbatch_requests_total or None).
COUNTERS = (
    ("requests_total", codes.W_REQUESTS, None),
    ("answered_total", codes.W_ANSWERED, "ok"),
    ("rejected_total", codes.W_REJECTED, "rejected"),
    ("timeouts_total", codes.W_TIMEOUTS, "timeout"),
    ("withdrawn_total", codes.W_WITHDRAWN, "withdrawn"),  # their client withdrew them
    ("errors_total", codes.W_ERRORS, "error"),
    ("invalid_total", codes.W_INVALID, "invalid"),
    ("batches_total", codes.W_BATCHES, None),
    ("zero_copy_batches", codes.W_ZERO_COPY, None),
    ("gathered_batches", codes.W_GATHERED, None),
    ("reclaimed_slots_total", codes.W_RECLAIMED, None),
    ("stale_completions_total", codes.W_STALE, None),
    ("batcher_restarts_total", codes.W_RESTARTS, None),
    ("overloaded_total", codes.W_OVERLOADED, "overloaded"),
    ("expired_total", codes.W_EXPIRED, "expired"),
    ("isolated_failures_total", codes.W_ISOLATED, None),
    ("isolation_calls_total", codes.W_RETRY_CALLS, None),
    ("retried_alone_total", codes.W_RETRIED, None),  # after their batcher died
    ("tokens_total", codes.W_TOKENS, None),
    ("padded_tokens_total", codes.W_PADDED_TOKENS, None),
)


def percentile_ns(counts: np.ndarray, q: float) -> float:
    """The q-quantile (0..1) of a ring histogram, interpolated within its bucket."""
    counts = counts.astype(np.float64)
    total = counts.sum()
    if total == 0:
        return 0.0
    cum = np.cumsum(counts)
    rank = q * total
    b = int(np.searchsorted(cum, rank, side="left"))
    b = min(b, len(counts) - 1)
    below = cum[b] - counts[b]
    within = (rank - below) / counts[b] if counts[b] else 0.0
    return float(_LOWER_NS[b] + within * (_UPPER_NS[b] - _LOWER_NS[b]))


def _summary_ms(counts: np.ndarray, max_ns: int, sum_ns: int) -> dict:
    clamp = lambda v: min(v, max_ns) / 1e6  # noqa: E731
    n = int(counts.sum())
    return {"p50": clamp(percentile_ns(counts, 0.50)),
            "p99": clamp(percentile_ns(counts, 0.99)),
            "max": max_ns / 1e6,
            "mean": sum_ns / n / 1e6 if n else 0.0}


def batcher_numbers(r: ring.Ring, instances: int) -> range:
    """The batcher numbers of the batchers serving now: a reload starts its new
    batchers in the other bank of `instances` numbers (supervisor.reload), and
    the bank follows the epoch word (E, then E+1 while the old ones retire,
    then E+2 for the new ones: each bank holds two epochs)."""
    bank = (r.word(codes.W_EPOCH) // 2) % 2
    if (bank + 1) * instances > codes.MAX_INSTANCES:  # no reload for so many: one bank
        bank = 0
    return range(bank * instances, (bank + 1) * instances)


def batcher_pids(r: ring.Ring, instances: int):
    """The live batchers' pids, as the batchers registered them."""
    pids = []
    for i in batcher_numbers(r, instances):
        pid = r.word(codes.W_BATCHER_PID + i)
        if pid and liveness.is_alive(pid, r.word(codes.W_BATCHER_START + i)):
            pids.append(pid)
    return pids


def read_stats(segment) -> dict:
    """Every figure of stats(). From a header-only
    mapping (a dead engine's status) the slot figures are None: they would
    need the slots' control words, which live outside the header."""
    r = segment.ring
    w = r.word
    batches, items = w(codes.W_BATCHES), w(codes.W_ITEMS)
    sizes = r.histogram(codes.H_BATCH_SIZE)  # bucket n counts batches of n (n < 127)
    pids = batcher_pids(r, segment.config.instances)
    levels = segment.config.priority_levels
    queue_depth = slots_in_use = None
    if not segment.header_only:
        ctl = np.zeros(segment.capacity, dtype=np.uint64)
        r.snapshot(ctl, np.zeros_like(ctl))
        queue_depth = int((ring.ctl_state(ctl) == codes.READY).sum())
        slots_in_use = int((ring.ctl_state(ctl) != codes.FREE).sum())
    return {
        "name": segment.name,
        **{key: w(word) for key, word, _ in COUNTERS},
        "queue_depth": queue_depth,
        "slots_in_use": slots_in_use,
        "avg_batch_size": items / batches if batches else 0.0,
        "batch_size_counts": {int(n): int(c) for n, c in enumerate(sizes) if c},
        "queue_wait_ms": _summary_ms(r.histogram(codes.H_QUEUE_WAIT), w(codes.W_QUEUE_WAIT_MAX_NS),
                                     w(codes.W_QUEUE_WAIT_SUM_NS)),
        "service_ms": _summary_ms(r.histogram(codes.H_SERVICE), w(codes.W_SERVICE_MAX_NS),
                                  w(codes.W_SERVICE_SUM_NS)),
        "instances": segment.config.instances,
        "instances_alive": len(pids),
        "batcher_pids": pids,
        "queue_capacity": segment.capacity,
        "max_batch_size": segment.config.max_batch_size,
        "max_delay_ms": segment.config.max_delay_ms,
        "segment_bytes": segment.total_bytes,  # all of it committed in /dev/shm
        "batch_limit": segment.batch_limit(),
        "priority": [_summary_ms(*r.level_wait(level)) for level in range(levels)],
        # values in the segment that failed their checks: another process writes into it
        "corrupt_total": r.corrupt_total(),
        "admission": admission_stats(r),
        **_stream_stats(r),
    }


def admission_stats(r: ring.Ring) -> dict:
    """How admission by deadline judged, against what came of it: how many it
    refused (Overloaded), whether its figures are calibrated (none: it refuses
    nothing), and of the requests it admitted on a counted prediction, the mean
    predicted and seen waits, the share that waited longer than predicted, and
    the correction its predictions are now multiplied by."""
    compared = r.word(codes.W_ADMIT_COMPARED)
    scale = r.word(codes.W_ADMIT_SCALE) or codes.SCALE_ONE
    return {
        "refused_total": r.word(codes.W_OVERLOADED),
        "calibrated": bool(r.word(codes.W_FIT_FIXED_NS) or r.word(codes.W_FIT_ITEM_PS)),
        "compared_total": compared,
        "predicted_ms_mean": r.word(codes.W_ADMIT_PREDICTED_NS) / compared / 1e6 if compared else 0.0,
        "seen_ms_mean": r.word(codes.W_ADMIT_SEEN_NS) / compared / 1e6 if compared else 0.0,
        "late_total": r.word(codes.W_ADMIT_LATE),
        "correction": scale / codes.SCALE_ONE,
    }


def _stream_stats(r: ring.Ring) -> dict:
    """An iterative engine's figures (all 0 for a one-shot one)."""
    steps, chunks, active = r.stream_counts()
    times = {}
    for key, which in (("ttft_ms", codes.H_TTFT), ("chunk_ms", codes.H_CHUNK)):
        sum_ns, max_ns = r.stream_times(which)
        summary = _summary_ms(r.histogram(which), max_ns, sum_ns)
        times[key] = {k: summary[k] for k in ("p50", "p99", "max")}
    return {"steps_total": steps, "chunks_total": chunks, "active": active, **times}


# -- Prometheus ---------------------------------------------------

# seconds: from 10 us to 10 s, so both an identity backend and an overloaded
# queue land inside the buckets
LATENCY_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01,
                     0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _cumulative(counts: np.ndarray, upper: np.ndarray, bounds) -> list:
    """Prometheus buckets from a ring histogram: a ring bucket counts under the
    first bound at or above its upper edge (so a figure is never understated)."""
    out = [(str(b), float(counts[upper <= b].sum())) for b in bounds]
    return out + [("+Inf", float(counts.sum()))]


# The families that are one figure of stats() each: (kind, stats() key, name, help).
FAMILIES = (
    ("counter", "batches_total", "shmbatch_batches", "Batches run."),
    ("counter", "batcher_restarts_total", "shmbatch_batcher_restarts", "Batchers restarted."),
    ("counter", "isolated_failures_total", "shmbatch_isolated_failures",
     "Requests that failed alone once their batch was split."),
    ("counter", "retried_alone_total", "shmbatch_retried_alone",
     "Requests retried alone after their batcher died."),
    ("counter", "corrupt_total", "shmbatch_corrupt",
     "Values in the segment that failed their checks (another process wrote into it)."),
    ("gauge", "batch_limit", "shmbatch_batch_limit", "The batch limit (AIMD with slo_ms)."),
    ("gauge", "queue_depth", "shmbatch_queue_depth", "Requests queued, not yet in a batch."),
    ("gauge", "slots_in_use", "shmbatch_slots_in_use", "Slots queued or in flight."),
    ("gauge", "instances_alive", "shmbatch_instances_alive", "Live batcher processes."),
    ("counter", "chunks_total", "shmbatch_chunks", "Chunks streamed (iterative engines)."),
    ("counter", "steps_total", "shmbatch_steps", "Steps run (iterative engines)."),
    ("gauge", "active", "shmbatch_active", "Requests in the running batches (iterative)."),
)
# Admission's account of itself (refusals are shmbatch_requests{outcome="overloaded"})
ADMISSION_FAMILIES = (
    ("counter", "compared_total", "shmbatch_admission_predictions",
     "Requests admitted on a counted prediction, compared with the wait they saw."),
    ("counter", "late_total", "shmbatch_admission_late",
     "Of those, the ones that waited longer than predicted."),
    ("gauge", "correction", "shmbatch_admission_correction",
     "What admission's predictions are multiplied by, learned from the waits seen."),
)
# The time histograms: (name, help, ring histogram, header word of its sum)
TIME_HISTOGRAMS = (
    ("shmbatch_queue_wait_seconds", "Arrival to dispatch, per request.",
     codes.H_QUEUE_WAIT, codes.W_QUEUE_WAIT_SUM_NS),
    ("shmbatch_service_seconds", "Dispatch to answers, per batch.",
     codes.H_SERVICE, codes.W_SERVICE_SUM_NS),
    ("shmbatch_ttft_seconds", "Arrival to first chunk, per request (iterative).",
     codes.H_TTFT, None),
    ("shmbatch_chunk_seconds", "Between a request's chunks (iterative).", codes.H_CHUNK, None),
)


class Collector:
    """A prometheus_client collector that reads the engine's segment on each scrape."""

    def __init__(self, segment):
        self.segment = segment

    def collect(self):
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )
        kinds = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}
        r, engine = self.segment.ring, self.segment.name
        stats = read_stats(self.segment)
        requests = CounterMetricFamily("shmbatch_requests", "Requests by outcome.",
                                       labels=["engine", "outcome"])
        for key, _, outcome in COUNTERS:
            if outcome is not None:
                requests.add_metric([engine, outcome], stats[key])
        yield requests
        for kind, key, name, doc in FAMILIES:
            family = kinds[kind](name, doc, labels=["engine"])
            family.add_metric([engine], stats[key])
            yield family
        for kind, key, name, doc in ADMISSION_FAMILIES:
            family = kinds[kind](name, doc, labels=["engine"])
            family.add_metric([engine], stats["admission"][key])
            yield family
        seconds = CounterMetricFamily(
            "shmbatch_admission_wait_seconds", "Of the requests admitted on a counted "
            "prediction: their waits as predicted, and as seen.", labels=["engine", "kind"])
        seconds.add_metric([engine, "predicted"], r.word(codes.W_ADMIT_PREDICTED_NS) / 1e9)
        seconds.add_metric([engine, "seen"], r.word(codes.W_ADMIT_SEEN_NS) / 1e9)
        yield seconds
        tokens = CounterMetricFamily("shmbatch_tokens", "Lengths along the variable dim: "
                                     "real, and padded as the backend saw them.",
                                     labels=["engine", "kind"])
        tokens.add_metric([engine, "real"], stats["tokens_total"])
        tokens.add_metric([engine, "padded"], stats["padded_tokens_total"])
        yield tokens
        sizes = r.histogram(codes.H_BATCH_SIZE)
        hist = HistogramMetricFamily("shmbatch_batch_size", "Requests per batch.", labels=["engine"])
        hist.add_metric([engine], _cumulative(sizes, np.arange(len(sizes)), BATCH_BUCKETS),
                        sum_value=float(r.word(codes.W_ITEMS)))
        yield hist
        for name, doc, which, sum_word in TIME_HISTOGRAMS:
            h = HistogramMetricFamily(name, doc, labels=["engine"])
            h.add_metric([engine], _cumulative(r.histogram(which), _UPPER_NS / 1e9,
                                               LATENCY_BUCKETS_S),
                         sum_value=(r.word(sum_word) if sum_word is not None
                                    else r.stream_times(which)[0]) / 1e9)
            yield h
        by_level = HistogramMetricFamily("shmbatch_queue_wait_by_priority_seconds",
                                         "Arrival to dispatch, per request, by priority level.",
                                         labels=["engine", "priority"])
        for level in range(self.segment.config.priority_levels):
            counts, _, sum_ns = r.level_wait(level)
            by_level.add_metric([engine, str(level)],
                                _cumulative(counts, _UPPER_NS / 1e9, LATENCY_BUCKETS_S),
                                sum_value=sum_ns / 1e9)
        yield by_level


class Collectors:
    """The figures of several engines on one /metrics: each family once, with
    every engine's samples (a registry of one Collector per engine would
    write each family once per engine, which Prometheus refuses)."""

    def __init__(self, segments):
        self.parts = [Collector(segment) for segment in segments]

    # a scrape iterates the list it found: these replace it, never change it
    def add(self, segment) -> None:
        self.parts = [*self.parts, Collector(segment)]

    def remove(self, segment) -> None:
        self.parts = [p for p in self.parts if p.segment is not segment]

    def segments(self) -> list:
        """The engines' segments now (a scrape's, as it begins)."""
        return [p.segment for p in self.parts]

    def collect(self):
        families = {}
        for part in self.parts:
            for family in part.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return iter(families.values())


def serve_http(segments, port: int, host: str = "127.0.0.1", compat=()):
    """Serves GET /metrics for these engines' segments (a list, or one, or
    Collectors, whose engines may change), and with compat ("vllm", "triton")
    their figures under those names too (engine.serving.metrics_compat);
    returns (server, thread)."""
    from prometheus_client import CollectorRegistry, start_http_server
    registry = CollectorRegistry()
    if not isinstance(segments, Collectors):
        segments = Collectors(segments if isinstance(segments, (list, tuple)) else [segments])
    registry.register(segments)
    if compat:
        from engine.serving import metrics_compat
        return metrics_compat.serve_http(registry, segments.segments, compat, read_stats, port,
                                         host)
    return start_http_server(port, addr=host, registry=registry)
