"""The seed's three asserts, across processes: 4 open-loop Poisson clients
against the synthetic backend (2 ms + 100 us per item), 1500 req/s in all."""
import numpy as np
import pytest

from helpers import open_loop_client

FIXED_MS, PER_ITEM_US, RATE, REQUESTS, CLIENTS = 2.0, 100.0, 1500.0, 1600, 4


@pytest.mark.parametrize("max_batch, max_delay_ms", [(32, 0.0), (8, 1.0), (32, 2.0)])
def test_every_request_answered_once_no_batch_too_big_queue_wait_bounded(
        make_engine, fork_ctx, max_batch, max_delay_ms):
    eng = make_engine("seed", backend="engine.backends:synthetic",
                      backend_args={"fixed_ms": FIXED_MS, "per_item_us": PER_ITEM_US},
                      max_batch_size=max_batch, max_delay_ms=max_delay_ms)
    out = fork_ctx.Queue()
    per_client = REQUESTS // CLIENTS
    clients = [fork_ctx.Process(target=open_loop_client,
                                args=(eng.name, c, per_client, RATE / CLIENTS, 7 + c, out))
               for c in range(CLIENTS)]
    for p in clients:
        p.start()
    reports = [out.get(timeout=120) for _ in clients]
    for p in clients:
        p.join(10)
    assert [r[1:] for r in sorted(reports)] == [(0, 0, per_client)] * CLIENTS  # right, once each
    stats = eng.stats()
    assert stats["requests_total"] == stats["answered_total"] == REQUESTS
    sizes = stats["batch_size_counts"]
    assert max(sizes) <= max_batch and sum(sizes.values()) == stats["batches_total"]
    service_max_ms = FIXED_MS + max_batch * PER_ITEM_US / 1000
    bound_ms = 2 * (max_delay_ms + service_max_ms + 5.0)  # the seed's bound
    assert stats["queue_wait_ms"]["max"] <= bound_ms
