"""submit()'s Future stands on concurrent.futures internals through one seam
(engine.client.stdfuture): these fail when a Python moves them."""
import concurrent.futures
import threading

import pytest

from engine.client import stdfuture


def test_this_pythons_futures_have_the_shape_the_seam_relies_on():
    assert stdfuture.shape_changes() == []


def test_the_shape_check_sees_a_future_that_sets_more_state(monkeypatch):
    plain_init = concurrent.futures.Future.__init__

    def init(self):
        plain_init(self)
        self._cancel_requested = False  # a field SettledHere.__init__ would not set

    monkeypatch.setattr(concurrent.futures.Future, "__init__", init)
    assert any("Future.__init__ sets" in change for change in stdfuture.shape_changes())


class Answered(stdfuture.SettledHere):
    """A SettledHere whose request is answered with `value` once `ready` is set."""

    def __init__(self, value):
        lock = threading.RLock()
        super().__init__(threading.Condition(lock), lock)
        self.value, self.ready, self.watched, self.reported = value, False, 0, []

    def _outcome(self, error):
        if error is not None:
            return True, None, error
        return self.ready, self.value if self.ready else None, None

    def _await(self, wait_s):
        self.try_settle()

    def _watch(self):
        self.watched += 1

    def _withdraw(self):
        return not self.ready

    def _report(self, failure):
        self.reported.append(failure)


def test_an_asked_future_settles_itself_with_nobody_waiting():
    f = Answered(7)
    assert not f.done()
    f.ready = True
    assert f.result(timeout=0) == 7 and f.done() and f.exception() is None
    assert f.watched == 0


def test_wait_and_as_completed_hand_the_future_to_a_watcher():
    f, g = Answered(1), Answered(2)
    concurrent.futures.wait([f], timeout=0)
    with pytest.raises(concurrent.futures.TimeoutError):
        next(concurrent.futures.as_completed([g], timeout=0))
    assert f.watched == 1 and g.watched == 1


def test_a_callback_watches_the_future_and_runs_once_it_settles():
    f = Answered(2)
    done = []
    f.add_done_callback(done.append)
    assert f.watched == 1 and done == []
    f.ready = True
    assert f.try_settle() and done == [f]


def test_a_failure_is_the_futures_exception():
    f = Answered(None)
    assert f.try_settle(RuntimeError("gone"))
    assert isinstance(f.exception(timeout=0), RuntimeError)


def test_a_cancelled_future_reports_its_cancellation_once():
    f = Answered(None)
    f._began = object()  # a span to record
    assert f.cancel() and f.cancelled()
    assert len(f.reported) == 1
    assert isinstance(f.reported[0], concurrent.futures.CancelledError)
    answered = Answered(3)
    answered.ready = True
    assert not answered.cancel()  # answered already: its answer is result()'s
    assert answered.result() == 3
