"""The flush rule alone, on hand-made ready lists; then the C claim held to it."""
import os

import numpy as np
import oracles
import pytest
from conftest import raw_segment

from engine.batching import policy
from engine.shm import codes, reaper, ring

MS = 1_000_000
RULE = policy.FlushRule(max_batch=4, max_delay_ns=2 * MS)


def arrivals(*ms):
    return np.array([int(t * MS) for t in ms], np.uint64)


def test_nothing_ready_waits_for_work_with_no_timer():
    d = oracles.next_batch(RULE, arrivals(), now_ns=100 * MS)
    assert len(d.take) == 0 and d.wait_ns is None


def test_a_full_batch_flushes_at_once_oldest_first():
    d = oracles.next_batch(RULE, arrivals(9.9, 9.7, 9.8, 9.6), now_ns=10 * MS)  # none due yet
    assert list(d.take) == [3, 1, 2, 0] and d.wait_ns == 0


def test_fewer_than_full_flush_once_the_oldest_is_due():
    d = oracles.next_batch(RULE, arrivals(8.5, 8.0), now_ns=10 * MS)  # oldest waited exactly max_delay
    assert list(d.take) == [1, 0]


def test_fewer_than_full_and_none_due_wait_for_the_oldest_only():
    d = oracles.next_batch(RULE, arrivals(9.5, 9.0, 9.9), now_ns=10 * MS)
    assert len(d.take) == 0 and d.wait_ns == 1 * MS  # 9.0 + 2 - 10: the OLDEST's deadline


def test_more_ready_than_fit_take_the_oldest_max_batch():
    d = oracles.next_batch(RULE, arrivals(5, 1, 4, 2, 6, 3), now_ns=10 * MS)
    assert list(d.take) == [1, 3, 5, 2]


def test_ties_go_to_the_lower_slot_first():
    d = oracles.next_batch(RULE, arrivals(3, 1, 1, 2, 1), now_ns=10 * MS)
    assert list(d.take) == [1, 2, 4, 3]


def test_draining_flushes_whatever_is_ready_at_once():
    d = oracles.next_batch(RULE, arrivals(9.99), now_ns=10 * MS, draining=True)
    assert list(d.take) == [0]


def test_thresholds_are_the_rule_for_the_c_claim():
    assert RULE.thresholds(10 * MS) == (4, 4, 8 * MS)
    assert RULE.thresholds(10 * MS, draining=True) == (4, 1, ring.MAX_NS)
    assert RULE.thresholds(10 * MS, limit=2) == (2, 2, 8 * MS)  # AIMD's smaller full batch
    assert RULE.thresholds(10 * MS, limit=99) == (4, 4, 8 * MS)  # never above max_batch


def test_a_delay_longer_than_the_clock_has_run_is_a_cutoff_before_every_arrival():
    # the monotonic clock starts near boot: a long max_delay must not go below 0
    # (the C claim takes the cutoff unsigned)
    rule = policy.FlushRule(max_batch=8, max_delay_ns=600_000_000_000)
    assert rule.thresholds(now_ns=5_000_000_000) == (8, 8, 0)


def test_the_most_urgent_level_goes_first_and_the_oldest_of_any_level_sets_the_flush():
    d = oracles.next_batch(RULE, arrivals(5, 1, 4, 2, 6, 3), now_ns=10 * MS,
                        priority=np.array([0, 1, 1, 0, 0, 1]))
    assert list(d.take) == [3, 0, 4, 1]  # level 0 oldest first (2, 5, 6), then level 1's oldest
    d = oracles.next_batch(RULE, arrivals(9.5, 7.5), now_ns=10 * MS, priority=np.array([0, 1]))
    assert list(d.take) == [0, 1]  # the level-1 request made the batch due


@pytest.mark.parametrize("seed", range(24))
def test_the_c_claim_takes_what_the_rule_says_on_random_ready_lists(seed):
    rng = np.random.default_rng(seed)
    levels = int(rng.integers(1, 4))
    with raw_segment("policy", queue_capacity=256, max_batch_size=8,
                     priority_levels=levels) as seg:
        r, pid = seg.ring, os.getpid()
        rule = policy.FlushRule(max_batch=int(rng.integers(1, 9)),
                                max_delay_ns=int(rng.integers(0, 3)) * MS)
        tickets = [r.acquire(pid, 0)[1:] for _ in range(int(rng.integers(1, 200)))]
        for k in rng.permutation(len(tickets)):  # published in a random order: random arrivals
            assert r.publish(*tickets[k], 0, 0, int(rng.integers(0, levels))) == codes.OK
        # some withdrawn again: their bits are cleared, their slots FREE
        for k in rng.choice(len(tickets), size=len(tickets) // 4, replace=False):
            r.abandon(*tickets[k])
        # the READY list as the claim sees it, from the slots' meta (ring.h: 64 B each,
        # arrival_ns at 0, priority at 56), in slot order
        meta = np.ndarray((seg.capacity, 8), np.uint64, buffer=seg._mapping,
                          offset=seg.ring.geometry.off_meta)
        slots = np.nonzero(ring.ctl_state(reaper.Census(r, seg.capacity).ctl) == codes.READY)[0]
        n, stamps, levels_of = len(slots), meta[slots, 0], meta[slots, 7] & np.uint64(0xFFFFFFFF)
        del meta  # copies taken: the mapping can close
        now = int(stamps[:n].max()) + int(rng.integers(0, 3)) * MS if n else ring.now_ns()
        want = oracles.next_batch(rule, stamps[:n], now, priority=levels_of[:n])
        b = ring.ClaimBuffers(seg.capacity, rule.max_batch)
        got, _, ready, _, _ = r.claim(0, *rule.thresholds(now), b)
        assert ready == n
        assert sorted(b.slots[:got].tolist()) == sorted(slots[want.take].tolist())


def test_an_idle_batcher_spins_for_the_engines_idle_spin_us_else_the_machines_default():
    from engine.config import EngineConfig
    assert policy.FlushRule.of(EngineConfig(name="spin")).idle_spin_ns == ring.SPIN_NS
    assert policy.FlushRule.of(EngineConfig(name="spin", idle_spin_us=0)).idle_spin_ns == 0
    assert policy.FlushRule.of(EngineConfig(name="spin", idle_spin_us=300)).idle_spin_ns == 300_000


@pytest.mark.parametrize("bad", [-1, 1_000_001, float("nan")])
def test_an_idle_spin_outside_zero_to_a_second_is_refused_naming_the_knob(bad):
    from engine.config import EngineConfig
    with pytest.raises(ValueError, match=r"idle_spin_us must be in 0\.\.1000000"):
        EngineConfig(name="spin", idle_spin_us=bad)


def test_an_engine_that_never_spins_idle_still_answers_every_request(make_engine):
    import engine
    eng = make_engine("nospin", idle_spin_us=0)
    with engine.Client(eng.name) as c:
        for k in range(50):  # each one wakes the sleeping batcher
            x = np.full(16, k, np.float32)
            assert np.array_equal(c.infer(x, timeout=30), x * 2 + 1)


class _Woken:
    """A ring whose wait for work returns code."""

    def __init__(self, code: int) -> None:
        self.code = code

    def wait_work(self, seen, timeout_ns, spin_ns=0) -> int:
        return self.code


def test_a_batcher_woken_with_nothing_to_claim_spins_before_it_sleeps_again():
    from engine.batching.loop import await_work
    rule = policy.FlushRule(max_batch=4, max_delay_ns=0, idle_spin_ns=50_000)
    # woken (a client's expect_work, or a publish another batcher claimed): a request comes
    assert await_work(_Woken(codes.OK), rule, 0, 0, 0, 0, 0, 0) == 50_000
    # the idle bound passed with no wake: asleep again at once
    assert await_work(_Woken(codes.ETIMEOUT), rule, 0, 0, 0, 0, 0, 50_000) == 0
