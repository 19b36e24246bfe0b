"""OpenTelemetry spans of Client requests, for a caller that traces.

With opentelemetry-api installed and a tracer provider set
(opentelemetry.trace.set_tracer_provider), each request records one span
`shmbatch.request` under the context that was current where the request was
made (the caller's thread, or its asyncio task: captured then, since its
answer may be taken in the completion thread), until its answer (or error)
was taken, with the attributes

    shmbatch.engine         the engine's name
    shmbatch.batch_size     requests in the batch that answered it; a stream's: its
                            running batch at its first chunk
    shmbatch.queue_wait_ms  arrival to the claim by a batcher
    shmbatch.service_ms     claim to the end of its batch (a stream's: its end)
    shmbatch.outcome        "ok", or the error's class name (the span's status ERROR)
    shmbatch.requests       infer_many's: the call's rows

The engine stamps a request in its slot: its arrival (publish), its claim,
its end and its batch size (written by the batcher as it answers or fails
it, a stream's at its first chunk). The client reads them as it takes the
answer or the error, before it frees the slot: with one output in the same
C call, otherwise (several outputs, a stream, a failure) in one more, made
only when traced. So every outcome the engine settled carries them: an
answer, a backend's error, a request expired in the engine (failed
unstarted: no batch, a service of 0), one whose batcher died (no batch but
a begun stream's). Where the engine stamped less, the span says less, by
omitting:

  - refused before it reached a batcher (QueueFull, Overloaded, invalid
    input, an engine gone): no stamps at all (a blocking infer's span; the
    other calls raise before their request exists);
  - given up by its client before the engine settled it (its timeout, a
    cancelled task or Future, a stream left early, the engine gone while it
    waited): none, except a stream that had a chunk (its queue wait and batch
    size: its claim is known, its end is not);
  - a blocking infer of Client(retries=N): one span over every attempt,
    without stamps.

A stamp is data from the segment: the times are used only when ordered
(arrival <= claim <= end <= now), the batch size only within the engine's
max_batch_size (checked in C); anything else is omitted. The span starts at
the earlier of the request's arrival and when the client handed it over.
Client.infer_many records one span for its whole call, with
`shmbatch.requests` (its rows) and no stamps: its rows may be answered by
several batches.

The HTTP front continues a caller's trace (continued()) from the headers
the propagator reads, each bounded before it is decoded (trace_carrier): a
refused value is dropped unlogged, where the propagator would log it whole.

Without a provider a request pays one check: `TRACE_MODULE in sys.modules`,
made where the request is (no call): opentelemetry.trace is never imported
here, and a process that set a provider has imported it. Only once it is
imported does a request call begin() (or context()), which reads its
provider global. An untraced request reads no stamps beyond those its one
C call returns anyway.
"""
import logging
import re
import sys
import time
from typing import Any, Dict, Optional, Tuple

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
           error: Optional[BaseException] = None, requests: Optional[int] = None) -> None:
    """Records the span of a request whose answer (or error) was taken just
    now; stamps: the engine's (arrival_ns, claim_ns, done_ns, batch_size)
    (ring.take_timed's, 0 where not stamped), or None; requests: the rows of
    an infer_many call the span covers. A tracing failure is logged once,
    never the request's."""
    global _failed_once
    try:
        _record(began, engine, stamps, error, requests)
    except Exception:
        if not _failed_once:
            _failed_once = True
            log.warning("engine %s: recording a request's span failed; spans may be missing",
                        engine, exc_info=True)


def _record(began: Began, engine: str, stamps: Optional[tuple],
            error: Optional[BaseException], requests: Optional[int]) -> None:
    parent, start_ns = began
    tracer, kind, status, error_code = _names()
    taken_ns = ring.now_ns()
    to_epoch_ns = time.time_ns() - taken_ns  # the stamps are CLOCK_MONOTONIC, OTel's epoch
    attributes: Dict[str, Any] = {
        "shmbatch.engine": engine,
        "shmbatch.outcome": "ok" if error is None else type(error).__name__}
    if requests is not None:
        attributes["shmbatch.requests"] = requests
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


# -- an HTTP caller's trace ------------------------------------------------------------

# What continued() hands the propagator of a caller's headers is bounded before
# it is decoded: the propagator logs a value it refuses whole (a baggage header
# over its 8192 bytes, each malformed member). W3C's bounds: tracestate and
# baggage up to 8192 bytes, baggage up to 64 members.
MAX_TRACE_HEADER_BYTES = 8192
MAX_BAGGAGE_MEMBERS = 64
# a W3C baggage member: key = value, then properties "; key [= value]"; every
# quantifier possessive, so a match never backtracks (linear in its length)
_OWS, _TOKEN = r"[ \t]*+", r"[!#$%&'*+\-.^_`|~0-9A-Za-z]++"
_VALUE = r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*+"  # baggage-octets
_BAGGAGE_MEMBER = re.compile(rf"{_OWS}{_TOKEN}{_OWS}={_OWS}{_VALUE}"
                             rf"(?:{_OWS};{_OWS}{_TOKEN}(?:{_OWS}={_OWS}{_VALUE})?+)*+{_OWS}")
_dropped_once = False


def continued(headers) -> Any:
    """With a provider set: the context of a caller's W3C traceparent (and
    tracestate, baggage) among ASGI headers, made current; returns the token
    to detach() it with. None without a provider. Only the headers the
    propagator reads are decoded, each bounded (trace_carrier)."""
    if context() is None:
        return None
    from opentelemetry import context as otel_context
    from opentelemetry import propagate
    carrier = trace_carrier(headers, propagate.get_global_textmap().fields)
    return otel_context.attach(propagate.extract(carrier))


def trace_carrier(headers, fields) -> Dict[str, str]:
    """The ASGI headers named in fields (a header repeated: its values joined
    with ",", as RFC 9110 combines them), decoded. One over
    MAX_TRACE_HEADER_BYTES is dropped whole, never decoded; baggage keeps its
    first MAX_BAGGAGE_MEMBERS members that are well formed. What was dropped
    is logged once a process, never its content."""
    values: Dict[str, list] = {}
    sizes: Dict[str, int] = {}
    for name, value in headers:
        key = name.decode("latin-1")
        if key in fields:
            sizes[key] = size = sizes.get(key, -1) + 1 + len(value)  # joined by ","
            if size <= MAX_TRACE_HEADER_BYTES:  # past it: dropped, kept no longer
                values.setdefault(key, []).append(value)
    carrier: Dict[str, str] = {}
    for key, size in sizes.items():
        if size > MAX_TRACE_HEADER_BYTES:
            _dropped(f"a {key} header of {size} bytes (at most {MAX_TRACE_HEADER_BYTES})")
            continue
        text = b",".join(values[key]).decode("latin-1")
        carrier[key] = _baggage(text) if key == "baggage" else text
    return carrier


def _baggage(text: str) -> str:
    """text's first MAX_BAGGAGE_MEMBERS members, less those that are not W3C
    baggage members (the propagator would log each whole)."""
    members = text.split(",", MAX_BAGGAGE_MEMBERS)
    kept = [m for m in members[:MAX_BAGGAGE_MEMBERS] if _BAGGAGE_MEMBER.fullmatch(m)]
    if len(kept) < len(members):
        _dropped(f"baggage members past the first {MAX_BAGGAGE_MEMBERS} or malformed")
    return ",".join(kept)


def _dropped(what: str) -> None:
    global _dropped_once
    if not _dropped_once:
        _dropped_once = True
        log.warning("a caller's trace headers: %s dropped before extraction (logged once; "
                    "their content is never logged)", what)


def detach(token: Any) -> None:
    """Restores the context that was current before continued()."""
    _modules["opentelemetry.context"].detach(token)
