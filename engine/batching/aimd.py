"""The adaptive batch limit (slo_ms): additive increase, multiplicative decrease.

As Clipper does: while batches finish within the latency objective the limit
grows by one batch slot at a time; when one does not, it is cut by a factor,
never below 1 nor above max_batch_size. A batch's latency is its oldest
request's, from arrival to the batch's end (queue wait + service): that is
what the objective promises a request. Pure functions: the batcher keeps the
limit and writes it to the header, where stats() reads it.
"""

DECREASE = 0.75  # the cut when a batch misses the objective
# a batch within the objective, but by less than this share of it, holds the
# limit instead of growing it: the next step up would likely miss
HEADROOM = 0.1


def next_limit(limit: int, latency_ns: int, slo_ns: int, max_batch: int) -> int:
    """The batch limit after a batch of latency_ns under the objective slo_ns."""
    if latency_ns > slo_ns:
        return max(1, min(limit - 1, int(limit * DECREASE)))
    if latency_ns > slo_ns * (1.0 - HEADROOM):
        return limit
    return min(max_batch, limit + 1)

