"""The HTTP front wakes a sleeping batcher as an infer begins to be read
(engine.http.oip.routes.Model.expect), only while no other request of the
worker awaits that engine: a real engine's batcher, asleep on its work word."""
import time

import numpy as np

import engine
from engine.http.oip.routes import Model

QUIET_S = 0.05  # a batcher idle this long is asleep (its idle spin is 50 µs at most)


def test_an_infer_read_while_none_awaits_the_engine_wakes_its_sleeping_batcher(make_engine):
    eng = make_engine("early", input_shape=(4,), output_shape=(4,))
    with engine.Client(eng.name) as client:
        model, r = Model(eng.name, eng.config, client), client.attached.ring
        seen = r.work_seq()
        deadline = time.monotonic() + 10
        while r.work_seq() == seen and time.monotonic() < deadline:
            model.expect()  # the work word moves once the batcher is counted asleep
            time.sleep(0.001)
        assert r.work_seq() != seen


def test_no_wake_while_another_request_of_the_worker_awaits_the_engine(make_engine):
    eng = make_engine("early", input_shape=(4,), output_shape=(4,))
    with engine.Client(eng.name) as client:
        model, r = Model(eng.name, eng.config, client), client.attached.ring
        model.in_flight = 1
        seen = r.work_seq()
        until = time.monotonic() + QUIET_S * 4
        while time.monotonic() < until:
            model.expect()
            time.sleep(0.001)
        assert r.work_seq() == seen
        model.in_flight = 0
        x = np.arange(4, dtype=np.float32)
        assert np.array_equal(client.infer(x, timeout=30), x * 2 + 1)  # and it serves
