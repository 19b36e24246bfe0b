"""Admission by deadline: will a request finish in time, by the engine's own figures?

Two halves meet in the segment's header. Each batcher keeps a running fit of
its service time against the batch size, S(n) ~ fixed + n * per_item
(ServiceFit, least squares with exponential forgetting, so it follows a model
that slows down), and writes it to two header words. A client, before it
enqueues a request with a deadline, counts the requests queued ahead of it
(at its priority or more urgent: a popcount of the READY bitmaps) and
predicts its wait (predicted_wait_ns): the full batches ahead, spread over
the instances, then its own. If that wait would end after its deadline the
request is refused at once with Overloaded: computing it would only delay the
requests behind it, which can still make theirs.

The prediction ignores the batch already in service and is a lower bound in
that sense: it refuses only what the queue alone already dooms, so at loads
the engine keeps up with it refuses nothing.
"""
import dataclasses

def refuses(wait_ns: int, left_ns: int) -> bool:
    """The rule (applied in C, in the fused submit): refuse when the predicted
    wait, plus an eighth of it for the estimate's error, ends after the
    deadline. Under overload the queue settles where this holds with little
    to spare: without the eighth, a wait a little longer than predicted would
    make most answers late; at loads the engine keeps up with, waits are far
    shorter than deadlines and the eighth refuses nothing."""
    return wait_ns + wait_ns // 8 > left_ns


# How much weight a new batch's service time has against the past ones:
# about the last 1/FORGET batches count.
FORGET = 0.02
KEEP = 1.0 - FORGET  # each older batch's weight, relative to the next one's
# A batch slower than this many times the fit's prediction counts as this many.
OUTLIER = 4.0
# The fit is solved after each of the first REFIT batches, then every REFIT.
REFIT = 8


def predicted_wait_ns(queued_ahead: int, batch_limit: int, instances: int,
                      fixed_ns: int, per_item_ns: float, busy_since_ns: int = 0,
                      now_ns: int = 0) -> int:
    """Enqueue to answer for a request with queued_ahead requests before it:
    what is left of the batch in service when every batcher is busy (since
    busy_since_ns, by the fit), the full rounds of batches ahead, its own.
    Nothing ahead and a batcher idle: 0, never a refusal."""
    if not queued_ahead and not busy_since_ns:
        return 0  # an idle engine takes it at once: its figures may be a stale warm-up's
    limit = max(1, batch_limit)
    full_batch_ns = fixed_ns + limit * per_item_ns
    in_service_ns = max(0.0, full_batch_ns - (now_ns - busy_since_ns)) if busy_since_ns else 0.0
    per_round = limit * max(1, instances)
    full_rounds = queued_ahead // per_round
    own_batch = min(queued_ahead - full_rounds * per_round + 1, limit)
    return int(in_service_ns + full_rounds * full_batch_ns + fixed_ns + own_batch * per_item_ns)


@dataclasses.dataclass(slots=True)
class ServiceFit:
    """S(n) = fixed + n * per_item by weighted least squares over the batches
    seen, each older batch weighing (1 - FORGET) times less. The fit is solved
    after each of the first REFIT batches, then every REFIT batches: it moves
    slowly, and a batch's Python time is the fast path's."""
    w: float = 0.0
    n: float = 0.0
    nn: float = 0.0
    s: float = 0.0
    ns: float = 0.0
    batches: int = 0
    fixed_ns: int = 0
    per_item_ns: float = 0.0

    def add(self, batch_size: int, service_ns: int) -> bool:
        """Adds a batch; True when the fit was solved anew. A batch far slower
        than the fit predicts (a stall, a recompile) counts as OUTLIER times
        the prediction, so it cannot lock admission out for the many batches
        the fit takes to forget it."""
        # run per batch by the batcher: plain float arithmetic, no builtin calls
        batches = self.batches
        if batches:
            cap = OUTLIER * (self.fixed_ns + batch_size * self.per_item_ns) + 1
            if service_ns > cap:
                service_ns = cap
        self.w = self.w * KEEP + 1.0
        self.n = self.n * KEEP + batch_size
        self.nn = self.nn * KEEP + batch_size * batch_size
        self.s = self.s * KEEP + service_ns
        self.ns = self.ns * KEEP + batch_size * service_ns
        self.batches = batches = batches + 1
        if batches > REFIT and batches % REFIT:
            return False
        self.fixed_ns, self.per_item_ns = self._solve()
        return True

    def estimate(self):
        """(fixed_ns, per_item_ns) as last solved; 0 and 0.0 before any batch."""
        return self.fixed_ns, self.per_item_ns

    def _solve(self):
        """With one batch size seen so far, all of its time is taken as fixed
        (no slope can be told)."""
        spread = self.w * self.nn - self.n * self.n
        if spread <= 1e-9 * self.w * self.nn:
            return int(self.s / self.w), 0.0
        per_item = max(0.0, (self.w * self.ns - self.n * self.s) / spread)
        fixed = max(0.0, (self.s - per_item * self.n) / self.w)
        return int(fixed), per_item
