"""A batcher's death is visible: the supervisor's log says which batcher died,
of what, and when its successor is ready; a request that timed out or
expired because its batcher died says so."""
import logging
import os
import re
import signal
import time

import numpy as np
import pytest
from conftest import Gate, wait_for

import engine
from engine.shm import ring

X = np.arange(16, dtype=np.float32)


@pytest.fixture
def log_lines(caplog):
    """The supervisor's log lines (logger "shmbatch") that hold a needle."""
    caplog.set_level(logging.INFO, logger="shmbatch")
    return lambda needle: [r.getMessage() for r in list(caplog.records)
                           if r.name == "shmbatch" and needle in r.getMessage()]


@pytest.fixture
def gates():
    """(start, hold) gates for death_backends.gated_starts."""
    pair = Gate(), Gate()
    yield pair
    for g in pair:
        g.close()


def gated_engine(make_engine, gates, tag):
    """One batcher, whose successors wait for gates[0] to load and whose
    batches holding a negative value wait for gates[1]."""
    start, hold = gates
    start.open()  # the first batcher's start
    return make_engine(tag, backend="death_backends:gated_starts",
                       backend_args={"start_gate": start.name, "hold_gate": hold.name},
                       output_dtype="float64")


def kill_holding(eng, c, timeout, settle_s=0.0):
    """Sends a request its batcher holds, SIGKILLs that batcher (settle_s
    after the request's enqueue, at the earliest) and waits until the
    supervisor has reaped it; (the request's Future, the dead pid)."""
    [pid] = eng.stats()["batcher_pids"]
    f = c.submit(-X, timeout=timeout)
    kill_ns = f.deadline - int((timeout - settle_s) * 1e9)
    wait_for(lambda: eng.stats()["queue_depth"] == 0 and ring.now_ns() >= kill_ns,
             "the request claimed")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: eng.stats()["batcher_restarts_total"] == 1, "the dead batcher reaped")
    return f, pid


def test_the_log_names_a_dead_batcher_and_the_signal_that_killed_it(make_engine, log_lines):
    eng = make_engine("died", backend="helpers:affine")
    [pid] = eng.stats()["batcher_pids"]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: log_lines(f"batcher 0 (pid {pid}) died"), "the death logged")
    [line] = log_lines(f"batcher 0 (pid {pid}) died")
    assert "died (killed by signal 9 (SIGKILL))" in line
    wait_for(lambda: eng.stats()["batcher_pids"] not in ([], [pid]), "a successor serving")
    with engine.Client(eng.name) as c:
        assert np.array_equal(c.infer(X, timeout=30), X * 2 + 1)


def test_the_log_names_the_exception_a_dead_batcher_reported(make_engine, log_lines):
    eng = make_engine("raised", backend="death_backends:fatal_on_negative")
    [pid] = eng.stats()["batcher_pids"]
    with engine.Client(eng.name) as c:
        # answered in place: its batch is not retried, it fails with its batcher's death
        with pytest.raises(engine.BackendError, match="raised Fatal: the model gave up") as info:
            c.infer(-X, timeout=30)
        assert info.value.exc_type == "BatcherDied"
        wait_for(lambda: log_lines(f"batcher 0 (pid {pid}) died"), "the death logged")
        [line] = log_lines(f"batcher 0 (pid {pid}) died")
        assert "died (raised Fatal: the model gave up; exit code 1)" in line
        assert np.array_equal(c.infer(X, timeout=30), X * 2 + 1)  # its successor's


def test_the_log_says_when_a_dead_batchers_successor_is_ready_and_how_long_it_took(
        make_engine, gates, log_lines):
    eng = gated_engine(make_engine, gates, "ready")
    [pid] = eng.stats()["batcher_pids"]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: log_lines(f"batcher 0 (pid {pid}) died"), "the death logged")
    time.sleep(0.3)  # the interval measured: the successor cannot be ready before the gate opens
    gates[0].open()
    wait_for(lambda: log_lines("batcher 0 ready again"), "the successor's readiness logged")
    elapsed_s = time.monotonic() - killed
    [line] = log_lines("batcher 0 ready again")
    took = re.fullmatch(r".*batcher 0 ready again after ([0-9.]+) s \(pid (\d+)\)", line)
    assert took, line
    assert [int(took[2])] == eng.stats()["batcher_pids"] != [pid]
    assert 0.3 <= float(took[1]) <= elapsed_s


def test_a_request_that_times_out_while_its_batcher_is_dead_says_its_batcher_died(
        make_engine, gates):
    eng = gated_engine(make_engine, gates, "timeout")
    with engine.Client(eng.name) as c:
        held, _ = kill_holding(eng, c, timeout=1.0)
        # its batcher is dead and no successor loaded: the client's own timeout says why
        with pytest.raises(engine.RequestTimeout) as info:
            held.result(timeout=60)
        assert str(info.value) == ("expected an answer within 1.0 s, got none (request "
                                   "abandoned): its batcher 0 died while serving it, and no "
                                   "successor was ready before the deadline")
        gates[0].open()
        # sent once the successor serves: a request sent while its start is late is refused
        wait_for(lambda: eng.segment.unserved_until_ns() == 0, "the successor serving")
        assert np.array_equal(c.infer(X, timeout=60), X * 2 + 1)  # its successor's


def test_a_request_its_dead_batchers_successor_finds_expired_says_its_batcher_died(
        make_engine, gates):
    eng = gated_engine(make_engine, gates, "expired")
    with engine.Client(eng.name) as c:
        # nobody waits on the Future: the engine, not the client, finds it past its deadline
        held, pid = kill_holding(eng, c, timeout=1.0)
        wait_for(lambda: ring.now_ns() > held.deadline, "the request's deadline passed")
        gates[0].open()
        wait_for(lambda: eng.stats()["expired_total"] == 1, "its successor expired it")
        with pytest.raises(engine.RequestTimeout, match=r"\(its batcher died\)") as info:
            held.result(timeout=0)
        assert "deadline" in str(info.value) and "not computed" in str(info.value)
        assert np.array_equal(c.infer(X, timeout=60), X * 2 + 1)
    assert eng.stats()["batcher_pids"] != [pid]


def test_a_request_that_times_out_in_its_dead_batchers_successor_says_its_batcher_died(
        make_engine, gates):
    eng = gated_engine(make_engine, gates, "replaced")
    with engine.Client(eng.name) as c:
        # a start time has the kernel's tick resolution: the successor starts ticks later
        held, pid = kill_holding(eng, c, timeout=6.0, settle_s=0.05)
        gates[0].open()
        wait_for(lambda: eng.stats()["retried_alone_total"] == 1, "its successor retrying it")
        # the successor holds it too (a negative input): the client's timeout says why
        with pytest.raises(engine.RequestTimeout) as info:
            held.result(timeout=60)
        [successor] = eng.stats()["batcher_pids"]
        assert str(info.value).endswith(f"(request abandoned): its batcher 0 died while it "
                                        f"waited; its successor (pid {successor}) had not "
                                        f"answered it by the deadline")
        assert successor != pid
        gates[1].open()  # the successor's held retry ends (its answer is dropped: withdrawn)
        assert np.array_equal(c.infer(X, timeout=60), X * 2 + 1)
