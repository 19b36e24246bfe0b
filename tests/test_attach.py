"""How a Client finds its engine: at once, after a wait, or lazily at each request."""
import os
import threading

import numpy as np
import pytest
from conftest import unique_name, wait_for

import engine

X = np.arange(16, dtype=np.float32)


def test_a_client_without_an_engine_says_not_started_yet():
    with pytest.raises(engine.EngineUnavailable, match="not started yet"):
        engine.Client(unique_name("absent"))


def test_a_client_that_waited_in_vain_says_how_long():
    with pytest.raises(engine.EngineUnavailable, match=r"not started yet.*waited 0.2 s"):
        engine.Client(unique_name("absent"), wait_s=0.2)


def test_a_waiting_client_attaches_to_an_engine_that_starts_meanwhile():
    eng = engine.Engine(unique_name("later"), backend="helpers:affine")
    starter = threading.Thread(target=eng.start)
    starter.start()
    try:
        with engine.Client(eng.name, wait_s=60) as c:
            assert np.array_equal(c.infer(X, timeout=10), X * 2 + 1)
    finally:
        starter.join(60)
        eng.stop()


def test_a_lazy_client_made_before_its_engine_answers_once_it_runs_and_after_a_restart():
    name = unique_name("lazy")
    c = engine.Client(name, lazy=True)
    with pytest.raises(engine.EngineUnavailable, match="not started yet"):
        c.infer(X)
    for k in range(2):  # the engine, then its restart under the same name
        with engine.Engine(name, backend="helpers:affine"):
            assert np.array_equal(c.infer(X + k, timeout=10), (X + k) * 2 + 1)
        with pytest.raises(engine.EngineUnavailable, match="not running"):
            c.infer(X)
    c.close()


def test_a_lazy_client_says_starting_while_the_engine_starts(gate):
    eng = engine.Engine(unique_name("starting"), backend="helpers:starts_on_gate",
                        backend_args={"gate": gate.name})
    starter = threading.Thread(target=eng.start)
    starter.start()
    try:
        wait_for(lambda: os.path.exists(f"/dev/shm/shmbatch-{eng.name}"), "the segment")
        c = engine.Client(eng.name, lazy=True)
        with pytest.raises(engine.EngineUnavailable, match="is starting"):
            c.infer(X)
        gate.open()
        starter.join(60)
        assert np.array_equal(c.infer(X, timeout=10), X * 2 + 1)
        c.close()
    finally:
        gate.open()
        starter.join(60)
        eng.stop()


def test_a_closed_lazy_client_stays_closed():
    c = engine.Client(unique_name("closed"), lazy=True)
    c.close()
    with pytest.raises(engine.EngineUnavailable, match="closed"):
        c.infer(X)
