"""The adaptive batch limit (AIMD) and the service-time fit it and admission
read: the limit grows by one and is cut on a miss; the fit recovers a linear
cost model, skips its warm-up and is not locked up by one stalled batch."""
import pytest

from engine.batching import admission, aimd

MS = 1_000_000


def test_the_batch_limit_grows_by_one_and_is_cut_on_a_miss():
    slo = 10 * MS
    assert aimd.next_limit(4, 2 * MS, slo, 32) == 5
    assert aimd.next_limit(32, 2 * MS, slo, 32) == 32  # never above max_batch_size
    assert aimd.next_limit(8, 11 * MS, slo, 32) == 6
    assert aimd.next_limit(1, 50 * MS, slo, 32) == 1  # never below 1
    assert aimd.next_limit(8, int(9.5 * MS), slo, 32) == 8  # within, but near: hold


def test_the_batch_limit_follows_a_model_that_slows_down_and_recovers():
    # service = 1 ms + 0.5 ms per item while fast; 1 ms + 2 ms per item from batch 40 to 80
    limits, missed, limit = [], [], 1
    for k in range(120):
        per_item = 2.0 if 40 <= k < 80 else 0.5
        latency = int((1 + per_item * limit) * MS)
        missed.append(latency > 10 * MS)
        limit = aimd.next_limit(limit, latency, 10 * MS, 32)
        limits.append(limit)
    assert limits[39] == 17  # grew by one a batch to the largest within 10 ms: 1 + 0.5 n <= 9
    # slowed: cut at once, then a sawtooth around the largest n within (1 + 2 n <= 10: 4)
    assert limits[40] < limits[39] and max(limits[50:80]) <= 5
    assert sum(missed[50:80]) <= 10  # at most one batch in three over the objective
    assert limits[-1] == 17  # and back


def test_the_service_fit_recovers_a_linear_cost_model():
    fit = admission.ServiceFit()
    for n in [1, 2, 4, 8, 16, 32] * 5:
        fit.add(n, int(2 * MS + n * 100_000))
    fixed_ns, per_item_ns = fit.estimate()
    assert fixed_ns == pytest.approx(2 * MS, rel=1e-6)
    assert per_item_ns == pytest.approx(100_000, rel=1e-6)


def test_the_service_fit_skips_its_warm_up_batches():
    fit = admission.ServiceFit(warmup=1)
    assert not fit.add(1, 30_000 * MS) and fit.batches == 0  # a first call's compile: ignored
    assert fit.add(4, 2 * MS) and fit.estimate() == (2 * MS, 0.0)  # one size: all fixed


def test_one_stalled_batch_cannot_lock_the_fit_up():
    fit = admission.ServiceFit()
    for n in [1, 2, 4, 8] * 5:
        fit.add(n, int(2 * MS + n * 100_000))
    fit.add(4, 30_000 * MS)  # a 30 s recompile
    for n in [1, 2, 4]:  # up to the next solve of the fit (every REFIT batches)
        fit.add(n, int(2 * MS + n * 100_000))
    assert fit.batches % admission.REFIT == 0
    fixed_ns, per_item_ns = fit.estimate()
    assert fixed_ns + 4 * per_item_ns < 4 * (2.4 * MS)  # bounded by OUTLIER x the prediction
