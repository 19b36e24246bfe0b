"""The engine's rules restated on plain numbers: specifications the tests
hold the C to. The runtime never calls these; the C is each rule's one
implementation."""
import dataclasses
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class Decision:
    """take: indices into the ready list, in the order taken (empty: none
    now); wait_ns: how long to wait before asking again (None: until work
    comes)."""
    take: np.ndarray
    wait_ns: Optional[int]


def next_batch(rule, arrival_ns: np.ndarray, now_ns: int, draining: bool = False,
               priority: Optional[np.ndarray] = None, limit: Optional[int] = None) -> Decision:
    """The flush rule (a policy.FlushRule's thresholds) on the ready requests'
    arrival stamps and priorities (0 the most urgent; none: all 0), listed in
    slot order: flush when max_n are ready or the OLDEST of any level is due;
    a batch takes the most urgent first, the oldest first within a level."""
    n = len(arrival_ns)
    if n == 0:
        return Decision(np.empty(0, np.intp), None)
    max_n, flush_n, cutoff_ns = rule.thresholds(now_ns, draining, limit)
    oldest = int(arrival_ns.min())
    if n < flush_n and oldest > cutoff_ns:
        return Decision(np.empty(0, np.intp), rule.wait_ns(oldest, now_ns))
    if priority is None:
        priority = np.zeros(n, np.int64)
    order = np.lexsort((np.arange(n), arrival_ns, priority))  # ties: the lower slot first
    return Decision(order[:max_n], 0)


def predicted_wait_ns(queued_ahead: int, batch_limit: int, instances: int,
                      fixed_ns: int, per_item_ns: float, busy_since_ns: int = 0,
                      now_ns: int = 0) -> int:
    """Admission's estimate, enqueue to answer, for a request with
    queued_ahead requests before it: what is left of the batch in service when
    every batcher is busy (since busy_since_ns, by the fit), the full rounds
    of batches ahead, its own. Nothing ahead and a batcher idle: 0."""
    if not queued_ahead and not busy_since_ns:
        return 0  # an idle engine takes it at once: its figures may be a stale warm-up's
    limit = max(1, batch_limit)
    full_batch_ns = fixed_ns + limit * per_item_ns
    in_service_ns = max(0.0, full_batch_ns - (now_ns - busy_since_ns)) if busy_since_ns else 0.0
    per_round = limit * max(1, instances)
    full_rounds = queued_ahead // per_round
    own_batch = min(queued_ahead - full_rounds * per_round + 1, limit)
    return int(in_service_ns + full_rounds * full_batch_ns + fixed_ns + own_batch * per_item_ns)
