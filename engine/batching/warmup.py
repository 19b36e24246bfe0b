"""Warmup (warmup=True): the model called on zeros at every batch shape before
its batcher says it is ready.

A model initialises lazily per shape (an allocator's pools, a JIT compile,
cuDNN's autotuning, ONNX Runtime's first run): without a warmup the first
requests after a start, a restart or a reload pay for it. A batcher that
warms calls its model, before it tells the supervisor it is ready (so before
the engine is ready, and before a reload hands the ring to it):

- one-shot: at every batch size of allowed_batch_sizes (else 1 and
  max_batch_size), in every length bucket at its bound (without buckets, at
  the variable dim's bound), on zeros of the padded input spec (a dict of
  them for named tensors), each variable dim's real lengths its full cut;
  with max_batch_tokens, no size above what a bucket may hold;
- iterative: join, step and leave of 1 and of max_batch_size zero prompts
  (fewer where max_batch_tokens holds fewer), a short prompt (length 1) and
  the longest (the variable dim's bound).

Each shape is called twice. The first call is the lazy initialisation the
warmup exists to absorb, no measure of service time; the second is timed
and fed to admission's fit of S(n) (admission.ServiceFit), whose first-call
rule then counts the shape as seen: the first real batch of a warmed shape
is a measure. With FIT_CALIBRATED shapes or more the fit is published at
once, so admission predicts from the first request. Nothing touches the
ring's slots or its counters: no request, batch or step is counted.

The results are checked as a request's would be. A model that raises or
returns a malformed result fails the batcher's start (so the engine's, or
the reload's) as a factory that raises does, in one line naming the shape.
"""
import numpy as np

from engine import launch
from engine.batching import policy
from engine.shm import ring

# An error's text in a failed start, on one line and bounded.
ERROR_CHARS = 500


def warm_batches(b) -> float:
    """Warms a one-shot Batcher's model; returns how long it took (ms)."""
    start_ns = ring.now_ns()
    cfg, shapes = b.seg.config, b.shapes
    if shapes is not None and shapes.bounds:
        buckets = list(enumerate(zip(shapes.bounds, shapes.most)))
    else:  # one bucket: the longest length (if any), any size
        buckets = [(0, (b.var_top or None, cfg.max_batch_size))]
    for bucket, (length, most) in buckets:
        sizes = [n for n in b.allowed if n <= most] if b.allowed else sorted({1, most})
        for rows in sizes:
            service_ns = _twice(lambda: _one_batch(b, rows, length), rows, length)
            b.fit.add(rows, service_ns)
        # a claim of n requests is padded up to an allowed size: each n whose
        # padded size was warmed starts warm (the fit's shape is (bucket, n))
        for n in range(1, most + 1):
            if policy.pad_size(n, b.allowed) in sizes:
                b.fit.shapes.add((bucket, n))
    if b.fit.publish(b.ring):
        b.expire_lead_ns = b.fit.estimate()[0]
    return (ring.now_ns() - start_ns) / 1e6


def _one_batch(b, rows: int, length) -> None:
    batch, lengths = [], []
    for spec in b.seg.config.input_specs:
        shape = list(spec.max_shape)
        if spec.var_axis is not None:
            shape[spec.var_axis] = min(length, shape[spec.var_axis])
            lengths.append(np.full(rows, shape[spec.var_axis], np.int64))
        batch.append(np.zeros((rows, *shape), spec.dtype))
    b.call.check(b.call_backend(batch, lengths or None), rows)


def warm_steps(s) -> float:
    """Warms an iterative Stepper's model; returns how long it took (ms)."""
    start_ns = ring.now_ns()
    cfg = s.cfg
    top = max((bound for _, _, bound in s.var_inputs), default=0)
    for length in sorted({1, top}) if top else [None]:
        most = s.max_active
        if s.budget is not None:  # a request reserves its input length + max_steps
            most = max(1, min(most, s.budget // ((length or 0) + cfg.max_steps)))
        for k in sorted({1, most}):
            service_ns = _twice(lambda: _one_round(s, k, length), k, length)
            s.fit.add(k, service_ns)
            s.fit.shapes.add(k)  # the fit's shape: the running batch's size
    s.fit.publish(s.ring)
    return (ring.now_ns() - start_ns) / 1e6


def _one_round(s, k: int, length) -> int:
    """join, step and leave of k zero prompts; returns the step's time (ns)."""
    batch, lengths = [], []
    for spec in s.cfg.input_specs:
        shape = list(spec.shape)
        if spec.var_axis is not None:
            shape[spec.var_axis] = min(length, spec.max_shape[spec.var_axis])
            lengths.append(np.full(k, shape[spec.var_axis], np.int64))
        batch.append(np.zeros((k, *shape), spec.dtype))
    # ids are unique among active requests only: none is active yet, and these leave
    ids = np.arange(k, dtype=np.int64)
    s.model.join(ids.copy(), *s.call.args(batch, lengths or None))
    start_ns = ring.now_ns()
    tokens = (np.zeros(k, np.int64),) if s.cfg.sampling else ()  # sampling: the last tokens
    result = s.model.step(ids.copy(), *tokens)
    service_ns = ring.now_ns() - start_ns
    s.checked(result, k)
    s.model.leave(ids.copy())
    return service_ns


def _twice(call, rows: int, length) -> int:
    """Runs call twice (the first: the lazy initialisation); returns the
    second's time (ns), or the time call returns. A failure is the batcher's
    failed start, in one line."""
    try:
        call()
        start_ns = ring.now_ns()
        measured = call()
        return measured if measured is not None else ring.now_ns() - start_ns
    except Exception as e:
        where = f"batch size {rows}" + ("" if length is None else f", length {length}")
        text = " ".join(str(e).split())[:ERROR_CHARS]
        raise launch.ChildFailed(type(e).__name__,
                                 f"warmup failed at {where}: {text}") from None
