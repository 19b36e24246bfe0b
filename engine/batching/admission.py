"""Admission by deadline: will a request finish in time, by the engine's own figures?

Two halves meet in the segment's header. Each batcher keeps a running fit of
its service time against the batch size, S(n) ~ fixed + n * per_item
(ServiceFit, least squares with exponential forgetting, so it follows a model
that slows down), and publishes it in two header words once calibrated
(SB_FIT_CALIBRATED batches; a shape's first batch is no measure). A client,
before it enqueues a request with a deadline, counts the requests queued
ahead of it (at its priority or more urgent: a popcount of the READY
bitmaps) and predicts its wait: what is left of the batch in service, the
full batches ahead spread over the instances, then its own. If that wait,
plus an eighth of it for the estimate's error, would end after its deadline,
the request is refused at once with Overloaded: computing it would only
delay the requests behind it, which can still make theirs. Before the fit is
calibrated there is no prediction, and nothing is refused.

Predictions correct themselves. One that counted the queue and admitted its
request is stored in the request's slot; the batcher that answers it
compares it with the wait seen, and one that expires unstarted counts as
having waited until its deadline at least (left out, the correction would be
judged by the requests that made it alone). Every prediction is multiplied
by seen / predicted over the recent comparisons, within [1/16, 4]: a model
noisier than its fit, or a queue that drains faster than the fit says, stops
refusing requests that would have made their deadline, and one slower makes
the rule stricter. stats()["admission"] says how they compared.

An iterative engine's batches are its steps, and the fit is of step time
against the requests a step holds. A request there waits for its first chunk:
the rest of the running step, a step per full round of joiners ahead, then
its own first step, which holds the running requests as well (each batcher's
share of them). When every running batch is full, it waits as well for the
steps until a running request reaches its max_steps (each batcher publishes
that figure): a request that cannot start in time is refused at once.

The estimate, the correction and the rule are the C's (sb_predicted_wait_ns,
sb_refuses, applied by sb_admit; judged in stats.c and claim.c); this module
holds the fit.
"""
from engine.shm import codes, ring

# The fit is solved after each of its first REFIT batches, then every REFIT
# (its constants are the C's: ring.h, sb_fit).
REFIT = codes.FIT_REFIT


class ServiceFit:
    """S(n) = fixed + n * per_item by weighted least squares over the batches
    seen, each older batch weighing 1 - 1/SB_FIT_MEMORY times less (sb_fit_add).
    Computed in C: a batcher's finish_batch feeds it each batch, with no
    Python on the fast path; add() is that same step, for a caller (a test)
    that has only the figures.

    The first batch of each shape is not a measure: a model initialises
    lazily per shape (allocations, autotuning, a compile), and that first
    call can take seconds. measuring(shape) says which fit a batch of that
    shape feeds: none the first time the shape is seen (with warmup, the
    warmed shapes were seen before the batcher was ready)."""

    def __init__(self, warmup: int = 0):
        self.c_fit = ring.new_fit(warmup)  # skips the first `warmup` batches
        self.shapes = set()

    def measuring(self, shape):
        """The c_fit for finish_batch/finish_step, or NULL: the shape's first batch."""
        if shape in self.shapes:
            return self.c_fit
        self.shapes.add(shape)
        return ring.NO_FIT

    def publish(self, r: ring.Ring) -> bool:
        """Publishes the fit for admission, as finish_batch does, once it is
        calibrated (warmup's calls fed it: engine.batching.warmup); True if so."""
        if self.c_fit.batches < codes.FIT_CALIBRATED:
            return False
        fixed_ns, per_item_ns = self.estimate()
        r.set_word(codes.W_FIT_FIXED_NS, fixed_ns)
        r.set_word(codes.W_FIT_ITEM_PS, int(per_item_ns * 1000))
        return True

    def add(self, batch_size: int, service_ns: int) -> bool:
        """Adds a batch; True when the fit was solved anew."""
        return bool(ring.fit_add(self.c_fit, batch_size, int(service_ns)))

    @property
    def batches(self) -> int:
        return self.c_fit.batches

    def estimate(self):
        """(fixed_ns, per_item_ns) as last solved; 0 and 0.0 before any batch."""
        return int(self.c_fit.fixed_ns), self.c_fit.per_item_ns
