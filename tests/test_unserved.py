"""While no batcher serves (the only one died, its successor still loads) and
none is expected to before a request's deadline, the request is refused at
once with EngineUnavailable (503 + Retry-After over HTTP), not left to wait
out its timeout; a request whose deadline leaves the successor time is
queued, and answered when it serves."""
import http.client
import json
import os
import signal
import time

import numpy as np
import pytest
from conftest import Gate, unique_name, wait_for

import engine
from engine.segment import Segment
from engine.serving import restarts
from engine.shm import codes

X = np.arange(4, dtype=np.float32)


@pytest.fixture
def gated():
    """An engine whose first batcher starts and whose successors wait for the
    gate (at most 60 s): its only batcher killed, the restart hangs."""
    gate = Gate()
    try:  # the gate goes even if the engine does not start
        gate.open()
        eng = engine.Engine(unique_name("unserved"), backend="helpers:starts_on_gate",
                            backend_args={"gate": gate.name}, input_shape=(4,),
                            output_shape=(4,), start_timeout_s=60.0).start()
        try:
            yield eng, gate
        finally:
            gate.open()
            eng.stop()
    finally:
        gate.close()


def kill_the_batcher(eng) -> None:
    """Kills the only batcher; returns once the supervisor has reaped it."""
    restarts_before = eng.segment.ring.word(codes.W_RESTARTS)
    os.kill(eng.stats()["batcher_pids"][0], signal.SIGKILL)
    wait_for(lambda: eng.segment.ring.word(codes.W_RESTARTS) > restarts_before,
             "the batcher reaped", 30)


def test_a_request_whose_deadline_comes_before_the_successor_is_refused_at_once(gated, monkeypatch):
    eng, _ = gated
    monkeypatch.setattr(restarts, "READY_EXPECTED_MIN_S", 30.0, raising=False)  # the successor: 30 s away
    with engine.Client(eng.name) as c:
        assert np.array_equal(c.infer(X, timeout=30), X * 2 + 1)
        kill_the_batcher(eng)
        began = time.monotonic()
        with pytest.raises(engine.EngineUnavailable, match="no live batcher.*after this request's deadline"):
            c.infer(X, timeout=5)
        assert time.monotonic() - began < 1.0  # not its 5 s timeout


def test_a_start_slower_than_expected_is_expected_again_and_its_requests_queued(gated, monkeypatch):
    eng, gate = gated
    monkeypatch.setattr(restarts, "READY_EXPECTED_MIN_S", 0.0)  # expected: twice the first start
    with engine.Client(eng.name) as c:
        c.infer(X, timeout=30)
        kill_the_batcher(eng)
        wait_for(lambda: eng.segment.unserved_until_ns() != 0, "the restart begun", 30)
        until_ns = eng.segment.unserved_until_ns()
        wait_for(lambda: eng.segment.unserved_until_ns() > until_ns, "the time moved on", 30)
        queued = c.submit(X, timeout=60)  # late is not lost: queued, not refused
        gate.open()
        assert np.array_equal(queued.result(timeout=60), X * 2 + 1)


def test_a_request_queued_while_the_successor_loads_is_answered_when_it_serves(gated, monkeypatch):
    eng, gate = gated
    monkeypatch.setattr(restarts, "READY_EXPECTED_MIN_S", 30.0, raising=False)
    with engine.Client(eng.name) as c:
        c.infer(X, timeout=30)
        kill_the_batcher(eng)
        queued = c.submit(X, timeout=50)  # its deadline leaves the successor its 30 s
        gate.open()
        assert np.array_equal(queued.result(timeout=60), X * 2 + 1)
        wait_for(lambda: eng.segment.unserved_until_ns() == 0, "the engine served again", 30)


def test_over_http_a_request_is_answered_503_with_retry_after_at_once(tmp_path):
    from test_multi_engine import Served, table
    gate = Gate()
    gate.open()
    name = unique_name("unserved-http")
    try:  # the gate goes even if serve does not start
        # each start takes 2 s: a successor is expected no sooner than 4 s after a death
        s = Served(tmp_path, table(name, backend="helpers:starts_on_gate",
                                   backend_args={"gate": gate.name, "start_s": 2.0},
                                   input_shape=[4], output_shape=[4], start_timeout_s=60.0),
                   "--http-port", "0", "--http-timeout-s", "20")
    except BaseException:
        gate.close()
        raise
    try:
        head = Segment.attach(name, header_only=True)
        try:
            pid = int(head.words[codes.W_BATCHER_PID])
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: head.unserved_until_ns() != 0, "the restart begun", 30)
        finally:
            head.close()
        host, port = s.url.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        # a deadline of 1 s: before the successor is expected
        body = json.dumps({"parameters": {"timeout": 1_000_000},
                           "inputs": [{"name": "INPUT", "shape": [1, 4], "datatype": "FP32",
                                       "data": [0, 1, 2, 3]}]})
        began = time.monotonic()
        conn.request("POST", f"/v2/models/{name}/infer", body,
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        took = time.monotonic() - began
        conn.close()
        assert response.status == 503, answer
        assert int(response.getheader("Retry-After")) >= 1
        assert "no live batcher" in answer["error"] and took < 2.0
    finally:
        gate.open()
        try:
            assert s.stop() == 0, s.stderr()
        finally:
            gate.close()
