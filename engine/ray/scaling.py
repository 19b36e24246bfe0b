"""What a replica reports to Ray Serve's autoscaler, and a policy that scales on it.

Each replica's record_autoscaling_stats() returns its node engine's recent
queue wait: the mean arrival-to-dispatch time of the requests dispatched
since the replica's previous report (from the segment's counters, so every
replica of a node reports the same engine, whoever sent the requests), and
the engine's predicted wait for a request sent now. QueueWaitPolicy, named
in an autoscaling_config's policy, sizes the deployment as a horizontal pod
autoscaler does: replicas x (mean queue wait / target), held within 10 %
of the target; Serve then applies min/max_replicas, the scaling factors
and the up/down delays.
"""
import math
from typing import Any, Dict, Optional, Tuple

from engine.segment import Segment
from engine.shm import codes

QUEUE_WAIT = "queue_wait_ms"
PREDICTED_WAIT = "predicted_wait_ms"
TOLERANCE = 0.1  # a mean within this share of the target keeps the count


class RecentQueueWait:
    """The mean queue wait of the requests dispatched since the last read."""

    def __init__(self) -> None:
        self._incarnation: Optional[int] = None
        self._sum_ns = self._count = 0

    def read_ms(self, seg: Segment) -> float:
        r = seg.ring
        sum_ns = r.word(codes.W_QUEUE_WAIT_SUM_NS)
        count = int(r.histogram(codes.H_QUEUE_WAIT).sum())
        if seg.incarnation != self._incarnation:  # a restarted engine counts from zero
            self._incarnation, self._sum_ns, self._count = seg.incarnation, 0, 0
        waited_ns, n = sum_ns - self._sum_ns, count - self._count
        self._sum_ns, self._count = sum_ns, count
        return waited_ns / n / 1e6 if n > 0 else 0.0


class QueueWaitPolicy:
    """A Serve autoscaling policy (a class: Serve makes one with the
    policy_kwargs and calls it each tick) on the replicas' reported
    queue_wait_ms (or `metric`)."""

    def __init__(self, target_queue_wait_ms: float = 20.0, metric: str = QUEUE_WAIT) -> None:
        if not target_queue_wait_ms > 0:
            raise ValueError(f"expected target_queue_wait_ms > 0, got {target_queue_wait_ms}")
        self.target_ms, self.metric = float(target_queue_wait_ms), metric

    def __call__(self, ctx: Any) -> Tuple[int, Dict[str, Any]]:
        current = ctx.current_num_replicas
        reported = (ctx.aggregated_metrics or {}).get(self.metric) or {}
        if not reported or current == 0:
            return ctx.target_num_replicas, {}
        ratio = (sum(reported.values()) / len(reported)) / self.target_ms
        if abs(ratio - 1.0) <= TOLERANCE:
            return current, {}
        return math.ceil(current * ratio), {}
