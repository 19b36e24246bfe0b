"""Which ready requests form the next batch: the flush rule, as pure functions.

The rule: with nothing queued, wait for work with no
timer; once something is queued, flush when max_batch requests are ready or
when the OLDEST (of any priority) has waited max_delay, whichever comes
first; a batch takes the most urgent priority first and the oldest first
within it, at most max_batch. While the engine drains (stopping), it
flushes whatever is ready at once.

The batcher applies the rule in C, in one pass and one call per batch
(ring.claim), given the rule's thresholds() from here: the C is its one
implementation (the tests hold it to a specification of their own).

BatchShapes are the shapes a compiled model wants, as thresholds the C claim
applies in the same pass: length buckets (a batch holds one bucket; with
max_batch_tokens, at most tokens // bound of it) and allowed batch sizes.
Allowed sizes' rule: of r ready, claim r and pad up to the next allowed size,
unless rounding down to the allowed size below leaves fewer requests waiting
than rounding up would add padding rows; then claim that size now (the rest
go with the next batch, which by then has company).
"""
import bisect
import dataclasses
from typing import Optional

from engine.shm import ring


@dataclasses.dataclass(frozen=True)
class FlushRule:
    max_batch: int
    max_delay_ns: int
    # after a batch, or a wake on the work word (a client's expect_work: a
    # request comes), with nothing queued: how long to spin before sleeping on
    # it (a request that comes within it costs its client no wake of a
    # sleeping process); one spin per batch or wake at most, so an idle batcher sleeps
    idle_spin_ns: int = ring.SPIN_NS

    @classmethod
    def of(cls, cfg) -> "FlushRule":
        """The rule of an EngineConfig: its idle_spin_us, else ring.SPIN_NS."""
        spin_ns = ring.SPIN_NS if cfg.idle_spin_us is None else int(cfg.idle_spin_us * 1000)
        return cls(cfg.max_batch_size, int(cfg.max_delay_ms * 1e6), spin_ns)

    def thresholds(self, now_ns: int, draining: bool = False, limit: Optional[int] = None):
        """(max_n, flush_n, cutoff_ns) for the C claim: take up to max_n of the
        oldest if flush_n are ready or the oldest arrived at or before cutoff_ns.
        A batch limit below max_batch (AIMD's) is a smaller full batch."""
        max_n = self.max_batch
        if limit is not None and limit < max_n:  # (no min()/max() calls: run per batch)
            max_n = limit if limit > 1 else 1
        if draining:
            return max_n, 1, ring.MAX_NS
        # the clock starts at boot: a delay longer than the uptime is a cutoff
        # before every arrival (the C takes it unsigned)
        cutoff_ns = now_ns - self.max_delay_ns
        return max_n, max_n, cutoff_ns if cutoff_ns > 0 else 0

    def wait_ns(self, oldest_ns: int, now_ns: int) -> int:
        """With requests queued but not due: how long until the oldest is."""
        return max(0, oldest_ns + self.max_delay_ns - now_ns)


def pad_size(n: int, allowed) -> int:
    """The batch size the backend sees for n requests: the smallest allowed
    size >= n (n itself without allowed sizes)."""
    if not allowed:
        return n
    return next((a for a in allowed if a >= n), allowed[-1])


def fit_allowed(limit: int, allowed) -> int:
    """The largest batch that is still at most `limit` once padded: the largest
    allowed size <= limit (the smallest allowed size if none is; limit itself
    without allowed sizes)."""
    if not allowed:
        return limit
    return max((a for a in allowed if a <= limit), default=allowed[0])


def take_table(allowed, max_n: int) -> list:
    """take[r] for r = 0..max_n: how many of r eligible requests to claim
    (see the module's rule); [] without allowed sizes."""
    if not allowed:
        return []
    take = []
    for r in range(max_n + 1):
        if r >= allowed[-1]:
            take.append(allowed[-1])
            continue
        up = pad_size(r, allowed)
        down = max((a for a in allowed if a <= r), default=None)
        take.append(down if down is not None and r - down < up - r else r)
    return take


@dataclasses.dataclass(frozen=True)
class BatchShapes:
    """bounds: length bucket bounds (ascending; () none); most[b]: at most so
    many requests in a batch of bucket b; allowed: allowed batch sizes;
    fixed: batches are padded to their bucket's bound (length buckets), not
    to their longest request (max_batch_tokens alone: one bucket)."""
    bounds: tuple = ()
    most: tuple = ()
    allowed: tuple = ()
    fixed: bool = False

    @classmethod
    def of(cls, max_batch: int, allowed=None, buckets=None, max_tokens=None,
           top: Optional[int] = None) -> Optional["BatchShapes"]:
        """The shapes of an engine's knobs (top: the largest variable bound);
        None when there are none (the claim's fast path)."""
        if not allowed and not buckets and not max_tokens:
            return None
        bounds = tuple(buckets or ((top,) if max_tokens else ()))
        most = tuple(max(1, min(max_batch, max_tokens // b)) if max_tokens else max_batch
                     for b in bounds)
        # a batch is padded up to an allowed size: its claim is capped by the
        # allowed size below its cap, so the padded batch keeps the budget too
        most = tuple(fit_allowed(n, allowed) for n in most)
        return cls(bounds, most, tuple(allowed or ()), bool(buckets))

    def take(self, max_n: int) -> list:
        return take_table(self.allowed, max_n)

    def bucket_of(self, length: int) -> int:
        """The bucket of a request this long, as the C claim puts it: the
        first whose bound holds it (the last for any longer)."""
        return min(bisect.bisect_left(self.bounds, length), max(0, len(self.bounds) - 1))

    def padded_length(self, bucket: int, longest: int) -> int:
        """Where a batch of bucket `bucket` is cut along the variable dim: the
        bucket's bound (a fixed shape), or without buckets the longest request."""
        return self.bounds[bucket] if self.fixed else longest
