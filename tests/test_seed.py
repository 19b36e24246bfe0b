"""The default bench scenario across processes: 4 open-loop Poisson client processes
against the synthetic backend (2 ms + 100 us per item), 1500 req/s in all,
1600 requests, driven by the benchmark's own load generator. Its asserts on
answers, counts and batch sizes hold on any machine; its queue-wait bound is
a figure of `shmbatch bench`."""
import pytest

from engine.tools import bench, load

FIXED_MS, PER_ITEM_US = 2.0, 100.0
LOAD = load.Load(backend_args={"fixed_ms": FIXED_MS, "per_item_us": PER_ITEM_US},
                  clients=4, rate=1500.0, requests=1600)


@pytest.mark.parametrize("max_batch, max_delay_ms", [(32, 0.0), (8, 1.0), (32, 2.0)])
def test_every_request_answered_once_or_refused_and_no_batch_too_big(max_batch, max_delay_ms):
    row = bench.run_row(max_batch, max_delay_ms, LOAD)
    # each request answered exactly once with its own correct output -- or, on a
    # machine too loaded to keep up, refused or timed out with a typed error
    assert (row["wrong"], row["lost"], row["errors"]) == (0, 0, 0)
    assert row["answered"] + row["rejected"] + row["timeouts"] == 1600
    # the engine's own counts agree: every accepted request reached it, and each
    # answer it delivered was received
    assert row["engine_requests"] == 1600 - row["rejected"]
    assert row["engine_answered"] == row["answered"]
    # no batch above max_batch_size
    assert 1 <= row["largest_batch"] <= max_batch
    # (how long requests wait is measured by `shmbatch bench`, not asserted here:
    # it depends on the machine and its load)
