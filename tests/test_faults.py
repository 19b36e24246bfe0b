"""Processes killed with SIGKILL on purpose: clients, batchers, a whole engine."""
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import unique_name, wait_for_line, wait_until_no_slot_in_use

import engine

X = np.arange(16, dtype=np.float32)


def _flood(name, ready):
    """Keeps 8 requests in flight, until it is killed."""
    with engine.Client(name) as c:
        pending = []
        while True:
            if len(pending) == 8:
                ready.set()
                pending.pop(0).result(timeout=30)
            pending.append(c.submit(X, timeout=30))


def test_killed_clients_slots_come_back_and_others_are_unaffected(make_engine, fork_ctx):
    eng = make_engine("killc", backend="helpers:slow_affine", backend_args={"fixed_ms": 20},
                      max_batch_size=4, queue_capacity=16)
    with engine.Client(eng.name) as survivor:
        for round_ in range(5):
            ready = fork_ctx.Event()
            victim = fork_ctx.Process(target=_flood, args=(eng.name, ready))
            victim.start()
            assert ready.wait(30)
            mine = survivor.submit(X + round_, timeout=30)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            assert np.array_equal(mine.result(timeout=30), (X + round_) * 2 + 1)
            assert wait_until_no_slot_in_use(eng)  # the victim's 8 slots came back
        assert eng.stats()["reclaimed_slots_total"] >= 5
        for k in range(20):
            assert np.array_equal(survivor.infer(X + k, timeout=10), (X + k) * 2 + 1)


def _steady(name, client_id, n, out):
    ok = died = wrong = 0
    with engine.Client(name) as c:
        for k in range(n):
            x = np.full(16, client_id * 10000 + k, np.float32)
            try:
                y = c.infer(x, timeout=30)
            except engine.BackendError as e:
                died += e.exc_type == "BatcherDied"
                wrong += e.exc_type != "BatcherDied"
                continue
            ok += 1
            wrong += not np.array_equal(y, x * 2 + 1)
    out.put((ok, died, wrong))


def test_killed_batcher_is_restarted_and_queued_requests_are_answered(make_engine, fork_ctx):
    # float64 answers: not in place, so the batch it held is retried on intact inputs
    eng = make_engine("killb", backend="helpers:slow_affine",
                      backend_args={"fixed_ms": 10, "dtype": "float64"}, max_batch_size=4,
                      output_dtype="float64")
    old_pid = eng.stats()["batcher_pids"][0]
    out = fork_ctx.Queue()
    clients = [fork_ctx.Process(target=_steady, args=(eng.name, i, 150, out)) for i in range(3)]
    for p in clients:
        p.start()
    # kill it while it holds a batch: wait for answers to flow first
    with engine.Client(eng.name) as probe:
        probe.infer(X, timeout=30)
    os.kill(old_pid, signal.SIGKILL)
    results = [out.get(timeout=120) for _ in clients]
    for p in clients:
        p.join(10)
    ok = sum(r[0] for r in results)
    died = sum(r[1] for r in results)
    assert sum(r[2] for r in results) == 0  # no wrong answer, no other error
    # the batch it held was retried by its successor, each request alone: none lost
    assert (ok, died) == (450, 0)
    stats = eng.stats()
    assert stats["batcher_restarts_total"] == 1
    assert stats["batcher_pids"] and stats["batcher_pids"][0] != old_pid
    assert stats["instances_alive"] == 1


def test_a_hung_batcher_is_replaced_and_only_its_batch_fails(make_engine):
    eng = make_engine("hung", backend="helpers:hangs_on_negative", max_batch_size=1,
                      batch_timeout_s=0.5)
    old_pid = eng.stats()["batcher_pids"][0]
    with engine.Client(eng.name) as c:
        hung = c.submit(-X, timeout=30)
        queued = c.submit(X, timeout=30)  # behind the hung batch
        # (answered in place, so not retried: its batch fails with the kill)
        with pytest.raises(engine.BackendError, match="batch_timeout_s=0.5") as info:
            hung.result(timeout=30)
        assert info.value.exc_type == "BatcherDied"
        assert np.array_equal(queued.result(timeout=30), X * 2 + 1)
    stats = eng.stats()
    assert stats["batcher_restarts_total"] == 1 and stats["batcher_pids"][0] != old_pid


def test_a_batch_timeout_must_be_positive():
    with pytest.raises(ValueError, match="batch_timeout_s must be > 0"):
        engine.Engine(unique_name("bad-timeout"), batch_timeout_s=0)


CRASHING_ENGINE = textwrap.dedent("""
    import sys, engine
    eng = engine.Engine(sys.argv[1], backend="engine.backends:identity").start()
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_start_over_a_crashed_engine_reclaims_its_segment():
    name = unique_name("crash")
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_ENGINE, name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc.stdout, "ready")
        with engine.Client(name) as c:
            assert np.array_equal(c.infer(X, timeout=10), X)
            proc.kill()
            proc.wait(10)
            with pytest.raises(engine.EngineUnavailable):
                c.infer(X, timeout=10)
        assert os.path.exists(f"/dev/shm/shmbatch-{name}")  # the crash left it
    finally:
        proc.kill()
        proc.wait(10)
    fresh = engine.Engine(name, backend="helpers:affine").start()
    try:
        with engine.Client(name) as c:
            assert np.array_equal(c.infer(X, timeout=10), X * 2 + 1)
    finally:
        fresh.stop()
    assert not os.path.exists(f"/dev/shm/shmbatch-{name}")


def test_a_client_reattaches_when_a_new_engine_of_its_name_starts():
    name = unique_name("reattach")
    with engine.Engine(name, backend="engine.backends:identity"):
        c = engine.Client(name)
        assert np.array_equal(c.infer(X, timeout=10), X)
    with pytest.raises(engine.EngineUnavailable):
        c.infer(X)
    with engine.Engine(name, backend="helpers:affine"):
        assert np.array_equal(c.infer(X, timeout=10), X * 2 + 1)
    c.close()
