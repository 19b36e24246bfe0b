"""Iterative engines under a token budget (max_batch_tokens): a request that
does not fit lets later ones that do go ahead of it, for a bounded number of
steps (the engine's max_steps), after which nothing joins past it until it
fits; among those waiting, the most urgent joins first.

A fixed-shape request reserves its max_steps (the engine's unless it asks
for fewer): with max_steps=8, a request of the engine's max_steps is 8
tokens, one asking max_steps=2 is 2.
"""
from conftest import wait_for
from iterative_helpers import (
    assert_each_joined_request_left_once,
    bits,
    ints,
    joined_on,
    records,
    scripted,
    wait_held,
)
from step_models import HOLD, chunks, read_log, request

import engine


def events(log) -> list:
    """The joins and leaves in the order they happened, as (event, tag)."""
    return [(r[0], r[3]) for r in read_log(log) if r[0] != "hold"]


def test_a_request_over_the_budget_lets_a_later_one_that_fits_go_ahead(make_engine, log, gate):
    eng = scripted(make_engine, "budget-pass", log, gate=gate, max_steps=8, max_batch_tokens=12)
    with engine.Client(eng.name) as c:
        running = c.stream(request(1, 6, HOLD, bits(1, 4)), timeout=60)  # 8 tokens
        wait_held(log, 1, 1)
        big = c.stream(request(2, 3), timeout=60)  # 8 more: over the budget of 12
        # 2 more: fits. Its deadline is far shorter than the gate's hold: had it to wait
        # for the big one, which waits for the running one, it would expire
        small = c.stream(request(3, 2), timeout=30, max_steps=2)
        gate.open()
        wait_held(log, 1, 4)  # the running one is held again, two steps later
        assert ints(small) == chunks(3, 2)  # answered in full meanwhile
        assert joined_on(log, 2) == []  # the big one still waits
        gate.open()
        assert ints(running) == chunks(1, 6)
        assert ints(big) == chunks(2, 3)  # and is answered once the running one has left
    order = events(log)
    assert order.index(("join", 3)) < order.index(("leave", 1)) < order.index(("join", 2))
    assert_each_joined_request_left_once(log)


def test_a_request_passed_over_for_max_steps_steps_joins_before_later_ones(
        make_engine, log, gate):
    # budget 16: two 5-token streams leave 6, short of the big one's 8. They leave one
    # per step, each replaced at once by a queued one that fits: passing the big one over
    # for ever, it would wait until the 30 queued ones had all joined
    eng = scripted(make_engine, "budget-bound", log, gate=gate, max_steps=8,
                   max_batch_tokens=16, max_batch_size=32)
    with engine.Client(eng.name) as c:
        first = c.stream(request(1, 5, HOLD, bits(1)), timeout=60, max_steps=5)
        wait_held(log, 1, 1)
        second = c.stream(request(2, 5, HOLD, bits(1)), timeout=60, max_steps=5)
        gate.open()
        wait_held(log, 2, 1)  # one step behind the first
        big = c.stream(request(3, 4), timeout=60)
        flood = [c.stream(request(tag, 5), timeout=60, max_steps=5) for tag in range(10, 40)]
        gate.open()
        assert ints(big) == chunks(3, 4)
        for s, tag in [(first, 1), (second, 2)] + list(zip(flood, range(10, 40))):
            assert ints(s) == chunks(tag, 5)
    joins = [r[3] for r in records(log, "join")]
    ahead = joins.index(3) - 2  # flood requests that joined before the big one
    # 8 steps of passing it over, at most one joining a step, then none
    assert 1 <= ahead <= 9, joins
    assert_each_joined_request_left_once(log)


def test_among_those_waiting_for_the_budget_the_most_urgent_joins_first(make_engine, log, gate):
    eng = scripted(make_engine, "budget-urgent", log, gate=gate, max_steps=8,
                   max_batch_tokens=16, priority_levels=2)
    with engine.Client(eng.name) as c:
        first = c.stream(request(1, 8, HOLD, bits(1)), timeout=60)  # 8 tokens
        wait_held(log, 1, 1)
        second = c.stream(request(2, 8, HOLD, bits(1, 2)), timeout=60)  # 8: the budget is full
        gate.open()
        wait_held(log, 2, 1)
        late = c.stream(request(3, 2), timeout=60, priority=1)
        gate.open()
        wait_held(log, 2, 2)  # a step after the one that claimed it: it waits, claimed
        wait_for(lambda: eng.stats()["queue_depth"] == 0, "the less urgent one claimed")
        urgent = c.stream(request(4, 2), timeout=60, priority=0)
        gate.open()
        for s, tag, n in ((first, 1, 8), (second, 2, 8), (late, 3, 2), (urgent, 4, 2)):
            assert ints(s) == chunks(tag, n)
    order = events(log)
    # when the first leaves, room for one: the urgent one, though claimed after the other
    assert order.index(("leave", 1)) < order.index(("join", 4)) < order.index(("join", 3))
    assert_each_joined_request_left_once(log)
