"""Poison: an input that kills its batcher fails alone as poison and its batch
mates are answered when the batch can be retried, and fails its whole batch
when it cannot; when a dead batcher's batch is kept for a retry."""
import numpy as np
import pytest
from conftest import wait_for

import engine
from engine.serving import restarts
from engine.serving.restarts import Instance

X = np.arange(16, dtype=np.float32)


def test_an_input_that_kills_its_batcher_fails_alone_as_poison_and_its_batch_mates_are_answered(
        make_engine, gate):
    # float64 answers: not in place, so the inputs stay intact for a retry
    eng = make_engine("poison", backend="helpers:gated",
                      backend_args={"gate": gate.name, "then": "exits_on_negative",
                                    "dtype": "float64"},
                      max_batch_size=8, output_dtype="float64")
    with engine.Client(eng.name) as c:
        first = c.submit(X, timeout=60)
        wait_for(lambda: eng.stats()["queue_depth"] == 0, "the first request claimed")
        batch = [c.submit(x, timeout=60) for x in (X + 1, -X - 1, X + 2)]  # queued behind it
        for _ in range(3):  # each batcher's first batch waits at the gate: this one, 2 successors
            gate.open()
        assert np.array_equal(first.result(timeout=60), X * 2 + 1)
        # the batch killed its batcher; its successor retried each request alone: the
        # negative one killed it too and failed as poison, the others got their answers
        assert np.array_equal(batch[0].result(timeout=60), (X + 1) * 2 + 1)
        with pytest.raises(engine.BackendError, match="failed as poison") as info:
            batch[1].result(timeout=60)
        assert info.value.exc_type == "BatcherDied"
        assert np.array_equal(batch[2].result(timeout=60), (X + 2) * 2 + 1)
        assert np.array_equal(c.infer(X + 3, timeout=60), (X + 3) * 2 + 1)
    stats = eng.stats()
    assert stats["batcher_restarts_total"] == 2 and stats["errors_total"] == 1
    assert stats["retried_alone_total"] == 3  # the batch of three, each alone once


def test_a_dead_batchers_batch_is_kept_unless_two_successors_died_before_retrying_it():
    b = Instance(0, 0)
    message, retry = restarts.reap_terms(b, 11, "exit code 70", 0, True)
    assert retry and b"failed as poison" in message  # the words for one retried alone
    b.kept, b.retried_at_keep = 3, 0  # kept 3; the engine had retried none then
    assert restarts.reap_terms(b, 12, "exit code 1", 0, True)[1]  # its successor retried none
    b.kept = 3
    message, retry = restarts.reap_terms(b, 13, "exit code 1", 0, True)  # nor did the next
    assert not retry and b"2 successors died before retrying it" in message
    b.kept = 3
    assert restarts.reap_terms(b, 14, "exit code 70", 1, True)[1] and b.futile_restarts == 0
    assert restarts.reap_terms(Instance(0, 0), 15, "exit code 70", 0, False)[1] is False


@pytest.mark.parametrize("knobs", [{"isolate_failures": False, "output_dtype": "float64"},
                                   {}],  # answers in place: its inputs may be overwritten
                         ids=["without isolation", "answering in place"])
def test_an_input_that_kills_its_batcher_fails_its_whole_batch_when_not_retried(
        make_engine, gate, knobs):
    then_args = {"dtype": knobs["output_dtype"]} if "output_dtype" in knobs else {}
    eng = make_engine("poison-batch", backend="helpers:gated",
                      backend_args={"gate": gate.name, "then": "exits_on_negative", **then_args},
                      max_batch_size=8, **knobs)
    with engine.Client(eng.name) as c:
        first = c.submit(X, timeout=60)
        wait_for(lambda: eng.stats()["queue_depth"] == 0, "the first request claimed")
        doomed = [c.submit(x, timeout=60) for x in (X + 1, -X - 1, X + 2)]
        gate.open()
        gate.open()  # for the batcher that replaces the dead one, whose first batch waits too
        assert np.array_equal(first.result(timeout=60), X * 2 + 1)
        for f in doomed:  # the batch the model died on: failed, not retried
            with pytest.raises(engine.BackendError, match="BatcherDied"):
                f.result(timeout=60)
        assert np.array_equal(c.infer(X + 3, timeout=60), (X + 3) * 2 + 1)  # a new batcher
    assert eng.stats()["batcher_restarts_total"] == 1
