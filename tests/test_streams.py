"""Iterative engines (issue 21, contract section 9): requests join and leave a
running batch at every step, and each answer streams to its client chunk by
chunk.

The step model is step_models.Scripted: chunk k of request (tag, length, ...)
is tag * 1000 + k, it is done after `length` chunks, and marked requests
hold their step behind a Gate, fail their join or step, or kill their
batcher. Its log records every join, leave and hold, so a test knows when a
step is held (and sends what must join after it only then) and counts the
leave calls. Orders are made by those holds, never by timing.
"""
import asyncio
import collections
import gc
import os
import signal
import threading

import numpy as np
import pytest

import engine
from engine import ring
from engine.decoder import Decoder
from conftest import wait_for, wait_until_no_slot_in_use
from step_models import (BAD_OUT, FAIL_JOIN, FAIL_LEAVE, FAIL_STEP, HOLD, KILL, chunks,
                         read_log, request, rows)

SPEC = dict(backend="step_models:scripted", input_shape=(4,), input_dtype="int64",
            output_shape=(), output_dtype="int64", iterative=True)


def bits(*ks) -> int:
    """HOLD's arg: hold before each of these chunks."""
    return sum(1 << k for k in ks)


@pytest.fixture
def log(tmp_path):
    return str(tmp_path / "calls.log")


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


# -- order and exactly-once -------------------------------------------------------------

def _length(tag):
    return 1 + (tag * 7) % 24


def _own_max_steps(tag):
    return 1 + tag % 10 if tag % 3 == 0 else None


def _read_round_robin(name, client_id, out):
    """Two threads of one Client, each with six streams open at once, read a
    chunk of each in turn; reports every chunk, by tag."""
    got, errors = {}, []
    with engine.Client(name) as c:
        def run(thread):
            tags = [client_id * 100 + thread * 10 + j for j in range(6)]
            live = {t: c.stream(request(t, _length(t)), timeout=60, max_steps=_own_max_steps(t))
                    for t in tags}
            for t in tags:
                got[t] = []
            while live:
                for t, s in list(live.items()):
                    try:
                        got[t].append(int(next(s)))
                    except StopIteration:
                        del live[t]
                    except engine.EngineError as e:
                        errors.append(f"{t}: {type(e).__name__}: {e}")
                        del live[t]
        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    out.put((got, errors))


def test_each_streams_chunks_come_in_step_order_exactly_once_across_client_processes(
        make_engine, log, fork_ctx):
    eng = scripted(make_engine, "order", log, max_steps=24, instances=2, max_batch_size=8)
    out = fork_ctx.Queue()
    procs = [fork_ctx.Process(target=_read_round_robin, args=(eng.name, i + 1, out))
             for i in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    got = {}
    for chunks_by_tag, errors in results:
        assert errors == []
        got.update(chunks_by_tag)
    assert len(got) == 36
    for tag, seen in got.items():
        steps = min(_length(tag), _own_max_steps(tag) or 24)
        assert seen == chunks(tag, steps), tag
    joined = assert_each_joined_request_left_once(log)
    assert sorted(joined) == sorted(got) and all(len(p) == 1 for p in joined.values())
    for tag, seen in got.items():  # left by the batcher that joined it, after its last chunk
        assert left(log, tag) == [len(seen)]
    assert wait_idle(eng)["chunks_total"] == sum(len(s) for s in got.values())


def test_a_short_request_ends_while_a_long_one_runs(make_engine, log, gate):
    eng = scripted(make_engine, "short", log, gate=gate)
    with engine.Client(eng.name) as c:
        long = c.stream(request(1, 20, HOLD, bits(1, 10)), timeout=60)
        wait_held(log, 1, 1)
        short = c.stream(request(2, 3), timeout=60)  # joins the running batch after this step
        gate.open()
        # its stream ends while the long one is held before its chunk 10 (the gate is shut)
        assert ints(short) == chunks(2, 3)
        assert left(log, 2) == [3] and left(log, 1) == []
        gate.open()
        assert ints(long) == chunks(1, 20)
    assert left(log, 1) == [20]
    assert_each_joined_request_left_once(log)


# -- max_steps ---------------------------------------------------------------------------

def test_a_request_ends_at_the_smaller_of_the_engines_and_its_own_max_steps(make_engine, log):
    eng = scripted(make_engine, "steps", log, max_steps=8)
    with engine.Client(eng.name) as c:
        assert ints(c.stream(request(1, 20), timeout=30)) == chunks(1, 8)          # the engine's
        assert ints(c.stream(request(2, 20), timeout=30, max_steps=5)) == chunks(2, 5)  # its own
        assert ints(c.stream(request(3, 20), timeout=30, max_steps=8)) == chunks(3, 8)
        assert ints(c.stream(request(4, 3), timeout=30, max_steps=5)) == chunks(4, 3)   # done first
        assert c.infer(request(5, 20), timeout=30, max_steps=2).tolist() == chunks(5, 2)
    assert [left(log, t) for t in range(1, 6)] == [[8], [5], [8], [3], [2]]


def test_a_bad_max_steps_or_an_out_is_invalid_input_before_anything_is_enqueued(make_engine, log):
    eng = scripted(make_engine, "badsteps", log, max_steps=8)
    bad_values = [0, -1, 9, 2.5, "3", True]
    with engine.Client(eng.name) as c:
        for bad in bad_values:
            for call in (c.stream, c.infer, c.submit):
                with pytest.raises(engine.InvalidInput,
                                   match=r"max_steps: expected an int in \[1, 8\]"):
                    call(request(1, 4), timeout=30, max_steps=bad)
            with pytest.raises(engine.InvalidInput, match="max_steps"):
                asyncio.run(c.infer_async(request(1, 4), timeout=30, max_steps=bad))
        for out in (np.empty((), np.int64), np.empty(8, np.int64)):  # a chunk's, the answer's
            with pytest.raises(engine.InvalidInput, match="out"):
                c.infer(request(1, 4), timeout=30, out=out)
        with pytest.raises(engine.InvalidInput, match="expected out=None"):
            c.submit(request(1, 4), timeout=30, out=np.empty((), np.int64))
        stats = eng.stats()
        assert stats["requests_total"] == 0 and stats["invalid_total"] == 4 * len(bad_values) + 3
        assert ints(c.stream(request(2, 4), timeout=30, max_steps=8)) == chunks(2, 4)
    assert read_log(log)[0][3] == 2  # the first request the model saw


# -- leaving early, timeouts --------------------------------------------------------------

def _leave_early(c, x, how) -> list:
    """Reads three chunks of x's stream, then leaves it as `how` says."""
    got = []
    if how == "break":
        for chunk in c.stream(x, timeout=60):
            got.append(int(chunk))
            if len(got) == 3:
                break
    else:
        s = c.stream(x, timeout=60)
        got = [int(next(s)) for _ in range(3)]
        if how == "close":
            s.close()
            s.close()  # idempotent
            assert list(s) == []
        else:  # dropped
            del s
            gc.collect()
    return got


@pytest.mark.parametrize("how", ["break", "close", "drop"])
def test_leaving_a_stream_early_cancels_its_request_and_leave_is_called_once(
        make_engine, log, gate, how):
    eng = scripted(make_engine, "cancel", log, gate=gate, max_steps=64)
    with engine.Client(eng.name) as c:
        other = c.stream(request(2, 8), timeout=60)
        # held before its chunk 3: withdrawn while its batcher is in that step
        assert _leave_early(c, request(1, 50, HOLD, bits(3)), how) == chunks(1, 3)
        gate.open()
        # dropped by the step after the withdrawal (its 4th), not run on to its end
        assert wait_left(log, 1) == [4]
        assert ints(other) == chunks(2, 8)  # unaffected
        assert wait_idle(eng)["slots_in_use"] == 0
        assert ints(c.stream(request(3, 5), timeout=60)) == chunks(3, 5)
    assert left(log, 1) == [4]
    assert_each_joined_request_left_once(log)


def test_a_stream_past_its_timeout_raises_after_the_chunks_that_came_in_time(
        make_engine, log, gate):
    eng = scripted(make_engine, "timeout", log, gate=gate)
    with engine.Client(eng.name) as c:
        got = []
        with pytest.raises(engine.RequestTimeout):
            for chunk in c.stream(request(1, 10, HOLD, bits(2)), timeout=1.5):
                got.append(int(chunk))
        assert got == chunks(1, 2)
        gate.open()
        assert wait_left(log, 1) == [3]  # stopped by the step it was held in
        stats = wait_idle(eng)
        assert stats["slots_in_use"] == 0 and stats["timeouts_total"] == 1
        assert ints(c.stream(request(2, 4), timeout=30)) == chunks(2, 4)
    assert left(log, 1) == [3]
    assert_each_joined_request_left_once(log)


def test_a_deadline_passing_while_a_stream_runs_stops_it_in_the_engine(make_engine, log):
    # 400 steps of 2 ms each take 0.8 s at least: a 0.3 s deadline passes mid-stream
    eng = scripted(make_engine, "deadline", log, max_steps=400, model={"step_ms": 2.0})
    with engine.Client(eng.name) as c:
        got = []
        with pytest.raises(engine.RequestTimeout):
            for chunk in c.stream(request(1, 10**6), timeout=0.3):
                got.append(int(chunk))
        assert got == chunks(1, len(got)) and len(got) < 400
        [count] = wait_left(log, 1)
        assert len(got) <= count < 400
        wait_idle(eng)
    assert left(log, 1) == [count]


# -- failures -------------------------------------------------------------------------

def test_a_failing_join_fails_the_requests_it_named_and_the_running_ones_go_on(
        make_engine, log, gate):
    eng = scripted(make_engine, "failjoin", log, gate=gate)
    with engine.Client(eng.name) as c:
        running = c.stream(request(1, 10, HOLD, bits(1)), timeout=60)
        wait_held(log, 1, 1)
        # both join at the next step, in one join call, which raises for tag 2
        named = [c.stream(request(2, 5, FAIL_JOIN), timeout=60),
                 c.stream(request(3, 5), timeout=60)]
        gate.open()
        for s in named:
            got = []
            with pytest.raises(engine.BackendError, match=r"join refuses tags \[2\]") as info:
                for chunk in s:
                    got.append(int(chunk))
            assert got == [] and info.value.exc_type == "ValueError"
        assert ints(running) == chunks(1, 10)
        assert ints(c.stream(request(4, 3), timeout=60)) == chunks(4, 3)
    assert [left(log, t) for t in (1, 2, 3, 4)] == [[10], [0], [0], [3]]
    assert_each_joined_request_left_once(log)
    assert eng.stats()["errors_total"] == 2


def test_a_failing_step_fails_its_requests_after_the_chunks_they_had(make_engine, log, gate):
    eng = scripted(make_engine, "failstep", log, gate=gate)
    with engine.Client(eng.name) as c:
        held = c.stream(request(1, 10, HOLD, bits(1)), timeout=60)
        wait_held(log, 1, 1)
        failing = c.stream(request(2, 10, FAIL_STEP, 2), timeout=60)  # joins at tag 1's chunk 2
        gate.open()
        # the step that would write tag 2's chunk 2 (and tag 1's chunk 4) raises
        for s, tag, had in ((held, 1, 4), (failing, 2, 2)):
            got = []
            with pytest.raises(engine.BackendError, match="step fails at chunk 2 of tag 2") as info:
                for chunk in s:
                    got.append(int(chunk))
            assert got == chunks(tag, had) and info.value.exc_type == "RuntimeError"
        assert ints(c.stream(request(3, 4), timeout=60)) == chunks(3, 4)  # the batcher goes on
    assert [left(log, t) for t in (1, 2, 3)] == [[4], [2], [4]]
    assert_each_joined_request_left_once(log)
    assert eng.stats()["batcher_restarts_total"] == 0


def test_a_step_returning_a_bad_result_fails_its_requests_after_the_chunks_they_had(
        make_engine, log):
    eng = scripted(make_engine, "badout", log)
    with engine.Client(eng.name) as c:
        got = []
        with pytest.raises(engine.BackendError, match=r"expected int64\[1\].*got int64\[0\]") as info:
            for chunk in c.stream(request(1, 10, BAD_OUT, 3), timeout=60):
                got.append(int(chunk))
        assert got == chunks(1, 3) and info.value.exc_type == "BadResult"
        assert ints(c.stream(request(2, 4), timeout=60)) == chunks(2, 4)
    assert left(log, 1) == [4] and left(log, 2) == [4]  # (the model counted its bad step)
    assert_each_joined_request_left_once(log)


def test_a_leave_that_raises_changes_no_answer(make_engine, log):
    eng = scripted(make_engine, "failleave", log)
    with engine.Client(eng.name) as c:
        assert ints(c.stream(request(1, 5, FAIL_LEAVE), timeout=60)) == chunks(1, 5)
        assert ints(c.stream(request(2, 4), timeout=60)) == chunks(2, 4)
        stats = wait_idle(eng)
    assert stats["errors_total"] == 0 and stats["batcher_restarts_total"] == 0
    assert left(log, 1) == [5]
    assert_each_joined_request_left_once(log)


# -- asyncio -------------------------------------------------------------------------

def test_async_streams_run_concurrently_each_with_its_own_chunks(make_engine, log):
    eng = scripted(make_engine, "async", log, max_steps=24, max_batch_size=8)

    async def read(c, tag):
        return [int(chunk) async for chunk in c.stream_async(request(tag, _length(tag)),
                                                             timeout=60)]

    async def main(c):
        streamed = asyncio.gather(*(read(c, tag) for tag in range(1, 13)))
        whole = asyncio.gather(*(c.infer_async(request(tag, _length(tag)), timeout=60)
                                 for tag in range(13, 17)))
        return await streamed, await whole

    with engine.Client(eng.name) as c:
        streamed, whole = asyncio.run(main(c))
    for tag, got in zip(range(1, 13), streamed):
        assert got == chunks(tag, _length(tag)), tag
    for tag, y in zip(range(13, 17), whole):
        assert y.tolist() == chunks(tag, _length(tag)), tag
    assert_each_joined_request_left_once(log)


def test_breaking_out_of_an_async_stream_cancels_its_request(make_engine, log, gate):
    eng = scripted(make_engine, "async-cancel", log, gate=gate, max_steps=64)

    async def until(predicate, what):
        for _ in range(30_000):  # 30 s at most
            if predicate():
                return
            await asyncio.sleep(0.001)
        raise TimeoutError(what)

    async def leave_early(c):
        got = []
        async for chunk in c.stream_async(request(1, 50, HOLD, bits(3)), timeout=60):
            got.append(int(chunk))
            if len(got) == 3:
                break
        # the generator, dropped, is closed by the loop: the request is withdrawn
        await until(lambda: ring.ABANDONED in slot_states(eng), "the request withdrawn")
        gate.open()
        return got

    async def other(c):
        return [int(chunk) async for chunk in c.stream_async(request(2, 8), timeout=60)]

    async def main(c):
        return await asyncio.gather(leave_early(c), other(c))

    with engine.Client(eng.name) as c:
        got, others = asyncio.run(main(c))
    assert got == chunks(1, 3) and others == chunks(2, 8)
    assert wait_left(log, 1) == [4]
    wait_idle(eng)
    assert_each_joined_request_left_once(log)


def test_an_async_stream_past_its_timeout_raises_after_the_chunks_that_came_in_time(
        make_engine, log, gate):
    eng = scripted(make_engine, "async-timeout", log, gate=gate)

    async def main(c):
        got = []
        with pytest.raises(engine.RequestTimeout):
            async for chunk in c.stream_async(request(1, 10, HOLD, bits(2)), timeout=1.5):
                got.append(int(chunk))
        return got

    with engine.Client(eng.name) as c:
        assert asyncio.run(main(c)) == chunks(1, 2)
        gate.open()
        assert wait_left(log, 1) == [3]
        assert wait_idle(eng)["timeouts_total"] == 1
    assert_each_joined_request_left_once(log)


# -- a batcher killed, a reload ---------------------------------------------------------

def test_a_killed_batcher_fails_its_streams_with_chunks_and_its_successor_serves_the_others(
        make_engine, log, gate):
    eng = scripted(make_engine, "killed", log, gate=gate, max_steps=16, max_batch_size=3)
    first_pid = eng.stats()["batcher_pids"][0]
    with engine.Client(eng.name) as c:
        held = c.stream(request(1, 10, HOLD, bits(1, 3)), timeout=60)
        wait_held(log, 1, 1)
        killer = c.stream(request(2, 10, KILL, 2), timeout=60)  # its step 2 kills the batcher
        gate.open()
        wait_held(log, 1, 3)  # tag 1 before its chunk 3, tag 2 before its chunk 1
        # one of these joins the step that kills (no chunk yet), the other is queued:
        # the batch holds max_batch_size=3
        fresh = [c.stream(request(3, 4), timeout=60), c.stream(request(4, 4), timeout=60)]
        gate.open()
        messages = []
        for s, tag, had in ((held, 1, 4), (killer, 2, 2)):
            got = []
            with pytest.raises(engine.BackendError, match="killed by signal 9") as info:
                for chunk in s:
                    got.append(int(chunk))
            assert got == chunks(tag, had) and info.value.exc_type == "BatcherDied"
            messages.append(str(info.value))
        for s, tag in zip(fresh, (3, 4)):
            assert ints(s) == chunks(tag, 4)  # in full, by the successor
        stats = wait_idle(eng)
    assert stats["batcher_restarts_total"] == 1
    [second_pid] = stats["batcher_pids"]
    assert second_pid != first_pid
    joined = assert_each_joined_request_left_once(log, dead={first_pid})
    assert joined[1] == joined[2] == [first_pid]
    # one joined the dead batcher and was retried by the successor, the other was queued
    assert sorted([joined[3], joined[4]]) == [[first_pid, second_pid], [second_pid]]
    assert left(log, 3) == left(log, 4) == [4]  # each left once, by the successor
    assert all("streaming this request" in m and "poison" not in m for m in messages), messages


def test_a_request_that_kills_two_batchers_fails_as_poison(make_engine, log):
    eng = scripted(make_engine, "poison", log, max_steps=16)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.BackendError, match="failed as poison") as info:
            ints(c.stream(request(1, 5, KILL, 0), timeout=60))  # before its first chunk
        assert info.value.exc_type == "BatcherDied"
        assert ints(c.stream(request(2, 4), timeout=60)) == chunks(2, 4)
        stats = wait_idle(eng)
    assert stats["batcher_restarts_total"] == 2 and stats["errors_total"] == 1
    joined = assert_each_joined_request_left_once(log, dead=set(joined_on(log, 1)))
    assert len(set(joined[1])) == 2  # joined by the first batcher, then retried by the second
    assert joined[2] == stats["batcher_pids"]


def test_reload_lets_running_streams_finish_on_the_old_batcher_while_new_ones_join_the_new(
        make_engine, log, gate):
    eng = scripted(make_engine, "reload", log, gate=gate, max_steps=16, model={"version": 1})
    [old_pid] = eng.stats()["batcher_pids"]
    with engine.Client(eng.name) as c:
        first = c.stream(request(1, 8, HOLD, bits(0, 3)), timeout=60)
        wait_held(log, 1, 0)
        second = c.stream(request(2, 8), timeout=60)
        gate.open()
        wait_held(log, 1, 3)  # both running on the old batcher, held
        reloaded = {}
        reload = threading.Thread(target=lambda: reloaded.update(eng.reload(
            backend_args={"log": log, "gate": gate.name, "version": 2})))
        reload.start()
        try:
            wait_for(lambda: eng.segment.epoch() == 1, "the new batcher serving, the old retiring")
            # served in full by the new batcher while the old one is still held
            new = [c.stream(request(tag, 4), timeout=60) for tag in (10, 11, 12)]
            for s, tag in zip(new, (10, 11, 12)):
                assert ints(s) == chunks(tag, 4, version=2)
            assert reload.is_alive()
        finally:
            gate.open()
            reload.join(60)
        assert ints(first) == chunks(1, 8, version=1)
        assert ints(second) == chunks(2, 8, version=1)
        assert ints(c.stream(request(13, 3), timeout=60)) == chunks(13, 3, version=2)
    assert not reload.is_alive()
    [new_pid] = reloaded["batcher_pids"]
    assert new_pid != old_pid and eng.stats()["batcher_pids"] == [new_pid]
    joined = assert_each_joined_request_left_once(log)
    assert joined == {1: [old_pid], 2: [old_pid], 10: [new_pid], 11: [new_pid], 12: [new_pid],
                      13: [new_pid]}
    stats = eng.stats()
    assert stats["errors_total"] == 0 and stats["batcher_restarts_total"] == 0


def test_a_reload_while_a_successor_retries_what_its_predecessor_left_loses_none(
        make_engine, log, gate):
    eng = scripted(make_engine, "reload-retry", log, gate=gate, max_steps=16, max_batch_size=4)
    first_pid = eng.stats()["batcher_pids"][0]
    with engine.Client(eng.name) as c:
        held = c.stream(request(1, 10, HOLD, bits(1, 3)), timeout=60)
        wait_held(log, 1, 1)
        killer = c.stream(request(2, 10, KILL, 2), timeout=60)
        gate.open()
        wait_held(log, 1, 3)
        # both join the step that kills the batcher, with no chunk yet: kept for its
        # successor, which retries them one by one, each held before its first chunk
        kept = [c.stream(request(tag, 4, HOLD, bits(0)), timeout=60) for tag in (3, 4)]
        gate.open()
        for s in (held, killer):
            with pytest.raises(engine.BackendError, match="BatcherDied"):
                ints(s)
        wait_for(lambda: eng.stats()["batcher_pids"] not in ([], [first_pid]),
                 "the killed batcher replaced", timeout_s=30)
        [successor] = eng.stats()["batcher_pids"]
        wait_for(lambda: any(r[1] == successor for r in records(log, "hold")),
                 "the successor holds the first of them", timeout_s=30)
        reloaded = {}
        reload = threading.Thread(target=lambda: reloaded.update(eng.reload(
            backend_args={"log": log, "gate": gate.name})))
        reload.start()
        try:
            # the successor retires with the second still to retry: it starts it still
            wait_for(lambda: eng.segment.epoch() == 1, "the successor retiring", timeout_s=60)
        finally:
            gate.open()
            gate.open()
            reload.join(60)
        for s, tag in zip(kept, (3, 4)):
            assert ints(s) == chunks(tag, 4)
    assert not reload.is_alive() and reloaded["batcher_pids"] != [successor]
    joined = assert_each_joined_request_left_once(log, dead={first_pid})
    assert joined[3] == joined[4] == [first_pid, successor]
    assert eng.stats()["errors_total"] == 2  # the two that had chunks


def test_a_stream_that_outlasts_a_reloads_drain_timeout_fails_after_its_chunks(
        make_engine, log, gate):
    eng = scripted(make_engine, "reload-overrun", log, gate=gate, max_steps=16,
                   drain_timeout_s=0.5)
    with engine.Client(eng.name) as c:
        s = c.stream(request(1, 8, HOLD, bits(2)), timeout=60)
        wait_held(log, 1, 2)  # and never let go: the reload kills it after drain_timeout_s
        [new_pid] = eng.reload(backend_args={"log": log})["batcher_pids"]
        got = []
        with pytest.raises(engine.BackendError, match="after a reload retired it; killed") as info:
            for chunk in s:
                got.append(int(chunk))
        assert got == chunks(1, 2) and info.value.exc_type == "BatcherDied"
        assert ints(c.stream(request(2, 3), timeout=60)) == chunks(2, 3)
        assert wait_until_no_slot_in_use(eng)
        stats = eng.stats()
    assert stats["batcher_pids"] == [new_pid] and stats["errors_total"] == 1
    wait_for(lambda: eng.stats()["active"] == 0, "no request in a running batch", timeout_s=30)


# -- the two kinds of engine ------------------------------------------------------------

def test_a_one_shot_engines_stream_yields_its_one_answer_once(make_engine):
    eng = make_engine("oneshot", backend="helpers:affine")
    x = np.arange(16, dtype=np.float32)
    with engine.Client(eng.name) as c:
        got = list(c.stream(x, timeout=30))
        assert len(got) == 1 and np.array_equal(got[0], x * 2 + 1)

        async def main():
            return [chunk async for chunk in c.stream_async(x + 1, timeout=30)]
        got = asyncio.run(main())
        assert len(got) == 1 and np.array_equal(got[0], (x + 1) * 2 + 1)
        with c.stream(x + 2, timeout=30) as s:  # closed before it is read: nothing comes
            pass
        assert list(s) == []
        del s
        assert wait_until_no_slot_in_use(eng)


def test_infer_and_submit_on_an_iterative_engine_give_the_chunks_stacked(make_engine, log):
    eng = scripted(make_engine, "stacked", log, max_steps=12, model={"width": 3},
                   output_shape=(3,))
    with engine.Client(eng.name) as c:
        y = c.infer(request(1, 5), timeout=30)
        assert y.shape == (5, 3) and np.array_equal(y, rows(1, 5, 3))
        futures = [c.submit(request(tag, tag), timeout=30) for tag in range(2, 8)]
        for tag, f in zip(range(2, 8), futures):
            assert np.array_equal(f.result(timeout=30), rows(tag, tag, 3))
        y = c.infer(request(8, 50), timeout=30, max_steps=4)
        assert np.array_equal(y, rows(8, 4, 3))
        y = asyncio.run(c.infer_async(request(9, 50), timeout=30))
        assert np.array_equal(y, rows(9, 12, 3))
        streamed = list(c.stream(request(10, 2), timeout=30))
        assert [s.shape for s in streamed] == [(3,), (3,)]
        assert np.array_equal(np.stack(streamed), rows(10, 2, 3))
    assert_each_joined_request_left_once(log)


def test_named_tensors_stream_as_dicts_and_stack_as_dicts(make_engine, log):
    eng = make_engine("named", backend="step_models:named", backend_args={"log": log},
                      iterative=True, max_steps=8,
                      inputs={"request": ("int64", (4,)), "weights": ("float64", (None,))},
                      max_input_shapes={"weights": (6,)},
                      outputs={"chunk": ("int64", ()), "mass": ("float64", (2,))})

    def x(tag, length, weights):
        return {"request": request(tag, length), "weights": np.array(weights, np.float64)}

    with engine.Client(eng.name) as c:
        streams = [c.stream(x(1, 3, [0.5, 1.5]), timeout=60),
                   c.stream(x(2, 4, [1, 2, 3, 4, 5]), timeout=60)]
        for s, tag, n, mass in zip(streams, (1, 2), (3, 4), (2.0, 15.0)):
            got = list(s)
            assert all(set(chunk) == {"chunk", "mass"} for chunk in got)
            assert [int(chunk["chunk"]) for chunk in got] == chunks(tag, n)
            assert np.array_equal(np.stack([chunk["mass"] for chunk in got]),
                                  [[mass, k] for k in range(n)])
        y = c.infer(x(3, 20, [2.0]), timeout=60, max_steps=5)
        assert y["chunk"].tolist() == chunks(3, 5)
        assert np.array_equal(y["mass"], [[2.0, k] for k in range(5)])
    assert_each_joined_request_left_once(log)


# -- scheduling, a dead client, stop ---------------------------------------------------

def test_priorities_order_who_joins_the_running_batch(make_engine, log, gate):
    eng = scripted(make_engine, "priority", log, gate=gate, max_batch_size=1, priority_levels=3)
    with engine.Client(eng.name) as c:
        running = c.stream(request(1, 3, HOLD, bits(1)), timeout=60)
        wait_held(log, 1, 1)  # the running batch is full (max_batch_size=1)
        queued = [c.stream(request(tag, 2), timeout=60, priority=p)
                  for tag, p in ((2, 2), (3, 1), (4, 0), (5, 1))]
        gate.open()
        assert ints(running) == chunks(1, 3)
        for s, tag in zip(queued, (2, 3, 4, 5)):
            assert ints(s) == chunks(tag, 2)
    # most urgent first, oldest first within a level
    assert [r[3] for r in records(log, "join")] == [1, 4, 3, 5, 2]


def test_a_request_over_the_token_budget_waits_and_joins_when_one_leaves(make_engine, log, gate):
    # a fixed-shape request reserves its max_steps: two of 8 fill a budget of 16
    eng = scripted(make_engine, "budget", log, gate=gate, max_steps=8, max_batch_tokens=16,
                   max_batch_size=8)
    with engine.Client(eng.name) as c:
        first = c.stream(request(1, 6, HOLD, bits(1)), timeout=60)
        wait_held(log, 1, 1)
        second = c.stream(request(2, 3), timeout=60)
        third = c.stream(request(3, 3), timeout=60)               # 8 more: over the budget
        fourth = c.stream(request(4, 3), timeout=60, max_steps=1)  # 1 would fit: waits its turn
        gate.open()
        assert ints(first) == chunks(1, 6)
        for s, tag, n in ((second, 2, 3), (third, 3, 3), (fourth, 4, 1)):
            assert ints(s) == chunks(tag, n)
    order = [(r[0], r[3]) for r in read_log(log) if r[0] != "hold"]
    assert order.index(("join", 3)) > order.index(("leave", 2))  # joined when 2 left
    assert order.index(("join", 4)) > order.index(("leave", 1))  # and 4 when 1 left
    assert_each_joined_request_left_once(log)


def _stream_then_wait(name, x, ready):
    with engine.Client(name) as c:
        s = c.stream(x, timeout=60)
        for _ in range(3):
            next(s)
        ready.set()
        threading.Event().wait(60)  # until killed


def test_a_killed_clients_stream_is_left_and_its_slot_comes_back(make_engine, log, gate,
                                                                  fork_ctx):
    eng = scripted(make_engine, "dead-client", log, gate=gate, max_steps=64)
    ready = fork_ctx.Event()
    victim = fork_ctx.Process(target=_stream_then_wait,
                              args=(eng.name, request(1, 50, HOLD, bits(3)), ready))
    victim.start()
    assert ready.wait(30)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    wait_for(lambda: ring.ABANDONED in slot_states(eng), "the dead client's request withdrawn",
             timeout_s=30)  # by the supervisor's reaper
    gate.open()
    assert wait_left(log, 1) == [4]
    stats = wait_idle(eng)
    assert stats["reclaimed_slots_total"] == 1 and stats["slots_in_use"] == 0
    with engine.Client(eng.name) as c:
        assert ints(c.stream(request(2, 4), timeout=60)) == chunks(2, 4)


def test_stop_lets_running_and_queued_streams_finish(make_engine, log, gate):
    eng = scripted(make_engine, "stop", log, gate=gate)
    c = engine.Client(eng.name)
    running = c.stream(request(1, 10, HOLD, bits(3)), timeout=60)
    wait_held(log, 1, 3)
    queued = c.stream(request(2, 5), timeout=60)
    stopper = threading.Thread(target=eng.stop)
    stopper.start()
    try:
        wait_for(lambda: eng.segment.engine_state() != ring.ENGINE_RUNNING, "the engine stopping")
        with pytest.raises(engine.EngineUnavailable):
            c.stream(request(3, 5), timeout=60)
    finally:
        gate.open()
    assert ints(running) == chunks(1, 10)
    assert ints(queued) == chunks(2, 5)
    stopper.join(60)
    assert not stopper.is_alive()
    c.close()
    assert_each_joined_request_left_once(log)


# -- every join left once, under a mixed load ---------------------------------------------

def _mixed(name, client_id, out):
    """Two threads, each sending 12 requests that finish, are left early,
    dropped, or given deadlines they may not meet; every chunk checked."""
    import random
    wrong, outcomes = [], collections.Counter()
    with engine.Client(name) as c:
        def run(thread):
            rng = random.Random(client_id * 10 + thread)
            for j in range(12):
                tag = client_id * 1000 + thread * 100 + j
                kind = rng.choice(["finish", "finish", "cancel", "drop", "timeout"])
                got = []
                try:
                    if kind == "finish":
                        own = rng.choice([None, rng.randint(1, 48)])
                        length = rng.randint(1, 60)
                        got = ints(c.stream(request(tag, length), timeout=60, max_steps=own))
                        if got != chunks(tag, min(length, own or 48)):
                            wrong.append((tag, kind, got))
                    elif kind in ("cancel", "drop"):
                        s = c.stream(request(tag, 60), timeout=60)
                        for _ in range(rng.randint(0, 5)):
                            got.append(int(next(s)))
                        if kind == "cancel":
                            s.close()
                        del s  # dropped: withdrawn by its finaliser
                        if got != chunks(tag, len(got)):
                            wrong.append((tag, kind, got))
                    else:
                        try:
                            for chunk in c.stream(request(tag, 60), timeout=rng.uniform(0.005, 0.05)):
                                got.append(int(chunk))
                            outcomes["in time"] += 1
                        except engine.RequestTimeout:
                            outcomes["timed out"] += 1
                        except engine.Overloaded:
                            outcomes["refused"] += 1
                        if got != chunks(tag, len(got)) or len(got) > 48:
                            wrong.append((tag, kind, got))
                except engine.EngineError as e:
                    wrong.append((tag, kind, f"{type(e).__name__}: {e}"))
                outcomes[kind] += 1
        threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    out.put((wrong, dict(outcomes)))


def test_every_joined_request_is_left_exactly_once_under_mixed_ends(make_engine, log, fork_ctx):
    eng = scripted(make_engine, "mixed", log, max_steps=48, instances=2, max_batch_size=6,
                   model={"step_ms": 0.2})
    out = fork_ctx.Queue()
    procs = [fork_ctx.Process(target=_mixed, args=(eng.name, i + 1, out)) for i in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert [wrong for wrong, _ in results] == [[], [], []]
    assert sum(sum(o[k] for k in ("finish", "cancel", "drop", "timeout"))
               for _, o in results) == 72
    stats = wait_idle(eng)
    joined = assert_each_joined_request_left_once(log)
    assert all(len(pids) == 1 for pids in joined.values())  # each joined once, on one batcher
    assert stats["batcher_restarts_total"] == 0 and stats["errors_total"] == 0


# -- figures ------------------------------------------------------------------------

def test_the_stream_figures_count_every_chunk_and_step(make_engine, log, gate):
    from prometheus_client import CollectorRegistry, generate_latest
    from engine.metrics import Collector

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


# -- the built-in decoder ---------------------------------------------------------------

TINY = dict(vocab=64, d_model=16, layers=1, heads=2, context=64, seed=3)
PROMPTS = [np.array(p, np.int64) for p in ([5], [1, 2, 3], [60, 7, 7, 9, 30, 2], [12, 40])]


def test_a_decoder_stream_equals_the_prompt_decoded_alone(make_engine):
    eng = make_engine("decoder", backend="engine.decoder:steps", backend_args=TINY,
                      input_shape=(None,), max_input_shape=(12,), input_dtype="int64",
                      output_shape=(), output_dtype="int64", iterative=True, max_steps=10)
    model = Decoder(**TINY)
    with engine.Client(eng.name) as c:
        own = [None, 4, None, 7]
        streams = [c.stream(p, timeout=60, max_steps=m) for p, m in zip(PROMPTS, own)]
        for s, p, m in zip(streams, PROMPTS, own):  # decoded together, each as if alone
            assert ints(s) == model.generate_one(p, m or 10).tolist(), p
        assert np.array_equal(c.infer(PROMPTS[2], timeout=60), model.generate_one(PROMPTS[2], 10))


def test_the_one_shot_generate_backend_answers_as_the_decoder_alone(make_engine):
    eng = make_engine("generate", backend="engine.decoder:generate",
                      backend_args={**TINY, "steps": 10},
                      inputs={"prompt": ("int64", (None,)), "max_new_tokens": ("int64", (1,))},
                      max_input_shapes={"prompt": (12,)}, outputs={"tokens": ("int64", (10,))},
                      max_batch_size=4)
    model = Decoder(**TINY)
    budgets = [10, 3, 6, 1]
    with engine.Client(eng.name) as c:
        futures = [c.submit({"prompt": p, "max_new_tokens": np.array([n], np.int64)}, timeout=60)
                   for p, n in zip(PROMPTS, budgets)]
        for f, p, n in zip(futures, PROMPTS, budgets):
            tokens = f.result(timeout=60)["tokens"]
            assert tokens[:n].tolist() == model.generate_one(p, n).tolist(), p
            assert (tokens[n:] == -1).all()


def test_a_decoder_request_ends_at_eos_or_its_context_and_its_batch_mates_go_on(make_engine):
    tiny = {**TINY, "context": 16}
    model = Decoder(**tiny)
    short, long = np.array([1, 2], np.int64), np.arange(20, 32, dtype=np.int64)
    alone_short, alone_long = model.generate_one(short, 10), model.generate_one(long, 5)
    eos = int(alone_short[7])  # short ends at its first eos, after long filled its context
    cut = alone_short.tolist().index(eos) + 1
    assert 5 < cut < 10 and eos not in alone_long.tolist()
    # max_delay_ms: the flush rule starts the two together (the batch fills at 2)
    eng = make_engine("decoder-ends", backend="engine.decoder:steps",
                      backend_args={**tiny, "eos": eos}, input_shape=(None,),
                      max_input_shape=(12,), input_dtype="int64", output_shape=(),
                      output_dtype="int64", iterative=True, max_steps=10, max_batch_size=2,
                      max_delay_ms=60_000)
    with engine.Client(eng.name) as c:
        streams = [c.stream(short, timeout=60), c.stream(long, timeout=60)]
        # long (12 tokens) has room for 16 - 12 + 1 = 5: it ends there, short goes on
        assert ints(streams[1]) == alone_long.tolist()
        assert ints(streams[0]) == alone_short[:cut].tolist()


def test_the_one_shot_generate_backend_ends_each_row_at_its_own_budget_or_context(make_engine):
    tiny = {**TINY, "context": 16}
    model = Decoder(**tiny)
    long, short = np.arange(20, 32, dtype=np.int64), np.array([3], np.int64)
    # one batch: long's budget fits its context, and short runs on past it
    eng = make_engine("generate-ends", backend="engine.decoder:generate",
                      backend_args={**tiny, "steps": 10},
                      inputs={"prompt": ("int64", (None,)), "max_new_tokens": ("int64", (1,))},
                      max_input_shapes={"prompt": (12,)}, outputs={"tokens": ("int64", (10,))},
                      max_batch_size=3, max_delay_ms=60_000, isolate_failures=False)
    with engine.Client(eng.name) as c:
        asks = [(long, 2), (short, 10), (long, 9)]  # the last: room for 5 only
        futures = [c.submit({"prompt": p, "max_new_tokens": np.array([n], np.int64)},
                            timeout=60) for p, n in asks]
        answers = [f.result(timeout=60)["tokens"].tolist() for f in futures]
    assert answers[0] == model.generate_one(long, 2).tolist() + [-1] * 8
    assert answers[1] == model.generate_one(short, 10).tolist()
    assert answers[2] == model.generate_one(long, 5).tolist() + [-1] * 5


def test_admission_refuses_at_once_what_cannot_get_its_first_chunk_before_its_deadline(
        make_engine, log):
    # every step takes at least 50 ms: once the engine has measured a few, a first chunk
    # cannot come within 5 ms, however loaded the machine (a slower step predicts more)
    eng = scripted(make_engine, "admit", log, max_steps=64, model={"step_ms": 50.0})
    with engine.Client(eng.name) as c:
        running = c.stream(request(1, 60), timeout=120)
        assert [int(next(running)) for _ in range(4)] == chunks(1, 4)
        with pytest.raises(engine.Overloaded):
            c.infer(request(2, 3), timeout=0.005)
        assert ints(c.stream(request(3, 2), timeout=120)) == chunks(3, 2)
        running.close()
    stats = wait_idle(eng)
    assert stats["overloaded_total"] == 1 and stats["requests_total"] == 2


def test_status_shows_an_iterative_engines_streams(make_engine, log):
    from engine import cli
    eng = scripted(make_engine, "status", log, max_steps=8)
    with engine.Client(eng.name) as c:
        assert ints(c.stream(request(1, 5), timeout=60)) == chunks(1, 5)
    stats = wait_idle(eng)
    text = cli.status_table({**stats, "state": "running", "supervisor_pid": os.getpid()})
    assert f"0 running, {stats['steps_total']} steps, 5 chunks" in text


def test_a_chunk_count_the_ring_refuses_is_engine_corrupt_and_frees_the_slot():
    import types
    from engine import answers, ring
    freed = []
    fake = types.SimpleNamespace(wait_chunks=lambda *a: (ring.ECORRUPT, 0),
                                 release_slot=lambda slot, gen: freed.append((slot, gen)))
    seg = types.SimpleNamespace(ring=fake, name="x", steps=8)
    with pytest.raises(engine.EngineCorrupt):
        answers.chunk_count(seg, 3, 7)
    assert freed == [(3, 7)]


def test_a_lent_slot_is_refused_by_an_iterative_engine(make_engine, log):
    eng = scripted(make_engine, "lent", log, max_steps=8)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.InvalidInput, match="request"):
            c.request()
        assert ints(c.stream(request(1, 3), timeout=60)) == chunks(1, 3)


def test_a_new_batcher_that_dies_while_a_reload_overlaps_fails_its_streams_at_once(
        make_engine, log, gate):
    eng = scripted(make_engine, "reload-kill", log, gate=gate, max_steps=16, model={"version": 1})
    with engine.Client(eng.name) as c:
        old = c.stream(request(1, 8, HOLD, bits(0, 3)), timeout=120)
        wait_held(log, 1, 0)
        gate.open()
        wait_held(log, 1, 3)  # the old batcher holds its stream: the reload cannot end
        reload = threading.Thread(target=lambda: eng.reload(
            backend_args={"log": log, "gate": gate.name, "version": 2}))
        reload.start()
        try:
            wait_for(lambda: eng.segment.epoch() == 1, "the new batcher serving, the old retiring")
            killed = c.stream(request(2, 8, KILL, 2), timeout=120)
            with pytest.raises(engine.BackendError) as info:
                ints(killed)
            assert info.value.exc_type == "BatcherDied"
            assert reload.is_alive()  # failed while the old batcher still held its stream
        finally:
            gate.open()
            reload.join(120)
        assert ints(old) == chunks(1, 8, version=1)
        assert ints(c.stream(request(3, 3), timeout=120)) == chunks(3, 3, version=2)
    assert not reload.is_alive()


def test_closing_the_client_ends_its_async_streams_with_engine_unavailable(make_engine, log, gate):
    eng = scripted(make_engine, "closeasync", log, gate=gate, max_steps=16)
    c = engine.Client(eng.name)

    async def main():
        got = []
        with pytest.raises(engine.EngineUnavailable, match="closed"):
            async for chunk in c.stream_async(request(1, 8, HOLD, bits(2)), timeout=60):
                got.append(int(chunk))
                if len(got) == 2:  # held before its third chunk: close the client meanwhile
                    await asyncio.get_running_loop().run_in_executor(None, c.close)
        return got

    assert asyncio.run(main()) == chunks(1, 2)
    gate.open()
    assert wait_until_no_slot_in_use(eng)  # the batcher freed the withdrawn slot
    assert len(left(log, 1)) == 1
