"""Iterative engines' figures: the stats, the Prometheus lines and the
status table count every chunk and step, the requests in a running batch,
and the times to each first chunk and between chunks.
"""
import os

from iterative_helpers import bits, ints, scripted, wait_held, wait_idle
from step_models import HOLD, chunks, request

import engine


def test_the_stream_figures_count_every_chunk_and_step(make_engine, log, gate):
    from prometheus_client import CollectorRegistry, generate_latest

    from engine.serving.metrics import Collector

    eng = scripted(make_engine, "figures", log, gate=gate, max_steps=16)
    with engine.Client(eng.name) as c:
        first = c.stream(request(1, 6, HOLD, bits(0, 3)), timeout=60)
        wait_held(log, 1, 0)
        assert eng.stats()["active"] == 1
        second = c.stream(request(2, 10), timeout=60)  # joins at tag 1's step 1
        gate.open()
        wait_held(log, 1, 3)
        assert eng.stats()["active"] == 2  # the held step's running batch
        gate.open()
        got = ints(first) + ints(second)
        stats = wait_idle(eng)
    assert len(got) == 16
    # steps 0..5 ran tag 1 (with tag 2 from step 1), steps 6..10 tag 2 alone
    assert (stats["chunks_total"], stats["steps_total"], stats["active"]) == (16, 11, 0)
    for key in ("ttft_ms", "chunk_ms"):
        figure = stats[key]
        assert set(figure) == {"p50", "p99", "max"}
        assert 0 < figure["p50"] <= figure["p99"] <= figure["max"], (key, figure)
    registry = CollectorRegistry()
    registry.register(Collector(eng.segment))
    text = generate_latest(registry).decode()
    label = f'{{engine="{eng.name}"}}'
    assert f"shmbatch_chunks_total{label} 16.0" in text
    assert f"shmbatch_active{label} 0.0" in text
    assert f"shmbatch_ttft_seconds_count{label} 2.0" in text    # one first chunk per request
    assert f"shmbatch_chunk_seconds_count{label} 14.0" in text  # and the gaps after it


def test_status_shows_an_iterative_engines_streams(make_engine, log):
    from engine.cli import commands
    eng = scripted(make_engine, "status", log, max_steps=8)
    with engine.Client(eng.name) as c:
        assert ints(c.stream(request(1, 5), timeout=60)) == chunks(1, 5)
    stats = wait_idle(eng)
    text = commands.status_table({**stats, "state": "running", "supervisor_pid": os.getpid()})
    assert f"0 running, {stats['steps_total']} steps, 5 chunks" in text
