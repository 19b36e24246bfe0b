"""The retry budget is one per process and engine: however a process makes its
Clients (one shared, several, one per request), at most a tenth of its sends
to an engine, plus the burst, are retries; a forked child has its own."""
import multiprocessing

import numpy as np
import pytest
from conftest import wait_for

import engine
from engine.client import retrying

X = np.arange(16, dtype=np.float32)
REQUESTS = 40  # every one refused: 3 retries each if nothing held them back


@pytest.fixture
def refusing(make_engine, gate):
    """An engine of queue_capacity 2 whose two slots are held at the gate:
    it refuses every request (QueueFull) until the test ends."""
    eng = make_engine("refusing", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=1, queue_capacity=2, admission="none")
    with engine.Client(eng.name) as holder:
        held = [holder.submit(X + k, timeout=60) for k in range(2)]
        wait_for(lambda: eng.stats()["requests_total"] == 2, "both slots taken")
        yield eng
        gate.open()
        for f in held:
            f.result(timeout=60)


def _shared(name):
    client = engine.Client(name, retries=3)
    return lambda k: client


def _several(name):
    clients = [engine.Client(name, retries=3) for _ in range(8)]
    return lambda k: clients[k % len(clients)]


def _per_request(name):
    return lambda k: engine.Client(name, retries=3)


CLIENTS = {"one shared Client": _shared, "eight Clients": _several,
           "a Client per request": _per_request}


def _send_refused(eng, client_of, requests: int) -> int:
    """Sends `requests` requests, each refused; returns how many sends
    reached the engine (every one refused, counted there)."""
    for k in range(requests):
        with pytest.raises(engine.QueueFull):
            client_of(k).infer(X, timeout=30)
    return eng.stats()["rejected_total"]


@pytest.mark.parametrize("made", sorted(CLIENTS))
def test_retries_are_at_most_a_tenth_of_the_sends_plus_the_burst(refusing, made):
    sends = _send_refused(refusing, CLIENTS[made](refusing.name), REQUESTS)
    retries = sends - REQUESTS
    assert retries <= 0.1 * sends + retrying.BURST, (sends, retries)
    # the burst is spent first: the budget started with it, and only it
    assert retries >= retrying.BURST


def _fresh_client_retries(name) -> int:
    """How many retries one refused request of a new Client got."""
    with engine.Client(name, retries=3) as c:
        with pytest.raises(engine.QueueFull):
            c.infer(X, timeout=30)
        return c.retries_total


def test_a_new_client_brings_no_new_budget(refusing):
    _send_refused(refusing, _per_request(refusing.name), REQUESTS)
    # the process's budget spent, a retry is earned every RETRY_COST requests:
    # a run of new Clients' requests is mostly not resent
    got = [_fresh_client_retries(refusing.name) for _ in range(retrying.RETRY_COST)]
    assert sum(got) <= 1, got


def test_each_engine_has_its_own_budget(make_engine, refusing):
    _send_refused(refusing, _shared(refusing.name), REQUESTS)
    other = make_engine("other", max_batch_size=1, queue_capacity=1, admission="none")
    with engine.Client(other.name) as holder, holder.request():  # its one slot, lent
        assert _fresh_client_retries(other.name) == 3  # untouched by the first engine's


def _child_retries(name, conn) -> None:
    with engine.Client(name, retries=3) as c:
        try:
            c.infer(X, timeout=30)
        except engine.QueueFull:
            pass
        conn.send(c.retries_total)


def test_a_forked_child_starts_its_own_budget_at_its_burst(refusing):
    _send_refused(refusing, _shared(refusing.name), REQUESTS)  # the parent's is spent
    ctx = multiprocessing.get_context("fork")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_child_retries, args=(refusing.name, theirs))
    child.start()
    try:
        assert mine.poll(60), "the child's answer"
        assert mine.recv() == 3
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
