"""Iterative engines under asyncio: Client.stream_async streams run
concurrently, each with its own chunks; leaving one early withdraws its
request; one past its timeout raises after the chunks that came in time;
and closing the client ends them with EngineUnavailable; the loop is never
blocked waiting for a stream's slot to settle after its last chunk.
"""
import asyncio
import threading

import pytest
from conftest import wait_for, wait_until_no_slot_in_use
from iterative_helpers import (
    assert_each_joined_request_left_once,
    bits,
    left,
    scripted,
    slot_states,
    tag_length,
    wait_idle,
    wait_held,
    wait_left,
)
from step_models import HOLD, HOLD_LEAVE, chunks, request

import engine
from engine.client import ticket, wakes
from engine.shm import codes, ring


def test_async_streams_run_concurrently_each_with_its_own_chunks(make_engine, log):
    eng = scripted(make_engine, "async", log, max_steps=24, max_batch_size=8)

    async def read(c, tag):
        return [int(chunk) async for chunk in c.stream_async(request(tag, tag_length(tag)),
                                                             timeout=60)]

    async def main(c):
        streamed = asyncio.gather(*(read(c, tag) for tag in range(1, 13)))
        whole = asyncio.gather(*(c.infer_async(request(tag, tag_length(tag)), timeout=60)
                                 for tag in range(13, 17)))
        return await streamed, await whole

    with engine.Client(eng.name) as c:
        streamed, whole = asyncio.run(main(c))
    for tag, got in zip(range(1, 13), streamed):
        assert got == chunks(tag, tag_length(tag)), tag
    for tag, y in zip(range(13, 17), whole):
        assert y.tolist() == chunks(tag, tag_length(tag)), tag
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
        await until(lambda: codes.ABANDONED in slot_states(eng), "the request withdrawn")
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


@pytest.mark.parametrize("waker", ["the loop's", "the completion thread"])
def test_a_deadline_that_passes_while_chunks_wait_unread_still_ends_the_stream(
        make_engine, log, gate, waker, monkeypatch):
    # the loop is held until the deadline has passed with two chunks unread: its next
    # pass hands over the chunks and the deadline's error together, and the error is
    # what the wait after the chunks returns for (nothing else would wake it)
    if waker == "the completion thread":
        monkeypatch.setattr(wakes, "for_loop", lambda seg: None)
    eng = scripted(make_engine, "async-late", log, gate=gate)

    async def main(c):
        stream = c.open_stream_async(request(1, 10, HOLD, bits(2)), timeout=1.0)
        wait_held(log, 1, 2)  # chunks 0 and 1 are out: the loop has not seen them
        wait_for(lambda: ring.now_ns() >= stream.deadline, "the deadline passed", 30)
        try:
            await asyncio.wait_for(stream.wait(), 30)
            got = [int(v) for v in stream.ready()]
            await asyncio.wait_for(stream.wait(), 30)
            with pytest.raises(engine.RequestTimeout):
                stream.ready()
            return got
        finally:
            await stream.aclose()

    with engine.Client(eng.name) as c:
        assert asyncio.run(main(c)) == chunks(1, 2)
        gate.open()
        assert wait_left(log, 1) == [3]
    assert_each_joined_request_left_once(log)


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


@pytest.mark.parametrize("waker", ["the loop's", "the completion thread"])
def test_the_loop_runs_on_while_a_stream_waits_for_its_slot_to_settle(make_engine, log, gate,
                                                                       waker, monkeypatch):
    # the model's leave holds the settle after the last chunk until the gate opens:
    # the loop that read that chunk must be free to open it (a thread does, late,
    # if the loop is blocked: then the loop is not who opened it); no liveness tick
    # comes while the test runs, so the settle's own wake is what ends the stream
    monkeypatch.setattr(ticket, "LIVENESS_SLICE_NS", 600 * 10**9)
    if waker == "the completion thread":
        monkeypatch.setattr(wakes, "for_loop", lambda seg: None)
    eng = scripted(make_engine, "async-settle", log, gate=gate)
    opened_by = []

    def late() -> None:
        if not opened_by:
            opened_by.append("a thread")
            gate.open()

    async def main(c):
        got = []
        stream = c.stream_async(request(1, 3, HOLD_LEAVE), timeout=60)

        async def opener():
            while len(got) < 3:  # the last chunk is read: the slot settles after the leave
                await asyncio.sleep(0.001)
            if not opened_by:
                opened_by.append("the loop")
                gate.open()

        task = asyncio.ensure_future(opener())
        async for chunk in stream:
            got.append(int(chunk))
        await task
        return got

    timer = threading.Timer(10, late)
    timer.start()
    try:
        with engine.Client(eng.name) as c:
            got = asyncio.run(asyncio.wait_for(main(c), 30))
            c.attached.ring.wake_done()  # a completion thread asleep for the long slice closes now
    finally:
        timer.cancel()
    assert got == chunks(1, 3) and opened_by == ["the loop"]
    assert_each_joined_request_left_once(log)

