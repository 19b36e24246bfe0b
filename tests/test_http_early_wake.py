"""The HTTP front wakes a sleeping batcher as an infer begins to be read
(engine.http.oip.routes.Model.expect): a real engine's batcher, asleep on its
work word, is woken; no wake while another request of the worker awaits that
engine, nor for a batcher that does not spin; the count of requests awaiting
the engine follows every way an infer ends."""
import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

import engine
from engine.config import EngineConfig
from engine.errors import QueueFull
from engine.http.oip.routes import Model


class Recorder:
    """A ring that counts the hints it is given."""

    def __init__(self) -> None:
        self.hints = 0

    def expect_work(self) -> None:
        self.hints += 1


class Stub:
    """A client attached to a Recorder ring, whose infer_async waits on `gate`."""

    def __init__(self) -> None:
        self.attached = SimpleNamespace(ring=Recorder())
        self.gate: "asyncio.Future | None" = None

    async def infer_async(self, x, timeout, priority=0):
        self.gate = asyncio.get_running_loop().create_future()
        return await self.gate


def stub_model(**knobs) -> Model:
    config = EngineConfig(name="early", input_shape=(4,), output_shape=(4,), **knobs)
    return Model("early", config, Stub())


def test_an_infer_read_while_none_awaits_the_engine_wakes_its_sleeping_batcher(make_engine):
    # a batcher that spins (on one CPU none does by default, and none is woken early)
    eng = make_engine("early", input_shape=(4,), output_shape=(4,), idle_spin_us=50)
    with engine.Client(eng.name) as client:
        model, r = Model(eng.name, eng.config, client), client.attached.ring
        seen = r.work_seq()
        deadline = time.monotonic() + 10
        while r.work_seq() == seen and time.monotonic() < deadline:
            model.expect()  # the work word moves once the batcher is counted asleep
            time.sleep(0.001)
        assert r.work_seq() != seen
        x = np.arange(4, dtype=np.float32)
        assert np.array_equal(client.infer(x, timeout=30), x * 2 + 1)  # and it serves


def test_no_wake_while_another_request_of_the_worker_awaits_the_engine():
    model = stub_model(idle_spin_us=50)
    ring = model.client.attached.ring
    model.in_flight = 1
    model.expect()
    assert ring.hints == 0
    model.in_flight = 0
    model.expect()
    assert ring.hints == 1


def test_no_wake_for_a_batcher_that_never_spins():
    model = stub_model(idle_spin_us=0)  # woken early, it would sleep again at once
    model.expect()
    assert model.client.attached.ring.hints == 0


@pytest.mark.parametrize("end", ["answered", "refused", "cancelled"])
def test_the_count_awaiting_the_engine_falls_back_however_the_infer_ends(end):
    model = stub_model()
    row = np.zeros((1, 4), np.float32)

    async def run():
        task = asyncio.ensure_future(model.infer([row], 1, 5.0, 0))
        while model.client.gate is None:  # the infer reached the engine
            await asyncio.sleep(0)
        assert model.in_flight == 1
        if end == "answered":
            model.client.gate.set_result(row[0])
        elif end == "refused":
            model.client.gate.set_exception(QueueFull("full"))
        else:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return model.in_flight

    assert asyncio.run(asyncio.wait_for(run(), 10)) == 0
