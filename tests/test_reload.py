"""Engine.reload and `shmbatch reload`: new batchers take
over from the old ones with no request lost, refused or answered twice, and a
reload that cannot start leaves the old batchers serving."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
from conftest import unique_name, wait_for

import engine
from engine.serving import control

SHAPE = dict(input_shape=(4,), output_shape=(4,))
X = np.arange(4, dtype=np.float32)
AFTER = 20  # requests each client sends once the last reload has returned
BIASES = (1.0, 2.0, 3.0)


def _shmbatch(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True,
                          text=True, timeout=timeout)


def _send_until_told(name, client_id, last_bias, after, out):
    """Sends tagged requests back to back; each answer must be its own request
    plus one of BIASES. Stops AFTER requests after `after` is set (the last
    reload returned) and reports what it saw, in order."""
    sent = answered = 0
    errors, wrong, runs, late_biases = [], [], [], set()
    left = None
    deadline = time.monotonic() + 90
    with engine.Client(name) as c:
        for k in range(1_000_000):
            if left == 0 or time.monotonic() > deadline:
                break
            late = after.is_set()  # read before sending: sent after the last reload returned
            x = np.full(4, client_id * 100_000 + k, np.float32)
            sent += 1
            try:
                y = c.infer(x, timeout=30)
            except engine.EngineError as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            answered += 1
            bias = float(y[0] - x[0])
            if bias not in BIASES or not np.array_equal(y, x + bias):
                wrong.append((x[0], y.tolist()))
                continue
            if runs and runs[-1][0] == bias:
                runs[-1][1] += 1
            else:
                runs.append([bias, 1])
            last_bias[client_id] = bias
            if late:
                late_biases.add(bias)
                left = AFTER - 1 if left is None else left - 1
    out.put(dict(client=client_id, sent=sent, answered=answered, errors=errors[:5],
                 wrong=wrong[:5], runs=runs, late=sorted(late_biases), finished=left == 0))


def test_reload_under_load_loses_nothing_and_never_goes_back(make_engine, fork_ctx):
    eng = make_engine("reload-load", backend="reload_backends:offset", instances=2,
                      backend_args={"bias": 1, "fixed_ms": 1}, max_batch_size=8, **SHAPE)
    first_pids = set(eng.stats()["batcher_pids"])
    last_bias, after, out = fork_ctx.Array("d", 3), fork_ctx.Event(), fork_ctx.Queue()
    clients = [fork_ctx.Process(target=_send_until_told, args=(eng.name, i, last_bias, after, out))
               for i in range(3)]
    for p in clients:
        p.start()
    try:
        for bias in BIASES:
            if bias > 1:
                eng.reload(backend_args={"bias": bias, "fixed_ms": 1})
            # every client is answered by these weights before the next reload
            wait_for(lambda: all(v == bias for v in last_bias[:]),
                     f"every client answered with bias {bias}", timeout_s=30)
        after.set()
        results = sorted((out.get(timeout=60) for _ in clients), key=lambda r: r["client"])
    finally:
        after.set()
        for p in clients:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)
    for r in results:
        assert r["errors"] == [] and r["wrong"] == [], r
        assert r["finished"] and r["answered"] == r["sent"], r    # nothing lost
        seen = [bias for bias, _ in r["runs"]]
        assert seen == sorted(seen) and seen[-1] == 3.0, r        # never back to older weights
        assert set(seen) == set(BIASES), r
        assert r["late"] == [3.0], r
    stats = eng.stats()
    sent = sum(r["sent"] for r in results)
    assert stats["requests_total"] == stats["answered_total"] == sent  # each answered once
    assert stats["batcher_restarts_total"] == 0 and stats["errors_total"] == 0
    assert len(stats["batcher_pids"]) == 2 and not set(stats["batcher_pids"]) & first_pids


def test_new_batchers_wait_for_the_old_ones_last_batch(make_engine, gate):
    """The switch is strict: a request queued while an old batcher still runs
    its batch waits for that batch, and the new weights answer it."""
    eng = make_engine("reload-strict", backend="reload_backends:held",
                      backend_args={"gate": gate.name, "bias": 1}, **SHAPE)
    with engine.Client(eng.name) as c:
        held = c.submit(-X - 1, timeout=30)  # the old batcher holds it until the gate opens
        wait_for(lambda: eng.segment.batch_started_ns(0) != 0, "the old batcher holds a batch")
        reloaded = {}
        reload = threading.Thread(target=lambda: reloaded.update(
            eng.reload(backend_args={"gate": gate.name, "bias": 2})))
        reload.start()
        try:
            wait_for(lambda: eng.segment.epoch() == 1, "the new batcher ready, the old retiring")
            queued = c.submit(X, timeout=30)
            wait_for(lambda: eng.stats()["queue_depth"] == 1, "the request is queued")
            assert reload.is_alive() and not queued.done()
        finally:
            gate.open()
            reload.join(30)
        assert np.array_equal(held.result(timeout=30), -X)     # the old weights, bias 1
        assert np.array_equal(queued.result(timeout=30), X + 2)  # the new ones
    assert not reload.is_alive() and eng.stats()["batcher_pids"] == reloaded["batcher_pids"]


@pytest.mark.parametrize("change", [
    dict(backend="reload_backends:broken"),                    # the factory raises
    dict(backend="no_such_module_for_reload:factory"),         # the module does not import
    dict(backend_args={"bias": 2, "no_such_arg": 1}),          # the factory refuses its args
], ids=["factory-raises", "bad-module", "bad-args"])
def test_a_failed_reload_raises_and_the_old_batchers_keep_serving(make_engine, change):
    eng = make_engine("reload-fail", backend="reload_backends:offset", instances=2,
                      backend_args={"bias": 1}, **SHAPE)
    pids = eng.stats()["batcher_pids"]
    with pytest.raises(engine.BackendError, match="old batchers keep serving"):
        eng.reload(**change)
    with engine.Client(eng.name) as c:
        for k in range(10):
            assert np.array_equal(c.infer(X + k, timeout=10), X + k + 1)
    stats = eng.stats()
    assert stats["batcher_pids"] == pids and stats["batcher_restarts_total"] == 0
    assert eng.segment.epoch() == 0
    # the new batchers that did start were killed and reaped
    assert {p.pid for p in psutil.Process().children()} == set(pids)
    assert eng.options.backend_args == {"bias": 1}


def test_a_batcher_that_crashes_after_a_reload_restarts_with_the_new_args(make_engine):
    eng = make_engine("reload-crash", backend="reload_backends:offset",
                      backend_args={"bias": 1}, **SHAPE)
    new_pid = eng.reload(backend_args={"bias": 2})["batcher_pids"][0]
    assert eng.stats()["batcher_pids"] == [new_pid]
    os.kill(new_pid, signal.SIGKILL)
    wait_for(lambda: eng.stats()["batcher_pids"] not in ([], [new_pid]),
             "the killed batcher is replaced", timeout_s=30)
    with engine.Client(eng.name) as c:
        assert np.array_equal(c.infer(X, timeout=10), X + 2)
    assert eng.stats()["batcher_restarts_total"] == 1


def test_the_reload_command_merges_its_args_and_switches_a_running_engine(make_engine):
    eng = make_engine("reload-cli", backend="reload_backends:offset",
                      backend_args={"bias": 1, "scale": 2}, **SHAPE)
    old_pids = eng.stats()["batcher_pids"]
    with engine.Client(eng.name) as c:
        assert np.array_equal(c.infer(X, timeout=10), 2 * X + 1)
        done = _shmbatch("reload", eng.name, "--backend-arg", "bias=5")
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.splitlines()) == 1 and "reloaded" in done.stdout
        assert np.array_equal(c.infer(X, timeout=10), 2 * X + 5)  # scale=2 kept: merged
    status = _shmbatch("status", eng.name, "--json")
    pids = json.loads(status.stdout)["batcher_pids"]
    assert pids == eng.stats()["batcher_pids"] and len(pids) == 1 and pids != old_pids
    assert str(pids) in done.stdout


def test_the_reload_command_reports_a_failed_reload(make_engine):
    eng = make_engine("reload-cli-fail", backend="reload_backends:offset",
                      backend_args={"bias": 1}, **SHAPE)
    done = _shmbatch("reload", eng.name, "--backend", "reload_backends:broken")
    assert done.returncode == 1
    assert "no weights" in done.stderr and "old batchers keep serving" in done.stderr
    with engine.Client(eng.name) as c:
        assert np.array_equal(c.infer(X, timeout=10), X + 1)


def test_the_reload_command_without_an_engine_fails_clearly():
    name = unique_name("nobody")
    done = _shmbatch("reload", name, "--backend-arg", "bias=5", timeout=30)
    assert done.returncode != 0
    assert f"no engine named {name!r}" in done.stderr


def _ask_as_nobody(name, out):
    os.setuid(65534)
    out.put(control.request(name, {"op": "reload", "backend_args": {"bias": 9}}, timeout_s=10))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root, to ask as another user")
def test_the_control_socket_refuses_another_user(make_engine, fork_ctx):
    eng = make_engine("reload-uid", backend="reload_backends:offset",
                      backend_args={"bias": 1}, **SHAPE)
    out = fork_ctx.Queue()
    p = fork_ctx.Process(target=_ask_as_nobody, args=(eng.name, out))
    p.start()
    reply = out.get(timeout=30)
    p.join(10)
    assert reply["ok"] is False and "refused" in reply["error"]
    assert eng.segment.epoch() == 0 and eng.options.backend_args == {"bias": 1}


def test_reload_needs_at_most_16_instances():
    eng = engine.Engine(unique_name("reload-many"), instances=17)  # not started: nothing spawned
    with pytest.raises(ValueError, match="instances <= 16"):
        eng.reload(backend_args={"bias": 2})
