"""Triton's statistics extension: GET /v2/models[/NAME[/versions/1]]/stats.

Every figure is read from the engine's segment, where its clients and
batchers count them, so each HTTP worker answers with the engine's totals
(every worker's requests, and those of any other client), not its own.
The JSON is Triton's (docs/protocol/extension_statistics.md); what each
field holds here:

- inference_stats.success: count, the engine requests answered (a k-row
  infer is k of them); ns, each request's arrival to its end (its answer, or
  its last chunk), summed over the requests that ended in a batch (the
  segment keeps no times by outcome: a batch that failed adds its too).
- fail: count, the requests that failed or were refused (a backend error,
  an expired deadline, a timeout, QueueFull, Overloaded, InvalidInput);
  ns 0: a refusal is not timed.
- queue: the requests that reached a batch, and their waits (arrival to
  their batch's start), summed.
- compute_infer: each request's share of the batches it was in (a request
  of an iterative engine counts once per step) and the time it spent in
  them, summed; compute_input and compute_output are {0, 0}: the engine
  times gathering, the backend's call and scattering as one, all
  compute_infer.
- cache_hit, cache_miss: {0, 0}, there is no response cache.
- inference_count: the requests answered; execution_count: the backend's
  calls (batches, or an iterative engine's steps), failed ones included.
- last_inference: when the latest batch or step ended, ms since the epoch
  (0: none yet).
- batch_stats: per batch size, the calls of that size and their times as
  compute_infer; the calls of 62 requests or more (the segment times them
  together: codes.BATCH_NS_SIZES) are one entry, at their mean size.
"""
import time
from typing import List

from engine.segment import Segment
from engine.shm import codes

FAILED = (codes.W_ERRORS, codes.W_EXPIRED, codes.W_TIMEOUTS, codes.W_REJECTED,
          codes.W_OVERLOADED, codes.W_INVALID)
NONE = {"count": 0, "ns": 0}


def model_stat(name: str, version: str, seg: Segment) -> dict:
    """The $model_stat object of the engine whose segment is seg."""
    r = seg.ring
    w = r.word
    batch_ns, last_done_ns = r.batch_figures()
    sizes = [int(c) for c in r.histogram(codes.H_BATCH_SIZE)]
    answered, items = w(codes.W_ANSWERED), w(codes.W_ITEMS)
    queued = sum(int(c) for c in r.histogram(codes.H_QUEUE_WAIT))
    e2e_ns, _ = r.stream_times(codes.H_E2E)
    return {
        "name": name,
        "version": version,
        "last_inference": _epoch_ms(last_done_ns),
        "inference_count": answered,
        "execution_count": w(codes.W_BATCHES),
        "inference_stats": {
            "success": {"count": answered, "ns": int(e2e_ns)},
            "fail": {"count": sum(w(word) for word in FAILED), "ns": 0},
            "queue": {"count": queued, "ns": w(codes.W_QUEUE_WAIT_SUM_NS)},
            "compute_input": dict(NONE),
            "compute_infer": {"count": items, "ns": w(codes.W_SERVED_NS)},
            "compute_output": dict(NONE),
            "cache_hit": dict(NONE),
            "cache_miss": dict(NONE),
        },
        "batch_stats": _batch_stats(sizes, batch_ns, items),
    }


def _batch_stats(sizes: List[int], batch_ns: List[int], items: int) -> List[dict]:
    """One entry per batch size run, ascending; the sizes batch_ns times
    together (from its last on) as one, at their mean size, from the
    requests not in the sizes before."""
    last = len(batch_ns) - 1
    out = []
    for size in range(1, last + 1):
        count = sizes[size] if size < last else sum(sizes[last:])
        if count == 0:
            continue
        shown = size
        if size == last:
            exact = sum(n * c for n, c in enumerate(sizes[:last]))
            shown = max(last, round((items - exact) / count))
        out.append({"batch_size": shown, "compute_input": dict(NONE),
                    "compute_infer": {"count": count, "ns": batch_ns[size]},
                    "compute_output": dict(NONE)})
    return out


def _epoch_ms(monotonic_ns: int) -> int:
    """A CLOCK_MONOTONIC time (the segment's, any process's on this host) as
    ms since the epoch; 0 stays 0 (never)."""
    if not monotonic_ns:
        return 0
    return (time.time_ns() - time.monotonic_ns() + monotonic_ns) // 1_000_000
