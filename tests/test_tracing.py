"""OpenTelemetry spans of Client requests (engine.client.tracing).

A tracer provider can be set once per process, so each traced check runs in
a forked child that sets one (an in-memory exporter), makes its requests on
the test's engine, and sends back its facts and the spans it finished."""
import asyncio
import json
import logging
import time
import traceback

import numpy as np
import pytest
from conftest import Gate, unique_name, wait_for
from iterative_helpers import bits, scripted, wait_held
from step_models import FAIL_STEP, HOLD, chunks, request

import engine
from engine.client import tracing
from engine.segment import Segment
from engine.shm import codes, ring

pytest.importorskip("opentelemetry.sdk")

X = np.arange(4, dtype=np.float32)
SPAN = "shmbatch.request"
# the wall clock may be slewed (NTP) against the monotonic one the stamps use
SLEW_NS = 1_000_000
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _span_dict(s) -> dict:
    return {"name": s.name, "trace_id": s.context.trace_id, "span_id": s.context.span_id,
            "parent": None if s.parent is None else s.parent.span_id,
            "attributes": dict(s.attributes), "start_ns": s.start_time, "end_ns": s.end_time,
            "status": s.status.status_code.name, "description": s.status.description}


def _child(conn, scenario, name, args) -> None:
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)

        def spans(count):  # waits (bounded) for `count` request spans
            wait_for(lambda: len(_requests(exporter)) >= count, f"{count} request spans", 30)
            return [_span_dict(s) for s in exporter.get_finished_spans()]
        facts = scenario(trace.get_tracer("test"), spans, name, *args)
        conn.send(("ok", facts))
    except BaseException:
        conn.send(("raised", traceback.format_exc()))


def _requests(exporter):
    return [s for s in exporter.get_finished_spans() if s.name == SPAN]


def traced(fork_ctx, scenario, name, *args):
    """scenario(tracer, spans, name, *args)'s facts, run in a child with a provider set."""
    ours, theirs = fork_ctx.Pipe()
    p = fork_ctx.Process(target=_child, args=(theirs, scenario, name, args))
    p.start()
    try:
        assert ours.poll(120), "the traced child sent nothing within 120 s"
        outcome, facts = ours.recv()
    finally:
        p.join(30)
    assert outcome == "ok", facts
    return facts


def only_request(spans):
    found = [s for s in spans if s["name"] == SPAN]
    assert len(found) == 1, found
    return found[0]


def by_name(spans, name):
    return next(s for s in spans if s["name"] == name)


STAMPED = ("shmbatch.queue_wait_ms", "shmbatch.service_ms", "shmbatch.batch_size")


def stamped(span) -> dict:
    """The span's attributes from the engine's stamps (those present)."""
    return {k: span["attributes"][k] for k in STAMPED if k in span["attributes"]}


@pytest.fixture(scope="module")
def held():
    """(engine, gate): its batcher holds each batch with a negative request at
    the gate until the test opens it, so what queues meanwhile batches together."""
    gate = Gate()
    eng = engine.Engine(unique_name("held"), backend="helpers:holds_on_negative",
                        backend_args={"gate": gate.name, "fixed_ms": 0.0},
                        input_shape=(4,), output_shape=(4,), max_batch_size=8).start()
    yield eng, gate
    eng.stop()
    gate.close()


# -- scenarios, run in the child -----------------------------------------------------------

def _submit_under_a_span(tracer, spans, name, x, call="submit"):
    with engine.Client(name) as c, tracer.start_as_current_span("caller"):
        t0 = time.time_ns()
        try:
            answer = (c.submit(x, timeout=30).result(timeout=30) if call == "submit"
                      else c.infer(x, timeout=30)).tolist()
        except engine.EngineError as e:
            answer = type(e).__name__
        t1 = time.time_ns()
    return {"answer": answer, "t0": t0, "t1": t1, "spans": spans(1)}


def _submit_awaited_by_the_completer(tracer, spans, name):
    import concurrent.futures
    with engine.Client(name) as c:
        with tracer.start_as_current_span("caller"):
            t0 = time.time_ns()
            f = c.submit(X, timeout=30)
        done, _ = concurrent.futures.wait([f], timeout=30)  # the completer settles it
        return {"answer": f.result(0).tolist(), "t0": t0, "t1": time.time_ns(),
                "spans": spans(1)}


def _infer_async_per_task(tracer, spans, name, tasks):
    async def one(c, k):
        with tracer.start_as_current_span(f"task{k}"):
            return (await c.infer_async(X + k, timeout=30)).tolist()

    async def main():
        with engine.Client(name) as c:
            return await asyncio.gather(*(one(c, k) for k in range(tasks)))
    return {"answers": asyncio.run(main()), "spans": spans(tasks)}


def _traced_infer(tracer, spans, name):
    from opentelemetry import context

    with engine.Client(name) as c, tracer.start_as_current_span("caller"):
        t0 = time.time_ns()
        answer = c._traced_infer(context.get_current(), X, 30, 0, None, None).tolist()
        t1 = time.time_ns()
    return {"answer": answer, "t0": t0, "t1": t1, "spans": spans(1)}


def _client_infer(tracer, spans, name):
    with engine.Client(name) as c, tracer.start_as_current_span("caller"):
        answer = c.infer(X, timeout=30).tolist()
    return {"answer": answer, "spans": spans(1)}


def _many_under_a_span(tracer, spans, name):
    with engine.Client(name) as c, tracer.start_as_current_span("caller"):
        answer = c.infer_many(np.stack([X + k for k in range(5)]), timeout=30).tolist()
        refused = None
        try:
            c.infer_many(np.zeros((2, 3), np.float32), timeout=30)  # the wrong shape
        except engine.InvalidInput as e:
            refused = type(e).__name__
    return {"answer": answer, "refused": refused, "spans": spans(2)}


def _stream_under_a_span(tracer, spans, name, x, leave_after, gate=None):
    got = []
    with engine.Client(name) as c, tracer.start_as_current_span("caller"):
        stream = c.stream(x, timeout=30)
        try:
            for chunk in stream:
                got.append(int(chunk))
                if len(got) == leave_after:
                    break
        except engine.EngineError as e:
            got.append(type(e).__name__)
        stream.close()
        if gate is not None:  # the step it was held at goes on, and finds it withdrawn
            gate.open()
    return {"chunks": got, "spans": spans(1)}


def _async_stream_per_task(tracer, spans, name, tags):
    async def one(c, tag):
        with tracer.start_as_current_span(f"task{tag}"):
            return [int(chunk) async for chunk in c.stream_async(request(tag, tag), timeout=30)]

    async def main():
        with engine.Client(name) as c:
            return await asyncio.gather(*(one(c, tag) for tag in tags))
    return {"chunks": asyncio.run(main()), "spans": spans(len(tags))}


def _behind_a_hold(tracer, spans, name, gate, timeouts_s):
    """A request held at the gate, one queued behind it per timeout; the gate
    opened once every deadline passed; the outcome of each queued one, taken
    once the engine has settled it."""
    seg = Segment.attach(name)
    try:
        with engine.Client(name) as c:
            held = c.submit(-X, timeout=30)
            wait_for(lambda: seg.ring.queued(0) == 0, "the held request claimed", 30)
            expired = seg.ring.word(codes.W_EXPIRED)
            behind = [c.submit(X + k, timeout=t) for k, t in enumerate(timeouts_s)]
            late = [f for f in behind if f.timeout < 30]
            wait_for(lambda: all(ring.now_ns() > f.deadline for f in late), "deadlines", 30)
            gate.open()
            held.result(30)
            # the claim after the hold fails the late ones unstarted; taken only then
            wait_for(lambda: seg.ring.word(codes.W_EXPIRED) == expired + len(late), "expiry", 30)
            errors = [f.exception(30) for f in behind]
    finally:
        seg.close()
    return {"outcomes": ["ok" if e is None else type(e).__name__ for e in errors],
            "spans": spans(len(timeouts_s) + 1)}


def _all_kinds_of_call(tracer, spans, name, x):
    async def infer_async(c):
        return await c.infer_async(x, timeout=30)

    with engine.Client(name) as c:
        answers = [c.infer(x, timeout=30), c.submit(x, timeout=30).result(30),
                   asyncio.run(infer_async(c))]
    return {"answers": [{k: v.tolist() for k, v in a.items()} for a in answers],
            "spans": spans(3)}


def _streams_joined_behind_a_hold(tracer, spans, name, log, gate):
    with engine.Client(name) as c:
        first = c.stream(request(1, 3, HOLD, bits(1)), timeout=30)
        got = [[int(next(first))], []]
        wait_held(log, 1, 1)  # its step before chunk 1 holds: the next joins after it
        second = c.stream(request(2, 2), timeout=30)
        gate.open()
        got[0] += [int(k) for k in first]
        got[1] += [int(k) for k in second]
    return {"chunks": got, "spans": spans(2)}


def _logged(scenario):
    """scenario, with the messages logged meanwhile (any logger) in its facts."""
    def logged(tracer, spans, name, *args):
        messages = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: messages.append(record.getMessage())
        logging.getLogger().addHandler(handler)
        try:
            facts = scenario(tracer, spans, name, *args)
        finally:
            logging.getLogger().removeHandler(handler)
        return {**facts, "logged": messages}
    return logged


INFER_BODY = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 4],
                          "data": X.tolist()}]}


def _http_post(tracer, spans, name, route, body, headers):
    from engine.http.front import Front
    from engine.segment import Segment
    seg = Segment.attach(name)
    config = seg.config
    seg.close()
    body = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": f"/v2/models/{name}/{route}",
             "headers": [(b"content-length", str(len(body)).encode()),
                         (b"content-type", b"application/json"), *headers]}
    app = Front({name: config}, 30.0)
    sent = []

    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():  # as a server's: the body, then nothing until the caller leaves
        if messages:
            return messages.pop()
        await asyncio.Event().wait()

    async def send(message):
        sent.append(message)
    try:
        asyncio.run(asyncio.wait_for(app(scope, receive, send), 60))
    finally:
        app.close()
    from opentelemetry import trace
    return {"status": sent[0]["status"], "body": json.loads(sent[1]["body"]),
            "current_after": trace.get_current_span().get_span_context().trace_id,
            "spans": spans(1)}


# -- the specification ---------------------------------------------------------------------

def test_a_submit_records_one_span_under_the_callers_span_with_its_times(make_engine, fork_ctx):
    eng = make_engine("span", input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _submit_under_a_span, eng.name, X)
    assert facts["answer"] == (X * 2 + 1).tolist()
    span, caller = only_request(facts["spans"]), by_name(facts["spans"], "caller")
    assert span["parent"] == caller["span_id"] and span["trace_id"] == caller["trace_id"]
    a = span["attributes"]
    assert a["shmbatch.engine"] == eng.name and a["shmbatch.outcome"] == "ok"
    assert a["shmbatch.queue_wait_ms"] >= 0 and a["shmbatch.service_ms"] >= 0
    assert a["shmbatch.batch_size"] == 1
    assert facts["t0"] - SLEW_NS <= span["start_ns"] <= span["end_ns"] <= facts["t1"] + SLEW_NS
    # the engine's stamps: arrival + queue wait + service is within the span
    inside_ms = (span["end_ns"] - span["start_ns"]) / 1e6
    assert a["shmbatch.queue_wait_ms"] + a["shmbatch.service_ms"] <= inside_ms + SLEW_NS / 1e6
    assert span["status"] == "UNSET"


@pytest.mark.parametrize("call", ["submit", "infer"])
def test_a_failed_request_sets_the_span_status_to_error_with_the_engines_stamps(
        make_engine, fork_ctx, call):
    eng = make_engine("fail", backend="helpers:failing", input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _submit_under_a_span, eng.name, -X - 1, call)
    assert facts["answer"] == "BackendError"
    span = only_request(facts["spans"])
    assert span["status"] == "ERROR" and "negative input" in span["description"]
    assert span["attributes"]["shmbatch.outcome"] == "BackendError"
    assert span["parent"] == by_name(facts["spans"], "caller")["span_id"]
    a = stamped(span)  # the batch (of one) that failed it: its stamps as an answer's
    assert a["shmbatch.batch_size"] == 1 and a["shmbatch.queue_wait_ms"] >= 0
    assert a["shmbatch.service_ms"] >= 0


def test_a_future_settled_by_the_completion_thread_keeps_the_callers_parent(make_engine,
                                                                             fork_ctx):
    eng = make_engine("done", backend="helpers:slow_affine", backend_args={"fixed_ms": 20},
                      input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _submit_awaited_by_the_completer, eng.name)
    assert facts["answer"] == (X * 2 + 1).tolist()
    span = only_request(facts["spans"])
    assert span["parent"] == by_name(facts["spans"], "caller")["span_id"]
    assert facts["t0"] - SLEW_NS <= span["start_ns"] <= span["end_ns"]
    assert span["attributes"]["shmbatch.service_ms"] >= 20


@pytest.mark.parametrize("backend", ["helpers:affine", "helpers:slow_affine"])
def test_infer_async_records_under_its_own_tasks_span(make_engine, fork_ctx, backend):
    # affine: answers may come before the task looks (settled at once); slow: by the completer
    eng = make_engine("async", backend=backend, input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _infer_async_per_task, eng.name, 6)
    assert facts["answers"] == [((X + k) * 2 + 1).tolist() for k in range(6)]
    spans = facts["spans"]
    requests = [s for s in spans if s["name"] == SPAN]
    assert len(requests) == 6
    tasks = {by_name(spans, f"task{k}")["span_id"] for k in range(6)}
    assert sorted(s["parent"] for s in requests) == sorted(tasks)  # one under each task's
    assert all(s["start_ns"] <= s["end_ns"] and s["attributes"]["shmbatch.outcome"] == "ok"
               for s in requests)
    assert all(1 <= s["attributes"]["shmbatch.batch_size"] <= 6 for s in requests)


def test_traced_infer_takes_the_answer_with_the_engines_stamps(make_engine, fork_ctx):
    eng = make_engine("infer", input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _traced_infer, eng.name)
    assert facts["answer"] == (X * 2 + 1).tolist()
    span = only_request(facts["spans"])
    assert span["parent"] == by_name(facts["spans"], "caller")["span_id"]
    assert facts["t0"] - SLEW_NS <= span["start_ns"] <= span["end_ns"] <= facts["t1"] + SLEW_NS
    assert span["attributes"]["shmbatch.queue_wait_ms"] >= 0


def test_a_blocking_infer_records_under_the_callers_span(make_engine, fork_ctx):
    eng = make_engine("blocking", input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _client_infer, eng.name)
    assert facts["answer"] == (X * 2 + 1).tolist()
    span = only_request(facts["spans"])
    assert span["parent"] == by_name(facts["spans"], "caller")["span_id"]
    assert span["attributes"]["shmbatch.outcome"] == "ok"


def test_infer_many_records_one_span_for_its_call_with_its_rows(make_engine, fork_ctx):
    eng = make_engine("many", input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _many_under_a_span, eng.name)
    assert facts["answer"] == [((X + k) * 2 + 1).tolist() for k in range(5)]
    answered, refused = [s for s in facts["spans"] if s["name"] == SPAN]
    caller = by_name(facts["spans"], "caller")["span_id"]
    assert answered["parent"] == refused["parent"] == caller
    assert answered["attributes"]["shmbatch.requests"] == 5
    assert answered["attributes"]["shmbatch.outcome"] == "ok"
    assert refused["attributes"]["shmbatch.outcome"] == facts["refused"] == "InvalidInput"
    assert refused["status"] == "ERROR"


def test_an_http_infer_continues_the_callers_traceparent(make_engine, fork_ctx):
    eng = make_engine("http", input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _http_post, eng.name, "infer", INFER_BODY, [(b"traceparent", TRACEPARENT.encode())])
    assert facts["status"] == 200
    assert facts["body"]["outputs"][0]["data"] == (X * 2 + 1).tolist()
    span = only_request(facts["spans"])
    _, trace_id, parent_id, _ = TRACEPARENT.split("-")
    assert span["trace_id"] == int(trace_id, 16) and span["parent"] == int(parent_id, 16)
    assert facts["current_after"] == 0  # the caller's context is not left current


def test_an_http_infer_without_traceparent_starts_its_own_trace(make_engine, fork_ctx):
    eng = make_engine("http-root", input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _http_post, eng.name, "infer", INFER_BODY, [])
    assert facts["status"] == 200
    span = only_request(facts["spans"])
    assert span["parent"] is None and span["trace_id"] != 0


def test_without_a_provider_requests_record_nothing(make_engine):
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    assert trace._TRACER_PROVIDER is None  # this process never sets one
    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # not set: the requests cannot find it
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    eng = make_engine("off", input_shape=(4,), output_shape=(4,))
    with engine.Client(eng.name) as c, provider.get_tracer("t").start_as_current_span("caller"):
        assert tracing.context() is None
        assert c.infer(X, timeout=30).tolist() == (X * 2 + 1).tolist()
        assert c.submit(X + 1, timeout=30).result(30).tolist() == ((X + 1) * 2 + 1).tolist()
        assert asyncio.run(c.infer_async(X + 2, timeout=30)).tolist() == \
            ((X + 2) * 2 + 1).tolist()
    assert [s.name for s in exporter.get_finished_spans()] == ["caller"]


def test_a_stream_records_one_span_from_its_start_to_its_last_chunk(make_engine, fork_ctx, log):
    eng = scripted(make_engine, "stream", log)
    facts = traced(fork_ctx, _stream_under_a_span, eng.name, request(7, 5), 0)
    assert facts["chunks"] == chunks(7, 5)
    span = only_request(facts["spans"])
    assert span["parent"] == by_name(facts["spans"], "caller")["span_id"]
    assert span["attributes"]["shmbatch.outcome"] == "ok" and span["status"] == "UNSET"
    assert span["start_ns"] <= span["end_ns"]
    a = stamped(span)  # a stream alone: its running batch at its first chunk is itself
    assert a["shmbatch.batch_size"] == 1 and a["shmbatch.queue_wait_ms"] >= 0
    assert a["shmbatch.service_ms"] >= 0


def test_a_stream_left_early_records_a_cancelled_span(make_engine, fork_ctx, log, gate):
    eng = scripted(make_engine, "stream-left", log, gate)
    # left after 2 chunks, while the step before its third is held: still running
    facts = traced(fork_ctx, _stream_under_a_span, eng.name, request(3, 20, HOLD, bits(2)), 2,
                   gate)
    assert facts["chunks"] == chunks(3, 20)[:2]
    span = only_request(facts["spans"])
    assert span["attributes"]["shmbatch.outcome"] == "CancelledError"
    a = stamped(span)  # claimed and begun, never ended: no service time
    assert a["shmbatch.batch_size"] == 1 and a["shmbatch.queue_wait_ms"] >= 0
    assert "shmbatch.service_ms" not in a


def test_a_failed_stream_records_an_error_span(make_engine, fork_ctx, log):
    eng = scripted(make_engine, "stream-fail", log)
    facts = traced(fork_ctx, _stream_under_a_span, eng.name, request(4, 9, FAIL_STEP, 3), 0)
    assert facts["chunks"] == chunks(4, 9)[:3] + ["BackendError"]
    span = only_request(facts["spans"])
    assert span["status"] == "ERROR" and span["attributes"]["shmbatch.outcome"] == "BackendError"
    assert set(stamped(span)) == set(STAMPED) and stamped(span)["shmbatch.batch_size"] == 1


def test_async_streams_record_under_their_own_tasks_spans(make_engine, fork_ctx, log):
    eng = scripted(make_engine, "stream-async", log)
    facts = traced(fork_ctx, _async_stream_per_task, eng.name, [2, 3, 4])
    assert facts["chunks"] == [chunks(tag, tag) for tag in (2, 3, 4)]
    spans = facts["spans"]
    requests = [s for s in spans if s["name"] == SPAN]
    tasks = {by_name(spans, f"task{tag}")["span_id"] for tag in (2, 3, 4)}
    assert sorted(s["parent"] for s in requests) == sorted(tasks)
    for s in requests:  # each joined a running batch of one to three
        assert set(stamped(s)) == set(STAMPED) and 1 <= stamped(s)["shmbatch.batch_size"] <= 3


def test_an_http_generate_continues_the_callers_traceparent(make_engine, fork_ctx, log):
    eng = scripted(make_engine, "generate", log)
    facts = traced(fork_ctx, _http_post, eng.name, "generate", {"INPUT": request(5, 3).tolist()},
                   [(b"traceparent", TRACEPARENT.encode())])
    assert facts["status"] == 200 and facts["body"]["OUTPUT"] == chunks(5, 3)
    span = only_request(facts["spans"])
    _, trace_id, parent_id, _ = TRACEPARENT.split("-")
    assert span["trace_id"] == int(trace_id, 16) and span["parent"] == int(parent_id, 16)


def test_a_span_carries_the_size_of_the_batch_that_answered_it(held, fork_ctx):
    eng, gate = held
    facts = traced(fork_ctx, _behind_a_hold, eng.name, gate, [30, 30, 30])
    assert facts["outcomes"] == ["ok"] * 3
    requests = [s for s in facts["spans"] if s["name"] == SPAN]
    # the held one alone; the three queued behind it, in the next batch together
    assert sorted(s["attributes"]["shmbatch.batch_size"] for s in requests) == [1, 3, 3, 3]
    assert all(set(stamped(s)) == set(STAMPED) for s in requests)


def test_a_request_expired_in_the_engine_has_its_queue_wait_and_no_batch(held, fork_ctx):
    eng, gate = held
    facts = traced(fork_ctx, _behind_a_hold, eng.name, gate, [0.05])
    assert facts["outcomes"] == ["RequestTimeout"]
    late = next(s for s in facts["spans"] if s["name"] == SPAN
                and s["attributes"]["shmbatch.outcome"] == "RequestTimeout")
    a = stamped(late)  # waited in the queue past its deadline; failed unstarted by the claim
    assert a["shmbatch.queue_wait_ms"] > 0 and a["shmbatch.service_ms"] == 0
    assert "shmbatch.batch_size" not in a


def test_a_request_whose_batcher_died_has_its_queue_wait_and_service_and_no_batch(
        make_engine, fork_ctx):
    eng = make_engine("died", backend="helpers:exits_on_negative", isolate_failures=False,
                      input_shape=(4,), output_shape=(4,))
    facts = traced(fork_ctx, _submit_under_a_span, eng.name, -X - 1)
    assert facts["answer"] == "BackendError"
    span = only_request(facts["spans"])
    assert "BatcherDied" in span["description"]
    a = stamped(span)  # claimed by the batcher that died, failed by the supervisor's reap
    assert a["shmbatch.queue_wait_ms"] >= 0 and a["shmbatch.service_ms"] >= 0
    assert "shmbatch.batch_size" not in a


def test_every_call_of_a_several_output_engine_records_the_engines_stamps(make_engine,
                                                                          fork_ctx):
    eng = make_engine("named", backend="serve_backends:mixed",
                      inputs={"x": ("float32", (4,)), "n": ("int64", (2,))},
                      outputs={"s": ("float32", ()), "t": ("int64", (2,)),
                               "flag": ("bool", ())})
    x = {"x": X, "n": np.array([1, 2], np.int64)}
    facts = traced(fork_ctx, _all_kinds_of_call, eng.name, x)
    assert facts["answers"] == [{"s": 6.0, "t": [3, 6], "flag": True}] * 3
    requests = [s for s in facts["spans"] if s["name"] == SPAN]
    assert [stamped(s)["shmbatch.batch_size"] for s in requests] == [1, 1, 1]
    assert all(set(stamped(s)) == set(STAMPED) for s in requests)


def test_a_streams_batch_size_is_its_running_batch_at_its_first_chunk(make_engine, fork_ctx,
                                                                      log, gate):
    eng = scripted(make_engine, "joined", log, gate)
    facts = traced(fork_ctx, _streams_joined_behind_a_hold, eng.name, log, gate)
    assert facts["chunks"] == [chunks(1, 3), chunks(2, 2)]
    requests = [s for s in facts["spans"] if s["name"] == SPAN]
    # the first ran alone at its first chunk; the second joined it, held at its second
    assert sorted(s["attributes"]["shmbatch.batch_size"] for s in requests) == [1, 2]


def test_an_oversized_baggage_header_is_dropped_unlogged(held, fork_ctx):
    eng, _ = held
    payload = b"k=" + b"v" * 20_000
    facts = traced(fork_ctx, _logged(_http_post), eng.name, "infer", INFER_BODY,
                   [(b"traceparent", TRACEPARENT.encode()), (b"baggage", payload)])
    assert facts["status"] == 200
    _, trace_id, parent_id, _ = TRACEPARENT.split("-")
    span = only_request(facts["spans"])  # the traceparent still continued
    assert span["trace_id"] == int(trace_id, 16) and span["parent"] == int(parent_id, 16)
    assert all("v" * 100 not in m and len(m) < 1000 for m in facts["logged"]), facts["logged"]


def test_trace_headers_are_bounded_and_baggage_members_checked_before_extraction():
    fields = {"traceparent", "tracestate", "baggage"}
    carrier = tracing.trace_carrier(
        [(b"traceparent", TRACEPARENT.encode()), (b"cookie", b"c" * 100_000),
         (b"tracestate", b"a=b"), (b"tracestate", b"x" * 9000),  # joined: over the bound
         (b"baggage", b"a=1, not a member,b = 2;p;q=3,c=\xff")], fields)
    assert carrier == {"traceparent": TRACEPARENT, "baggage": "a=1,b = 2;p;q=3"}
    members = [f"k{j}=v{j}" for j in range(100)]
    carrier = tracing.trace_carrier([(b"baggage", ",".join(members).encode())], fields)
    assert carrier["baggage"].split(",") == members[:tracing.MAX_BAGGAGE_MEMBERS]


def test_stamps_out_of_order_give_no_times():
    ok = tracing.stamp_attributes((10, 15, 25, 3), 30)
    assert ok == {"shmbatch.batch_size": 3, "shmbatch.queue_wait_ms": 5e-6,
                  "shmbatch.service_ms": 1e-5}
    assert tracing.stamp_attributes((10, 5, 25, 0), 30) == {}  # claimed before it arrived
    assert tracing.stamp_attributes((0, 15, 25, 0), 30) == {}  # never arrived
    assert tracing.stamp_attributes((10, 15, 0, 2), 30) == {    # not ended: a stream left
        "shmbatch.batch_size": 2, "shmbatch.queue_wait_ms": 5e-6}
    assert tracing.stamp_attributes((10, 15, 35, 1), 30) == {   # ended after it was taken
        "shmbatch.batch_size": 1, "shmbatch.queue_wait_ms": 5e-6}
