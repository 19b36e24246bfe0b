"""The OpenTelemetry trace of Client requests, as an in-memory exporter holds it.

    python bench/trace_one_request.py

Starts an engine (identity backend, float32[16]), sets a tracer provider with
an in-memory span exporter, and under a span `caller` sends one request each
way: submit().result(), infer_async(), and infer() (traced only once
Client.infer has its hook, Client._traced_infer). Prints every span: name,
ids, parent, attributes, start and end (epoch ns, UTC) and duration.
"""
import asyncio
import datetime
import os

import numpy as np
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import engine


def utc(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).isoformat()


def show(span) -> None:
    parent = "none" if span.parent is None else f"{span.parent.span_id:016x}"
    print(f"{span.name}  trace {span.context.trace_id:032x}  span {span.context.span_id:016x}"
          f"  parent {parent}  status {span.status.status_code.name}")
    for key, value in span.attributes.items():
        print(f"    {key} = {value!r}")
    print(f"    start {span.start_time} ({utc(span.start_time)})\n"
          f"    end   {span.end_time} ({utc(span.end_time)})"
          f"  duration {(span.end_time - span.start_time) / 1e3:.1f} us")


def main() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    tracer = trace.get_tracer("bench")
    name = f"trace{os.getpid()}"
    x = np.arange(16, dtype=np.float32)
    eng = engine.Engine(name, backend="engine.backends:identity", input_shape=(16,),
                        output_shape=(16,)).start()
    try:
        with engine.Client(name) as c:
            for call in ("submit", "infer_async", "infer"):
                with tracer.start_as_current_span(f"caller ({call})"):
                    if call == "submit":
                        y = c.submit(x, timeout=5).result()
                    elif call == "infer_async":
                        y = asyncio.run(c.infer_async(x, timeout=5))
                    else:
                        y = c.infer(x, timeout=5)
                    assert np.array_equal(y, x)
    finally:
        eng.stop()
    for span in exporter.get_finished_spans():
        show(span)


if __name__ == "__main__":
    main()
