"""OpenTelemetry spans of Client requests, for a caller that traces.

With opentelemetry-api installed and a tracer provider set
(opentelemetry.trace.set_tracer_provider), each request records one span
`shmbatch.request` under the context that was current where the request was
made (the caller's thread, or its asyncio task: captured then, since its
answer may be taken in the completion thread), from the request's arrival to
when its answer (or error) was taken, with the attributes

    shmbatch.engine         the engine's name
    shmbatch.batch_size     requests in the batch that answered it    } the engine's stamps,
    shmbatch.queue_wait_ms  arrival to the claim by a batcher          } where they are read
    shmbatch.service_ms     claim to the end of its batch              } and in order
    shmbatch.outcome        "ok", or the error's class name (the span's status ERROR)

The engine's stamps come with the answer of an engine of one output (one C
call copies it out and reads them). With several outputs, in a stream, or
when a request failed, none is read: the span then starts when the client
handed the request over and has no queue wait, service time or batch size.

Without a provider a request pays one check: `TRACE_MODULE in sys.modules`,
made where the request is (no call): opentelemetry.trace is never imported
here, and a process that set a provider has imported it. Only once it is
imported does a request call begin() (or context()), which reads its
provider global.
"""
import logging
import sys
import time
from typing import Any, Optional, Tuple

from engine.shm import ring

log = logging.getLogger("shmbatch")

SPAN_NAME = "shmbatch.request"
TRACE_MODULE = "opentelemetry.trace"
_modules = sys.modules

# (the provider, its tracer and the API's names), made at the first span
_api: Optional[tuple] = None
_failed_once = False

# what begin() returns to a traced request: (its parent context, when it began, ring clock)
Began = Tuple[Any, int]


def context() -> Any:
    """The caller's current OpenTelemetry context if a tracer provider is
    set, else None."""
    try:  # the provider global set_tracer_provider() writes; no builtin call
        if _modules[TRACE_MODULE]._TRACER_PROVIDER is None:
            return None
    except (KeyError, AttributeError):  # not imported, or an API without that global
        return None
    return _modules["opentelemetry.context"].get_current()


def begin() -> Optional[Began]:
    """(the caller's context, now) for a request handed over now; None
    without a provider."""
    try:  # context()'s body: one call, not two
        if _modules[TRACE_MODULE]._TRACER_PROVIDER is None:
            return None
    except (KeyError, AttributeError):
        return None
    return _modules["opentelemetry.context"].get_current(), ring.now_ns()


def record(began: Began, engine: str, stamps: Optional[tuple] = None,
           error: Optional[BaseException] = None) -> None:
    """Records the span of a request whose answer (or error) was taken just
    now; stamps: the engine's (arrival_ns, claim_ns, done_ns, batch_size)
    (ring.take_timed's, 0 where not stamped), or None. A tracing failure is
    logged once, never the request's."""
    global _failed_once
    try:
        _record(began, engine, stamps, error)
    except Exception:
        if not _failed_once:
            _failed_once = True
            log.warning("engine %s: recording a request's span failed; spans may be missing",
                        engine, exc_info=True)


def _record(began: Began, engine: str, stamps: Optional[tuple],
            error: Optional[BaseException]) -> None:
    parent, start_ns = began
    tracer, kind, status, error_code = _names()
    taken_ns = ring.now_ns()
    to_epoch_ns = time.time_ns() - taken_ns  # the stamps are CLOCK_MONOTONIC, OTel's epoch
    attributes = {"shmbatch.engine": engine,
                  "shmbatch.outcome": "ok" if error is None else type(error).__name__}
    if stamps is not None:
        attributes.update(stamp_attributes(stamps, taken_ns))
        if 0 < stamps[0] < start_ns:  # its arrival, before the client looked
            start_ns = stamps[0]
    span = tracer.start_span(SPAN_NAME, context=parent, kind=kind, attributes=attributes,
                             start_time=start_ns + to_epoch_ns)
    if error is not None:
        span.set_status(status(error_code, f"{type(error).__name__}: {error}"))
    span.end(end_time=taken_ns + to_epoch_ns)


def stamp_attributes(stamps: tuple, taken_ns: int) -> dict:
    """The span attributes of the engine's stamps (record's) of a request
    taken at taken_ns: each only where its stamps are in order (values from
    the segment are data)."""
    arrival_ns, claim_ns, done_ns, batch_size = stamps
    attributes = {}
    if batch_size > 0:  # 0: no batch; C dropped one beyond max_batch
        attributes["shmbatch.batch_size"] = batch_size
    if 0 < arrival_ns <= claim_ns <= taken_ns:
        attributes["shmbatch.queue_wait_ms"] = (claim_ns - arrival_ns) / 1e6
        if claim_ns <= done_ns <= taken_ns:
            attributes["shmbatch.service_ms"] = (done_ns - claim_ns) / 1e6
    return attributes


def _names() -> tuple:
    """(tracer, SpanKind.CLIENT, Status, StatusCode.ERROR), the tracer of the
    provider set now (it can be set once only, so this is made once)."""
    global _api
    if _api is None:
        from opentelemetry import trace
        _api = (trace.get_tracer("shmbatch"), trace.SpanKind.CLIENT, trace.Status,
                trace.StatusCode.ERROR)
    return _api



def continued(headers) -> Any:
    """With a provider set: the context of a caller's W3C traceparent (and
    tracestate, baggage) among ASGI headers, made current; returns the token
    to detach() it with. None without a provider."""
    if context() is None:
        return None
    from opentelemetry import context as otel_context
    from opentelemetry import propagate
    carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers}
    return otel_context.attach(propagate.extract(carrier))


def detach(token: Any) -> None:
    """Restores the context that was current before continued()."""
    _modules["opentelemetry.context"].detach(token)
