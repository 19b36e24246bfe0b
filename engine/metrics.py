"""The engine's figures, read from its segment (contract section 5).

Counters and histograms live in the segment, written by clients and
batchers with relaxed atomics, so any process of the same user can read
them with no help from the engine (``shmbatch status``). Percentiles come
from the log-linear histograms (4 steps per power of two, so a figure is
within 25 % of the truth) and are clamped to the exact recorded maximum.
"""
import numpy as np

from engine import liveness, ring

_LOWER_NS, _UPPER_NS = ring.hist_bounds_ns()


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


def batcher_pids(r: ring.Ring, instances: int):
    """The live batchers' pids, as the batchers registered them."""
    pids = []
    for i in range(instances):
        pid = r.word(ring.W_BATCHER_PID + i)
        if pid and liveness.is_alive(pid, r.word(ring.W_BATCHER_START + i)):
            pids.append(pid)
    return pids


def read_stats(segment) -> dict:
    r = segment.ring
    w = r.word
    batches, items = w(ring.W_BATCHES), w(ring.W_ITEMS)
    sizes = r.histogram(ring.H_BATCH_SIZE)  # bucket n counts batches of n (n < 127)
    pids = batcher_pids(r, segment.config.instances)
    ctl = np.zeros(segment.capacity, dtype=np.uint64)
    r.snapshot(ctl, np.zeros_like(ctl))
    return {
        "name": segment.name,
        "requests_total": w(ring.W_REQUESTS),
        "answered_total": w(ring.W_ANSWERED),
        "rejected_total": w(ring.W_REJECTED),
        "timeouts_total": w(ring.W_TIMEOUTS),
        "errors_total": w(ring.W_ERRORS),
        "invalid_total": w(ring.W_INVALID),
        "batches_total": batches,
        "queue_depth": int((ring.ctl_state(ctl) == ring.READY).sum()),
        "slots_in_use": int((ring.ctl_state(ctl) != ring.FREE).sum()),
        "avg_batch_size": items / batches if batches else 0.0,
        "batch_size_counts": {int(n): int(c) for n, c in enumerate(sizes) if c},
        "queue_wait_ms": _summary_ms(r.histogram(ring.H_QUEUE_WAIT), w(ring.W_QUEUE_WAIT_MAX_NS),
                                     w(ring.W_QUEUE_WAIT_SUM_NS)),
        "service_ms": _summary_ms(r.histogram(ring.H_SERVICE), w(ring.W_SERVICE_MAX_NS),
                                  w(ring.W_SERVICE_SUM_NS)),
        "zero_copy_batches": w(ring.W_ZERO_COPY),
        "gathered_batches": w(ring.W_GATHERED),
        "reclaimed_slots_total": w(ring.W_RECLAIMED),
        "stale_completions_total": w(ring.W_STALE),
        "batcher_restarts_total": w(ring.W_RESTARTS),
        "instances": segment.config.instances,
        "instances_alive": len(pids),
        "batcher_pids": pids,
        "queue_capacity": segment.capacity,
        "max_batch_size": segment.config.max_batch_size,
        "max_delay_ms": segment.config.max_delay_ms,
    }
