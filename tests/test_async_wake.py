"""An asyncio caller is woken by the engine itself (engine.client.wakes): its
answers right across processes, a dead batcher's usual error, a closed or
stuck loop that never holds a batcher up, a forked child's own wakes; a batcher is
counted asleep while idle; a caller alone on an idle loop looks long (not while another
answer is awaited there, nor on a busy loop, nor while no batcher is awake), and backs those
looks off as they miss."""
import asyncio
import os
import signal
import sys
import threading

import numpy as np
import pytest
from conftest import wait_for, wait_until_no_slot_in_use

import engine
from engine.client import looks, ticket, tracing, wakes
from engine.shm import codes

X = np.arange(16, dtype=np.float32)
BOUND_S = 30.0  # every wait of these tests ends by then


@pytest.fixture
def wakes_alone(monkeypatch):
    """The loop's own timer (deadlines, liveness) put past every bound: only
    the engine's wakes can answer within one."""
    monkeypatch.setattr(ticket, "LIVENESS_SLICE_NS", int(10 * BOUND_S * 1e9))


def completer_threads():
    return [t for t in threading.enumerate() if t.name.startswith("shmbatch-completer")]


@pytest.fixture(scope="module")
def affine_engine():
    with engine.Engine(f"t{os.getpid()}-wake-affine", backend="helpers:affine",
                       max_batch_size=8) as eng:
        yield eng


async def _many(c, tasks: int, each: int, seed: int) -> int:
    """tasks coroutines, each awaiting `each` answers in turn; returns how
    many were right (each checked against its own request)."""
    rng = np.random.default_rng(seed)
    xs = rng.standard_normal((tasks, each, 16)).astype(np.float32)

    async def one(t):
        right = 0
        for k in range(each):
            y = await asyncio.wait_for(c.infer_async(xs[t, k], timeout=BOUND_S), BOUND_S)
            right += bool(np.array_equal(y, xs[t, k] * 2 + 1))
        return right
    return sum(await asyncio.gather(*(one(t) for t in range(tasks))))


def _client_process(name, seed, out):
    with engine.Client(name) as c:
        right = asyncio.run(_many(c, 16, 40, seed))
        out.put((seed, right, len(completer_threads())))


def test_asyncio_callers_in_several_processes_each_get_their_own_answers(affine_engine, fork_ctx,
                                                                         wakes_alone):
    out = fork_ctx.Queue()
    procs = [fork_ctx.Process(target=_client_process, args=(affine_engine.name, s, out))
             for s in range(3)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=BOUND_S * 2) for _ in procs)
    for p in procs:
        p.join(BOUND_S)
        assert p.exitcode == 0
    # every answer right, and none went through a completion thread
    assert got == [(s, 16 * 40, 0) for s in range(3)]


def test_an_awaited_answer_wakes_its_own_loop_with_no_completion_thread(affine_engine,
                                                                       wakes_alone):
    with engine.Client(affine_engine.name) as c:
        async def main():
            right = await _many(c, 4, 25, 7)
            return right, wakes.for_loop(c.attached)
        right, waker = asyncio.run(main())
        assert right == 100
        assert waker is not None and waker.id & (1 << wakes.PID_BITS) - 1 == os.getpid()
        assert not completer_threads()


def test_async_streams_of_a_one_shot_engine_take_the_same_path(affine_engine):
    with engine.Client(affine_engine.name) as c:
        async def main():
            return [chunk async for chunk in c.stream_async(X + 3, timeout=BOUND_S)]
        [chunk] = asyncio.run(asyncio.wait_for(main(), BOUND_S))
        assert np.array_equal(chunk, (X + 3) * 2 + 1)


def _forked_child(c, out):
    async def main():
        right = await _many(c, 4, 20, os.getpid())
        return right, wakes.for_loop(c.attached).id
    right, waker_id = asyncio.run(main())
    out.put((right, waker_id & (1 << wakes.PID_BITS) - 1 == os.getpid(), len(completer_threads())))


def test_a_forked_child_awaits_on_its_own_wakes(affine_engine, fork_ctx, wakes_alone):
    with engine.Client(affine_engine.name) as c:
        assert asyncio.run(_many(c, 2, 10, 1)) == 20  # the parent's loop made its waker
        out = fork_ctx.Queue()
        child = fork_ctx.Process(target=_forked_child, args=(c, out))
        child.start()
        assert out.get(timeout=BOUND_S * 2) == (80, True, 0)
        child.join(BOUND_S)
        assert child.exitcode == 0
        assert asyncio.run(_many(c, 2, 10, 2)) == 20  # the parent's still answered


def test_asyncio_waiters_of_a_sigkilled_batcher_get_its_usual_error(make_engine, gate):
    # answered in place: a dead batcher's batch fails (BatcherDied), not retried;
    # a batch of negative values is held until the gate opens
    eng = make_engine("wake-kill", backend="helpers:holds_on_negative",
                      backend_args={"gate": gate.name, "fixed_ms": 1.0})
    [pid] = eng.stats()["batcher_pids"]

    def kill_when_held():
        wait_for(lambda: eng.stats()["slots_in_use"] == 6 and eng.stats()["queue_depth"] < 6,
                 "a batch claimed, held by the gate", BOUND_S)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: eng.stats()["batcher_restarts_total"] == 1, "the dead batcher reaped",
                 BOUND_S)
        for _ in range(6):  # the successor's batches of those still queued pass
            gate.open()

    with engine.Client(eng.name) as c:
        async def main():
            killer = asyncio.get_running_loop().run_in_executor(None, kill_when_held)
            calls = [c.infer_async(-X - k, timeout=BOUND_S) for k in range(6)]
            got = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), BOUND_S)
            await killer
            return got
        got = asyncio.run(main())
        died = [e for e in got if isinstance(e, engine.BackendError) and e.exc_type == "BatcherDied"]
        answered = [k for k, y in enumerate(got) if isinstance(y, np.ndarray)
                    and np.array_equal(y, (-X - k) * 2 + 1)]
        assert died and len(died) + len(answered) == 6, got
        assert not completer_threads()


def in_flight(eng, c, n: int):
    """(a new event loop, its n infer_async tasks), run until all n are in the engine."""
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(c.infer_async(X + k, timeout=BOUND_S)) for k in range(n)]

    async def until_all_sent():
        for _ in range(int(BOUND_S * 1000)):
            if eng.stats()["slots_in_use"] == n:
                return
            await asyncio.sleep(0.001)
    loop.run_until_complete(until_all_sent())
    assert eng.stats()["slots_in_use"] == n, f"not all {n} requests reached the engine"
    return loop, tasks


def test_a_closed_loop_with_requests_in_flight_never_holds_a_batcher_up(make_engine, gate):
    # one request a batch: a wake each, more than a datagram socket queues unread
    eng = make_engine("wake-closed", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=1)
    with engine.Client(eng.name) as c, engine.Client(eng.name) as other:
        loop, tasks = in_flight(eng, c, 32)
        loop.close()  # its 32 requests still in flight, its socket never read again
        gate.open()
        for k in range(64):  # another client's requests, after those 32 batches
            assert np.array_equal(other.infer(X - k, timeout=BOUND_S), (X - k) * 2 + 1)
        # the next loop of the process hands the closed one's requests back
        assert np.array_equal(asyncio.run(c.infer_async(X, timeout=BOUND_S)), X * 2 + 1)
        assert wait_until_no_slot_in_use(eng, BOUND_S)


def test_a_stuck_loop_never_holds_a_batcher_up(make_engine, gate):
    eng = make_engine("wake-stuck", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=1)
    with engine.Client(eng.name) as c, engine.Client(eng.name) as other:
        loop, tasks = in_flight(eng, c, 32)
        gate.open()  # 32 answers, each a wake for a loop that does not run now
        for k in range(64):
            assert np.array_equal(other.infer(X - k, timeout=BOUND_S), (X - k) * 2 + 1)
        # run again, the loop gets every answer
        got = loop.run_until_complete(asyncio.wait_for(asyncio.gather(*tasks), BOUND_S))
        loop.close()
        assert all(np.array_equal(y, (X + k) * 2 + 1) for k, y in enumerate(got))


def test_a_loop_the_engine_cannot_reach_is_served_by_the_completion_thread(affine_engine,
                                                                           monkeypatch):
    monkeypatch.setattr(wakes, "_netns", -1)  # as if in another network namespace
    with engine.Client(affine_engine.name) as c:
        async def main():
            assert wakes.for_loop(c.attached) is None
            return await _many(c, 4, 10, 3), len(completer_threads())
        assert asyncio.run(main()) == (40, 1)


def test_loops_made_one_after_another_keep_getting_wakes(affine_engine):
    # a loop's number is free again once it closed: past MAX_LOOPS of them, still a waker
    with engine.Client(affine_engine.name) as c:
        async def one():
            await c.infer_async(X, timeout=BOUND_S)
            return wakes.for_loop(c.attached)
        for _ in range(wakes.MAX_LOOPS + 8):
            waker = asyncio.run(one())
        assert waker is not None
        assert not completer_threads()


@pytest.fixture
def untraced(monkeypatch):
    """No tracing loaded (an earlier test may have): a span to record takes the general path."""
    monkeypatch.delitem(sys.modules, tracing.TRACE_MODULE, raising=False)


def test_an_answer_already_in_its_slot_is_taken_by_the_first_look(affine_engine, untraced):
    with engine.Client(affine_engine.name) as c:
        seg, slot, gen, _ = c._enqueue(X + 5, ticket.deadline_ns(BOUND_S))
        # answered, and left in the slot
        assert seg.ring.wait_slot(slot, gen, int(BOUND_S * 1e9), 0) == codes.OK
        assert np.array_equal(looks.answered(c, seg, slot, gen), (X + 5) * 2 + 1)
        assert wait_until_no_slot_in_use(affine_engine)  # taken: its slot is free again


def test_a_look_that_finds_nothing_stops_the_spin_and_the_loop_still_answers(make_engine,
                                                                             untraced):
    eng = make_engine("slowlook", backend="helpers:slow_affine", backend_args={"fixed_ms": 20.0})
    with engine.Client(eng.name) as c:
        async def two():  # the first makes the loop's Waker; the second looks first
            return [await c.infer_async(X + k, timeout=BOUND_S) for k in range(2)]
        ys = asyncio.run(asyncio.wait_for(two(), BOUND_S))
        assert all(np.array_equal(y, (X + k) * 2 + 1) for k, y in enumerate(ys))
        assert c.async_spin_ns == 0  # 20 ms is no answer "soon": the next look does not spin


def test_a_failed_request_is_raised_by_the_first_look(make_engine, untraced):
    eng = make_engine("faillook", backend="helpers:failing")
    with engine.Client(eng.name) as c:
        seg, slot, gen, _ = c._enqueue(X - 100, ticket.deadline_ns(BOUND_S))  # negative: raises
        assert seg.ring.wait_slot(slot, gen, int(BOUND_S * 1e9), 0) == codes.EFAILED
        with pytest.raises(engine.BackendError):
            looks.answered(c, seg, slot, gen)
        assert wait_until_no_slot_in_use(eng)


def test_a_batcher_is_counted_asleep_while_idle_and_awake_while_it_serves(make_engine, gate):
    # the hint a lone asyncio caller reads before it looks long at its answer
    eng = make_engine("asleep", backend="helpers:gated", backend_args={"gate": gate.name})
    with engine.Client(eng.name) as c:
        r = c.attached.ring  # attached at once: the engine runs
        wait_for(lambda: r.batchers_sleeping() == 1, "the idle batcher asleep", BOUND_S)
        held = c.submit(X, timeout=BOUND_S)  # its batch waits at the gate: awake
        wait_for(lambda: r.batchers_sleeping() == 0, "the batcher awake", BOUND_S)
        gate.open()
        assert np.array_equal(held.result(BOUND_S), X * 2 + 1)
        wait_for(lambda: r.batchers_sleeping() == 1, "asleep again once idle", BOUND_S)


class _Hints:
    """A ring's hint as lone_look_pays reads it."""

    def __init__(self, sleeping: int) -> None:
        self.sleeping = sleeping

    def batchers_sleeping(self) -> int:
        return self.sleeping


@pytest.mark.parametrize("sleeping, pays", [(0, True), (1, False), (2, False)])
def test_a_lone_caller_looks_long_only_while_no_batcher_sleeps(sleeping, pays):
    class Seg:
        ring = _Hints(sleeping)
    assert looks.lone_look_pays(Seg()) is pays


def test_lone_looks_back_off_on_misses_and_come_back_on_a_find():
    lone = looks.LoneLooks()
    taken = []
    for hit in [False] * 9 + [True]:
        while not lone.due():
            taken.append(0)
        taken.append(1)
        lone.found(hit)
    # each miss skips twice as many chances as the last (capped), a find resets
    assert taken == [1, 0, 1, 0, 0, 1] + [0] * 4 + [1] + [0] * 8 + [1] + [0] * 16 + [1] + \
        [0] * 32 + [1] + [0] * 64 + [1] + [0] * 64 + [1] + [0] * 64 + [1]
    assert (lone.skip, lone.backoff) == (0, 1) and lone.due()
    assert looks.LONE_BACKOFF_MAX == 64


@pytest.fixture
def lone_seen(monkeypatch, untraced):
    """The `lone` of every look answer_of makes, with the batcher taken to be awake
    and the looks' spins those of a machine of 2+ CPUs (on one, nothing spins)."""
    seen = []
    real = looks.answered
    monkeypatch.setattr(looks, "ASYNC_SPIN_NS", 2_000)  # a Client made now starts with it
    monkeypatch.setattr(looks, "ASYNC_LONE_SPIN_NS", 20_000)

    def answered(client, seg, slot, gen, lone=False):
        seen.append(lone)
        return real(client, seg, slot, gen, lone)
    monkeypatch.setattr(looks, "answered", answered)
    monkeypatch.setattr(looks, "lone_look_pays", lambda seg: True)
    return seen


@pytest.mark.parametrize("busy_ns, lone", [(0, True), (10**15, False)])
def test_a_caller_alone_on_an_idle_loop_looks_long_and_on_a_busy_one_does_not(
        affine_engine, lone_seen, monkeypatch, busy_ns, lone):
    with engine.Client(affine_engine.name) as c:
        async def two():
            await c.infer_async(X, timeout=BOUND_S)  # makes the loop's Waker: no look
            monkeypatch.setattr(looks, "LOOP_BUSY_NS", busy_ns)  # an answer "just" came, or not
            return await c.infer_async(X + 1, timeout=BOUND_S)
        y = asyncio.run(asyncio.wait_for(two(), BOUND_S))
    assert np.array_equal(y, (X + 1) * 2 + 1) and lone_seen == [lone]


def test_a_caller_whose_loop_awaits_another_answer_does_not_look_long(make_engine, gate,
                                                                      lone_seen, monkeypatch):
    eng = make_engine("sharedlook", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=1)
    monkeypatch.setattr(looks, "LOOP_BUSY_NS", 0)
    with engine.Client(eng.name) as c:
        async def main():
            held = asyncio.ensure_future(c.infer_async(X, timeout=BOUND_S))  # at the gate
            await asyncio.sleep(0)  # enqueued, pending on the loop's Waker
            wait_for(lambda: eng.stats()["queue_depth"] == 0, "the first request claimed")
            second = asyncio.ensure_future(c.infer_async(X + 1, timeout=BOUND_S))
            await asyncio.sleep(0)  # its look, with the first still pending
            gate.open()
            return await asyncio.wait_for(asyncio.gather(held, second), BOUND_S)
        ys = asyncio.run(main())
    assert all(np.array_equal(y, (X + k) * 2 + 1) for k, y in enumerate(ys))
    assert lone_seen == [False]  # the first made the Waker; the second was not alone
