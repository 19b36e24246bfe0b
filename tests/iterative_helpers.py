"""What the iterative engine tests (tests/test_iterative_*.py) share: an
engine around step_models.Scripted, and the reads of its call log. (An
iterative engine's requests join and leave a running batch at every step,
and each answer streams to its client chunk by chunk.)

The step model is step_models.Scripted: chunk k of request (tag, length, ...)
is tag * 1000 + k, it is done after `length` chunks, and marked requests
hold their step behind a Gate, fail their join or step, or kill their
batcher. Its log records every join, leave and hold, so a test knows when a
step is held (and sends what must join after it only then) and counts the
leave calls. Orders are made by those holds, never by timing.

A test module that takes the `log` fixture imports it from here.
"""
import collections

import numpy as np
from conftest import wait_for, wait_until_no_slot_in_use
from step_models import read_log

from engine.shm import ring

SPEC = dict(backend="step_models:scripted", input_shape=(4,), input_dtype="int64",
            output_shape=(), output_dtype="int64", iterative=True)


def bits(*ks) -> int:
    """HOLD's arg: hold before each of these chunks."""
    return sum(1 << k for k in ks)


def scripted(make_engine, tag, log, gate=None, max_steps=32, model=None, **knobs):
    args = {"log": log, **({} if gate is None else {"gate": gate.name}), **(model or {})}
    return make_engine(tag, **{**SPEC, **knobs}, max_steps=max_steps, backend_args=args)


def ints(stream) -> list:
    return [int(chunk) for chunk in stream]


def records(log, event, tag=None) -> list:
    return [r for r in read_log(log) if r[0] == event and (tag is None or r[3] == tag)]


def joined_on(log, tag) -> list:
    """The pids of the batchers `tag` joined, in order."""
    return [r[1] for r in records(log, "join", tag)]


def wait_held(log, tag, k) -> None:
    """Until the model holds the step that would write chunk k of `tag`."""
    wait_for(lambda: any(r[4] == k for r in records(log, "hold", tag)),
             f"the step before chunk {k} of tag {tag} held", timeout_s=30)


def left(log, tag) -> list:
    """The chunk counts `tag` had at each leave call (one entry per call)."""
    return [r[4] for r in records(log, "leave", tag)]


def wait_left(log, tag) -> list:
    wait_for(lambda: left(log, tag), f"leave called for tag {tag}", timeout_s=30)
    return left(log, tag)


def assert_each_joined_request_left_once(log, dead=()) -> dict:
    """Every (pid, id) that joined was left exactly once by the same process
    (at most once by a batcher in `dead`, killed meanwhile), and nothing that
    did not join was left. Returns {tag: [pids it joined on]}."""
    recs = read_log(log)
    joins = collections.Counter((p, i) for e, p, i, _, _ in recs if e == "join")
    leaves = collections.Counter((p, i) for e, p, i, _, _ in recs if e == "leave")
    assert all(n == 1 for n in joins.values()), joins
    assert set(leaves) <= set(joins), set(leaves) - set(joins)  # left, never joined there
    for key in joins:
        if key[0] in dead:
            assert leaves[key] <= 1, key
        else:
            assert leaves[key] == 1, (key, leaves[key])
    by_tag = collections.defaultdict(list)
    for e, p, i, tag, _ in recs:
        if e == "join":
            by_tag[tag].append(p)
    return dict(by_tag)


def slot_states(eng) -> np.ndarray:
    n = eng.segment.capacity
    ctl, owner = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    eng.segment.ring.snapshot(ctl, owner)
    return ring.ctl_state(ctl)


def wait_idle(eng) -> dict:
    """Every slot free and no request in a running batch (the last step's
    figures are written just after its answers)."""
    assert wait_until_no_slot_in_use(eng)
    wait_for(lambda: eng.stats()["active"] == 0, "no request in a running batch", timeout_s=30)
    return eng.stats()


def tag_length(tag):
    """The length (1 to 24 chunks) of the request of this tag, in the tests
    that send many."""
    return 1 + (tag * 7) % 24
