"""Iterative engines: each stream's chunks come in step order, exactly once,
whichever client process or thread reads them; a short request ends while a
long one runs; and every request that joins a running batch is left exactly
once, by the batcher it joined, whether it finishes, is left early, dropped
or runs past its deadline.
"""
import collections
import threading

from iterative_helpers import (
    assert_each_joined_request_left_once,
    bits,
    ints,
    left,
    scripted,
    tag_length,
    wait_held,
    wait_idle,
)
from step_models import HOLD, chunks, request

import engine


def _own_max_steps(tag):
    return 1 + tag % 10 if tag % 3 == 0 else None


def _read_round_robin(name, client_id, out):
    """Two threads of one Client, each with six streams open at once, read a
    chunk of each in turn; reports every chunk, by tag."""
    got, errors = {}, []
    with engine.Client(name) as c:
        def run(thread):
            tags = [client_id * 100 + thread * 10 + j for j in range(6)]
            live = {t: c.stream(request(t, tag_length(t)), timeout=60, max_steps=_own_max_steps(t))
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
        steps = min(tag_length(tag), _own_max_steps(tag) or 24)
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
