"""The client handle: threads, fork, asyncio, several instances, idle, drain."""
import asyncio
import os
import threading
import time

import numpy as np
import psutil
import pytest
from conftest import wait_for

import engine

X = np.arange(16, dtype=np.float32)


def wrong_answers_from_threads(name, threads, per_thread):
    """Sends per_thread requests from each of `threads` threads sharing one client;
    one bool per answer: True when it is not 2x + 1 of its own request."""
    wrong = []
    with engine.Client(name) as c:
        def worker(t):
            for k in range(per_thread):
                x = np.full(16, t * 1000 + k, np.float32)
                wrong.append(not np.array_equal(c.infer(x, timeout=10), x * 2 + 1))
        running = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
        for t in running:
            t.start()
        for t in running:
            t.join(60)
    return wrong


def test_threads_sharing_one_client_each_get_their_own_answers(make_engine):
    eng = make_engine("threads", max_batch_size=8)
    wrong = wrong_answers_from_threads(eng.name, 8, 200)
    assert len(wrong) == 1600 and not any(wrong)


def test_requests_of_threads_sharing_one_client_batch_together(make_engine, gate):
    eng = make_engine("threadsb", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=8)
    opener = threading.Thread(target=lambda: (
        wait_for(lambda: eng.stats()["requests_total"] >= 8, "a request of each thread"),
        gate.open()))
    opener.start()  # the first batch waits until each of the 8 threads has one queued
    wrong = wrong_answers_from_threads(eng.name, 8, 20)
    opener.join(60)
    assert len(wrong) == 160 and not any(wrong)
    assert max(eng.stats()["batch_size_counts"]) > 1


def _child_uses_inherited(client, out):
    try:
        ys = [client.infer(X + 1000 + k, timeout=10) for k in range(50)]
        ys += [f.result(10) for f in [client.submit(X + 2000 + k) for k in range(50)]]
        expect = [(X + 1000 + k) * 2 + 1 for k in range(50)] + [(X + 2000 + k) * 2 + 1 for k in range(50)]
        out.put(all(np.array_equal(a, b) for a, b in zip(ys, expect)))
    except Exception as e:
        out.put(repr(e))


def test_forked_child_uses_an_inherited_client_without_disturbing_the_parent(make_engine, fork_ctx):
    eng = make_engine("fork", backend="helpers:slow_affine", backend_args={"fixed_ms": 2},
                      max_batch_size=8)
    with engine.Client(eng.name) as c:
        parents = [c.submit(X + k, timeout=20) for k in range(40)]  # in flight across the fork
        out = fork_ctx.Queue()
        child = fork_ctx.Process(target=_child_uses_inherited, args=(c, out))
        child.start()
        assert out.get(timeout=60) is True
        child.join(10)
        assert child.exitcode == 0
        for k, f in enumerate(parents):
            assert np.array_equal(f.result(timeout=20), (X + k) * 2 + 1)


def test_infer_async_serves_many_requests_with_no_thread_per_request(make_engine):
    eng = make_engine("async", backend="helpers:slow_affine", backend_args={"fixed_ms": 5},
                      max_batch_size=32)

    async def main(c):
        return await asyncio.gather(*[c.infer_async(X + k, timeout=20) for k in range(200)])

    with engine.Client(eng.name) as c:
        threads_before = threading.active_count()
        ys = asyncio.run(main(c))
        assert threading.active_count() <= threads_before + 1  # the one completer thread
    assert all(np.array_equal(y, (X + k) * 2 + 1) for k, y in enumerate(ys))


def test_two_instances_share_one_queue_and_are_pinned(make_engine):
    cpus = sorted(psutil.Process().cpu_affinity())
    pins = [[cpus[0]], [cpus[-1]]]
    eng = make_engine("inst", backend="helpers:pid_tagged", backend_args={"fixed_ms": 20},
                      instances=2, cpus=pins, max_batch_size=2)
    pids = eng.stats()["batcher_pids"]
    assert len(pids) == 2
    assert sorted(psutil.Process(p).cpu_affinity() for p in pids) == sorted(pins)
    with engine.Client(eng.name) as c:
        answers = [f.result(timeout=30) for f in [c.submit(X, timeout=30) for _ in range(40)]]
    served_by = {int(y[0]) for y in answers}
    assert served_by == set(pids)  # both batchers took work from the one queue


def test_a_pinned_batcher_sizes_its_numeric_thread_pools_to_its_cpus(make_engine, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = sorted(psutil.Process().cpu_affinity())
    pinned = make_engine("pools", backend="helpers:thread_pools", cpus=[cpus[:1]])
    free = make_engine("nopin", backend="helpers:thread_pools")
    with engine.Client(pinned.name) as c, engine.Client(free.name) as d:
        assert (c.infer(X, timeout=30) == 1).all()  # one CPU: one thread a pool
        assert (d.infer(X, timeout=30) == 0).all()  # not pinned: the libraries' own choice


def test_a_thread_pool_size_set_by_the_user_is_kept(make_engine, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    cpus = sorted(psutil.Process().cpu_affinity())
    eng = make_engine("poolset", backend="helpers:thread_pools", cpus=[cpus[:1]])
    with engine.Client(eng.name) as c:
        assert (c.infer(X, timeout=30) == 3).all()


def test_an_idle_engine_does_not_spin(make_engine):
    eng = make_engine("idle", max_delay_ms=5.0)
    with engine.Client(eng.name) as c:
        for k in range(20):
            c.infer(X + k, timeout=10)
    batcher = psutil.Process(eng.stats()["batcher_pids"][0])
    before = sum(batcher.cpu_times()[:2])
    time.sleep(1.0)  # the measured interval itself
    # a spinning batcher burns the whole window, or its share of one core when
    # 4 processes share it (0.25 s); an idle one wakes once a second
    assert sum(batcher.cpu_times()[:2]) - before < 0.1


def test_stop_answers_what_is_queued_then_refuses(make_engine):
    eng = make_engine("drain", backend="helpers:slow_affine", backend_args={"fixed_ms": 20},
                      max_batch_size=4)
    c = engine.Client(eng.name)
    futures = [c.submit(X + k, timeout=30) for k in range(40)]
    eng.stop()
    for k, f in enumerate(futures):
        assert np.array_equal(f.result(timeout=1), (X + k) * 2 + 1)
    with pytest.raises(engine.EngineUnavailable):
        c.infer(X)
    assert not os.path.exists(f"/dev/shm/shmbatch-{eng.name}")
    c.close()


def test_variable_length_inputs_are_zero_padded_to_the_longest_with_lengths(make_engine, gate):
    eng = make_engine("ragged", backend="helpers:gated",
                      backend_args={"gate": gate.name, "then": "masked_sum"},
                      input_shape=(None, 4), max_input_shape=(32, 4), output_shape=(4,),
                      max_batch_size=16)
    rng = np.random.default_rng(1)
    xs = [rng.random((int(n), 4)).astype(np.float32) for n in rng.integers(1, 33, 64)]
    with engine.Client(eng.name) as c:
        futures = [c.submit(x, timeout=30) for x in xs]
        gate.open()  # the first batch held until all are queued: the rest batch together
        ys = [f.result(timeout=30) for f in futures]
    for x, y in zip(xs, ys):
        np.testing.assert_allclose(y, x.sum(axis=0), rtol=1e-5)
    assert max(eng.stats()["batch_size_counts"]) > 1


def test_a_plain_asgi_app_serves_concurrent_requests_through_infer_async(make_engine):
    eng = make_engine("asgi", backend="helpers:slow_affine", backend_args={"fixed_ms": 5},
                      max_batch_size=32)
    client = engine.Client(eng.name)

    async def app(scope, receive, send):  # an ASGI app, as uvicorn would call it
        body = (await receive())["body"]
        y = await client.infer_async(np.frombuffer(body, np.float32), timeout=20)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": y.tobytes()})

    async def request(k):
        sent = []

        async def receive():
            return {"type": "http.request", "body": (X + k).tobytes(), "more_body": False}

        async def send(message):
            sent.append(message)
        await app({"type": "http", "method": "POST", "path": "/"}, receive, send)
        return sent[0]["status"], np.frombuffer(sent[1]["body"], np.float32)

    async def main():
        return await asyncio.gather(*[request(k) for k in range(300)])

    threads_before = threading.active_count()
    responses = asyncio.run(main())
    assert threading.active_count() <= threads_before + 1  # one completer, no thread per request
    client.close()
    for k, (status, y) in enumerate(responses):
        assert status == 200 and np.array_equal(y, (X + k) * 2 + 1)


def _many_in_child(name, cid, out):
    with engine.Client(name) as c:
        wrong = 0
        for k in range(20):
            xs = (np.arange(300 * 16, dtype=np.float32).reshape(300, 16) + cid * 1e5 + k * 1e3)
            wrong += not np.array_equal(c.infer_many(xs, timeout=20), xs * 2 + 1)
        out.put(wrong)


def test_infer_many_from_several_processes_returns_each_its_own_answers(make_engine, fork_ctx):
    eng = make_engine("many", max_batch_size=32, queue_capacity=1024)
    out = fork_ctx.Queue()
    procs = [fork_ctx.Process(target=_many_in_child, args=(eng.name, i, out)) for i in range(3)]
    for p in procs:
        p.start()
    assert [out.get(timeout=60) for _ in procs] == [0, 0, 0]
    for p in procs:
        p.join(10)
    stats = eng.stats()
    assert stats["answered_total"] == 3 * 20 * 300 and stats["slots_in_use"] == 0


def test_infer_many_of_more_than_the_queue_holds_goes_in_chunks(make_engine):
    eng = make_engine("chunks", max_batch_size=8, queue_capacity=16)
    xs = np.arange(100 * 16, dtype=np.float32).reshape(100, 16)
    with engine.Client(eng.name) as c:
        assert np.array_equal(c.infer_many(xs, timeout=20), xs * 2 + 1)
    assert eng.stats()["answered_total"] == 100


def test_infer_many_validates_first_and_fails_whole_on_a_backend_error(make_engine):
    eng = make_engine("manyerr", backend="helpers:failing", max_batch_size=4)
    with engine.Client(eng.name) as c:
        with pytest.raises(engine.InvalidInput, match=r"each float32\[16\], got float32\[5, 15\]"):
            c.infer_many(np.zeros((5, 15), np.float32))
        xs = np.ones((10, 16), np.float32)
        xs[7] = -1
        with pytest.raises(engine.BackendError, match="negative input"):
            c.infer_many(xs, timeout=10)
        assert np.array_equal(c.infer_many(xs[:4], timeout=10), xs[:4] * 2 + 1)
    assert eng.stats()["slots_in_use"] == 0


def test_infer_many_of_variable_length_inputs_pads_them(make_engine):
    eng = make_engine("manyvar", backend="helpers:masked_sum", input_shape=(None, 4),
                      max_input_shape=(8, 4), output_shape=(4,))
    xs = np.random.default_rng(2).random((20, 5, 4)).astype(np.float32)
    with engine.Client(eng.name) as c:
        np.testing.assert_allclose(c.infer_many(xs, timeout=10), xs.sum(axis=1), rtol=1e-5)


def test_a_backend_answering_in_place_serves_every_request_its_own_answer(make_engine):
    eng = make_engine("inplace", backend="helpers:in_place_affine", max_batch_size=16)
    wrong = wrong_answers_from_threads(eng.name, 4, 100)
    assert len(wrong) == 400 and not any(wrong)
    assert eng.segment.in_place and eng.stats()["zero_copy_batches"] > 0
