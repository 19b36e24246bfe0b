"""Admission's figures are trusted only once measured, and correct themselves
by the waits they predicted: a shape's first batch is no measure, the fit
is published once calibrated, and an admitted prediction is compared with
the wait its request saw, which sets the factor every prediction is
multiplied by (within its bounds)."""
import os

import numpy as np
from conftest import raw_segment

from engine.batching import admission
from engine.serving import metrics
from engine.shm import codes, ring

MS = 1_000_000


def test_the_first_batch_of_each_shape_feeds_no_fit():
    fit = admission.ServiceFit()
    assert fit.measuring((0, 8)) == ring.NO_FIT  # a lazy initialisation, not a measure
    assert fit.measuring((0, 8)) == fit.c_fit
    assert fit.measuring((1, 8)) == ring.NO_FIT  # another length bucket: another shape
    assert fit.measuring((0, 4)) == ring.NO_FIT


def _finish(seg, fit, value: int, service_ns: int) -> int:
    """One request through a batch of one that took service_ns, fed to fit."""
    r = seg.ring
    _, slot, gen = r.submit(os.getpid(), 0, np.full(4, value, np.float32), 0)
    b = ring.ClaimBuffers(seg.capacity, 8)
    n, claim_ns, *_ = r.claim(0, 8, 1, ring.MAX_NS, b)
    assert n == 1
    r.complete(0, b, n)
    solved = r.finish_batch(b, n, claim_ns, claim_ns + service_ns, True, fit.c_fit)
    assert r.release_slot(slot, gen) == codes.OK
    return solved


def test_the_fit_is_published_only_once_calibrated():
    with raw_segment("calibrate", queue_capacity=8, max_batch_size=8) as seg:
        fit = admission.ServiceFit()
        for k in range(codes.FIT_CALIBRATED - 1):
            assert not _finish(seg, fit, k, 100 * MS)
            # no figures: no prediction, so nothing is refused yet
            assert seg.ring.word(codes.W_FIT_FIXED_NS) == 0
        assert _finish(seg, fit, 99, 100 * MS)
        assert seg.ring.word(codes.W_FIT_FIXED_NS) == 100 * MS


def _admit_busy(seg, deadline_in_ns: int) -> int:
    """Admits and publishes one request while batcher 0 is busy (so the
    prediction counts the queue); returns its uncorrected predicted wait (ns)."""
    r = seg.ring
    now = ring.now_ns()
    seg.mark_batch(0, now)  # the batch in service has just started
    code, _ = r.admit(0, now + deadline_in_ns)
    assert code == codes.OK
    _, slot, gen = r.acquire(os.getpid(), 0)
    assert r.publish(slot, gen, 0, now + deadline_in_ns, 0) == codes.OK
    return slot


def _serve_after(seg, waited_ns: int) -> None:
    """Answers the one queued request as if it waited waited_ns from its arrival."""
    r = seg.ring
    b = ring.ClaimBuffers(seg.capacity, 8)
    n, claim_ns, _, oldest_ns, _ = r.claim(0, 8, 1, ring.MAX_NS, b)
    assert n == 1
    r.complete(0, b, n)
    r.finish_batch(b, n, claim_ns, oldest_ns + waited_ns, True)
    seg.mark_batch(0, 0)


def _engine_figures(seg, fixed_ns: int) -> None:
    seg.ring.set_word(codes.W_INSTANCES, 1)
    seg.ring.set_word(codes.W_FIT_FIXED_NS, fixed_ns)  # a calibrated fit, as published
    seg.ring.set_word(codes.W_FIT_ITEM_PS, 0)


def test_predictions_that_came_out_short_are_corrected_upward():
    with raw_segment("short", queue_capacity=64, max_batch_size=1) as seg:
        _engine_figures(seg, 10 * MS)
        before = seg.ring.predicted_wait_ns(0, ring.now_ns())
        _admit_busy(seg, 500 * MS)  # a full queue would not fit 500 ms: the queue is counted
        _serve_after(seg, 200 * MS)  # predicted about 20 ms, waited 200
        figures = metrics.admission_stats(seg.ring)
        assert figures["compared_total"] == 1 and figures["late_total"] == 1
        assert figures["seen_ms_mean"] > 5 * figures["predicted_ms_mean"]
        assert figures["correction"] == codes.SCALE_MAX  # as far as its bound
        seg.mark_batch(0, ring.now_ns())
        assert seg.ring.predicted_wait_ns(0, ring.now_ns()) > 2 * before


def test_predictions_that_came_out_long_are_corrected_downward():
    with raw_segment("long", queue_capacity=64, max_batch_size=1) as seg:
        _engine_figures(seg, 10 * MS)
        _admit_busy(seg, 500 * MS)
        _serve_after(seg, MS)  # predicted about 20 ms, waited 1
        figures = metrics.admission_stats(seg.ring)
        assert figures["compared_total"] == 1 and figures["late_total"] == 0
        assert figures["correction"] == 1 / codes.SCALE_MIN_INV  # as far as its bound
        seg.mark_batch(0, ring.now_ns())
        assert seg.ring.predicted_wait_ns(0, ring.now_ns()) < 10 * MS  # was 20 ms


def test_a_prediction_not_counted_is_not_compared():
    # a deadline that even a full queue would meet: the queue is not counted (the
    # fast path), so there is no prediction to judge
    with raw_segment("uncounted", queue_capacity=64, max_batch_size=1) as seg:
        _engine_figures(seg, 10 * MS)
        _admit_busy(seg, 60_000 * MS)
        _serve_after(seg, 200 * MS)
        figures = metrics.admission_stats(seg.ring)
        assert figures["compared_total"] == 0 and figures["correction"] == 1.0


def test_a_correction_read_from_the_segment_is_bounded():
    with raw_segment("bounded", queue_capacity=64, max_batch_size=1) as seg:
        _engine_figures(seg, 10 * MS)
        seg.mark_batch(0, ring.now_ns())
        seg.ring.set_word(codes.W_ADMIT_SCALE, 2**63)  # another process wrote it
        wait = seg.ring.predicted_wait_ns(0, ring.now_ns())
        assert 0 < wait <= codes.SCALE_MAX * 20 * MS


def test_the_log_says_what_admission_refused_at_most_once_a_period(caplog):
    from engine import logfmt
    from engine.serving import admission_log
    with raw_segment("log", queue_capacity=8, max_batch_size=8) as seg:
        r = seg.ring
        said = admission_log.AdmissionLog("log", r, now_ns=0)
        r.add_word(codes.W_OVERLOADED, 7)
        r.add_word(codes.W_REQUESTS, 93)
        assert said.tick(admission_log.PERIOD_NS - 1) is None  # not before the period ends
        with caplog.at_level("WARNING", logger="shmbatch"):
            line = said.tick(admission_log.PERIOD_NS)
        assert "admission refused 7 of 100 requests" in line and line in caplog.text
        assert logfmt.engine_of(caplog.records[-1]) == "log"  # a JSON log's engine field
        assert said.tick(3 * admission_log.PERIOD_NS) is None  # nothing refused since


def test_status_tells_admission_refusals_from_a_full_engine():
    from engine.cli.commands import admission_text
    cold = {"refused_total": 0, "calibrated": False, "compared_total": 0, "late_total": 0,
            "predicted_ms_mean": 0.0, "seen_ms_mean": 0.0, "correction": 1.0}
    assert "not calibrated yet (refuses nothing" in admission_text(cold)
    judged = dict(cold, refused_total=12, calibrated=True, compared_total=200, late_total=50,
                  predicted_ms_mean=40.0, seen_ms_mean=30.0, correction=0.75)
    assert admission_text(judged) == (
        "12 refused; of 200 admitted on a counted prediction, waits predicted 40.0 ms and seen "
        "30.0 ms on average, 25 % longer than predicted; predictions corrected x0.75")


def test_a_request_admitted_that_expires_unstarted_counts_as_waiting_past_its_deadline():
    # left out, only the requests that made it would judge the predictions, and
    # the correction would admit ever more
    from conftest import wait_for
    with raw_segment("expires", queue_capacity=64, max_batch_size=1) as seg:
        _engine_figures(seg, 10 * MS)
        _admit_busy(seg, 30 * MS)  # predicted about 20 ms: admitted, the queue counted
        deadline = ring.now_ns() + 30 * MS
        wait_for(lambda: ring.now_ns() > deadline, "its deadline")
        b = ring.ClaimBuffers(seg.capacity, 8)
        n, _, _, _, expired = seg.ring.claim(0, 8, 1, ring.MAX_NS, b, ring.now_ns())
        assert (n, expired) == (0, 1)
        figures = metrics.admission_stats(seg.ring)
        assert figures["compared_total"] == 1 and figures["late_total"] == 1
        assert figures["seen_ms_mean"] >= 29 and figures["correction"] > 1
