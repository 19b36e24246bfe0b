"""The C ring alone: its layout, its state machine, and many processes at once."""
import multiprocessing
import os
import signal
import threading

import numpy as np
import pytest
from conftest import raw_segment, unique_name

from engine.config import EngineConfig
from engine.segment import Segment
from engine.shm import codes, liveness, reaper, ring


@pytest.fixture
def segment():
    seg = Segment.create(EngineConfig(name=unique_name("ring"), input_shape=(4,),
                                      output_shape=(4,), queue_capacity=64, max_batch_size=8))
    seg.ring.set_word(codes.W_ENGINE_STATE, codes.ENGINE_RUNNING)
    yield seg
    seg.unlink()
    seg.close()


def attach(seg, mapped_bytes):
    """What another process's attach says of the segment, mapped_bytes long."""
    fresh = ring.Ring(seg._mapping)
    try:
        return fresh.attach(mapped_bytes)
    finally:
        fresh.release()


def claim_all(r, max_n=64, batcher=0, capacity=64):
    b = ring.ClaimBuffers(capacity, max_n)
    n, *_ = r.claim(batcher, max_n, 1, ring.MAX_NS, b)
    return b.slots[:n].tolist(), b.gens[:n].tolist(), b.lengths[:n].tolist()


def ready_slots(r, capacity=64):
    """(READY slots, oldest arrival_ns): a claim's report, with a flush rule
    that lets it claim nothing."""
    _, _, n, oldest_ns, _ = r.claim(0, 1, capacity + 1, 0, ring.ClaimBuffers(capacity, 1))
    return n, oldest_ns


def complete(r, slot, gen, batcher=0):
    """Completes one slot; True if it reached its client."""
    b = ring.ClaimBuffers(1, 1)
    b.slots[0], b.gens[0] = slot, gen
    return r.complete(batcher, b, 1) == 1


def test_segment_is_owner_only_and_named_for_the_engine(segment):
    path = f"/dev/shm/shmbatch-{segment.name}"
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_an_output_of_the_input_spec_overwrites_its_input_row(segment):
    geo = segment.ring.geometry  # float32[4] in and out
    assert geo.in_place == 1 and segment.in_place
    assert geo.off_tensor[1] == geo.off_tensor[0]
    assert geo.total_bytes >= geo.off_tensor[0] + 64 * 16
    assert np.shares_memory(segment.in_regions[0][3], segment.out_regions[0][3])
    assert attach(segment, geo.total_bytes - 1) == codes.ECORRUPT


def test_an_output_of_another_spec_gets_its_own_aligned_region():
    seg = Segment.create(EngineConfig(name=unique_name("ring-out"), input_shape=(4,),
                                      output_shape=(3,), queue_capacity=64))
    try:
        geo = seg.ring.geometry
        assert geo.in_place == 0 and not seg.in_place
        off_in, off_out = geo.off_tensor[0], geo.off_tensor[1]
        assert off_in % 4096 == 0 and off_out % 4096 == 0
        assert off_out >= off_in + 64 * 16
        assert geo.total_bytes >= off_out + 64 * 12
        assert attach(seg, geo.total_bytes - 1) == codes.ECORRUPT
    finally:
        seg.unlink()
        seg.close()


def test_named_tensors_get_one_aligned_region_each_inputs_first():
    config = EngineConfig(name=unique_name("ring-named"),
                          inputs={"ids": ("int64", (None,)), "pixel": ("uint8", (3, 5))},
                          max_input_shapes={"ids": (7,)},
                          outputs={"logits": ("float32", (2,)), "emb": ("float16", (9,))},
                          queue_capacity=64)
    seg = Segment.create(config)
    try:
        geo = seg.ring.geometry
        assert (geo.tensors, geo.inputs) == (4, 2)
        offsets = [geo.off_tensor[t] for t in range(4)]
        rows = [7 * 8, 15, 2 * 4, 9 * 2]
        assert [geo.tensor_slot_bytes[t] for t in range(4)] == rows
        for t in range(3):  # each region aligned, after the whole of the one before it
            assert offsets[t] % 4096 == 0 and offsets[t + 1] >= offsets[t] + 64 * rows[t]
        assert geo.total_bytes >= offsets[3] + 64 * rows[3]
        assert seg.in_regions[0].shape == (64, 7) and seg.in_regions[0].dtype == np.int64
        assert seg.out_regions[1].shape == (64, 9)
        assert seg.lengths.shape == (64, 2)
        assert attach(seg, geo.total_bytes) == codes.OK
    finally:
        seg.unlink()
        seg.close()


def test_slot_walks_free_writing_ready_claimed_done_free(segment):
    r = segment.ring
    code, slot, gen = r.acquire(os.getpid(), 0)
    assert code == codes.OK
    assert r.wait_slot(slot, gen, 0) == codes.ESTALE  # WRITING is not waitable
    assert r.publish(slot, gen, 0) == codes.OK
    assert ready_slots(r)[0] == 1
    assert r.wait_slot(slot, gen, 1000) == codes.ETIMEOUT
    slots, gens, _ = claim_all(r)
    assert (slots, gens) == ([slot], [gen])
    assert complete(r, slot, gen)
    assert r.wait_slot(slot, gen, 0) == codes.OK
    assert r.release_slot(slot, gen) == codes.OK
    code, slot2, gen2 = r.acquire(os.getpid(), 0)
    assert code == codes.OK and (slot2 != slot or gen2 == gen + 1)


def test_submit_and_take_move_a_request_through_in_one_call_each(segment):
    r = segment.ring
    x = np.arange(4, dtype=np.float32)
    code, slot, gen = r.submit(os.getpid(), 0, x, 0)
    assert code == codes.OK and segment.in_regions[0][slot].tolist() == x.tolist()
    assert ready_slots(r)[0] == 1  # published
    claim_all(r)
    segment.out_regions[0][slot] = x * 3
    out = np.zeros(4, np.float32)
    assert r.take(slot, gen, 0, 0, out) == codes.ETIMEOUT  # claimed, not answered: untouched
    assert out.tolist() == [0, 0, 0, 0]
    assert complete(r, slot, gen)
    assert r.take(slot, gen, 0, 0, out) == codes.OK
    assert out.tolist() == (x * 3).tolist()
    assert r.release_slot(slot, gen) == codes.ESTALE  # take released it


def test_submit_refuses_more_bytes_than_a_row_and_takes_no_slot(segment):
    r = segment.ring
    assert r.submit(os.getpid(), 0, np.zeros(5, np.float32), 0)[0] == codes.EBADARG
    assert r.take(0, 0, 0, 0, np.zeros(5, np.float32)) == codes.EBADARG
    assert ready_slots(r)[0] == 0 and len(claim_all(r)[0]) == 0
    assert sum(r.acquire(os.getpid(), 0)[0] == codes.OK for _ in range(64)) == 64


def test_take_leaves_a_failed_answer_to_its_owner(segment):
    r = segment.ring
    code, slot, gen = r.submit(os.getpid(), 0, np.ones(4, np.float32), 0)
    claim_all(r)
    b = ring.ClaimBuffers(1, 1)
    b.slots[0], b.gens[0] = slot, gen
    assert r.complete(0, b, 1, codes.STATUS_BACKEND, b"ValueError: no") == 1
    assert r.take(slot, gen, 0, 0, np.zeros(4, np.float32)) == codes.EFAILED
    assert r.slot_error(slot) == (codes.STATUS_BACKEND, "ValueError: no")
    assert r.release_slot(slot, gen) == codes.OK


def test_a_spinning_wait_still_times_out_at_its_bound(segment):
    r = segment.ring
    _, slot, gen = r.submit(os.getpid(), 0, np.ones(4, np.float32), 0)
    t = ring.now_ns()
    assert r.wait_slot(slot, gen, 20_000_000, 5_000_000) == codes.ETIMEOUT
    assert r.wait_work(r.work_seq(), 20_000_000, 5_000_000) == codes.ETIMEOUT
    assert ring.now_ns() - t >= 40_000_000  # spin (5 ms) counted in each 20 ms bound


def test_expect_work_leaves_the_work_word_alone_while_no_batcher_sleeps(segment):
    r = segment.ring
    seen = r.work_seq()
    r.expect_work()
    assert r.work_seq() == seen


def test_expect_work_wakes_a_batcher_asleep_on_the_work_word(segment):
    r = segment.ring
    seen, codes_got = r.work_seq(), []
    sleeper = threading.Thread(target=lambda: codes_got.append(r.wait_work(seen, 60 * 10**9)),
                               daemon=True)
    sleeper.start()
    deadline = ring.now_ns() + 10 * 10**9
    while sleeper.is_alive() and ring.now_ns() < deadline:
        r.expect_work()  # nothing until the thread is counted asleep, then its wake
        sleeper.join(0.001)
    woken = not sleeper.is_alive()
    r.wake_work()  # a sleeper a failure left ends before the segment does
    sleeper.join(10)
    assert woken and codes_got == [codes.OK]
    assert r.work_seq() != seen


def test_poll_chunks_marks_the_streams_a_wait_would_not_time_out_on():
    with raw_segment("pollc", iterative=True, max_steps=8) as seg:
        r = seg.ring
        (a, ga), (b, gb), (c, gc) = [r.submit(os.getpid(), 0, np.ones(4, np.float32), 0)[1:]
                                     for _ in range(3)]
        batch = ring.ClaimBuffers(seg.capacity, 2)
        assert r.claim(0, 2, 1, ring.MAX_NS, batch)[0] == 2  # a and b; c stays READY
        one = np.ones(1, np.uint32)
        states = np.empty(1, np.int32)
        assert r.stream_put(0, np.array([a], np.uint32), np.array([ga], np.uint32), one,
                            np.zeros(1, np.uint32), states) == 1
        # c: READY, then as a ticket no longer its slot's; a slot past the ring's
        slots = np.array([a, b, c, c, seg.capacity], np.uint32)
        gens = np.array([ga, gb, gc, gc + 1, 0], np.uint32)
        seen = np.zeros(5, np.uint32)
        moved = np.full(5, 7, np.uint8)
        assert r.poll_chunks(slots, gens, seen, moved) == 3
        assert moved.tolist() == [1, 0, 0, 1, 1]
        waits = [r.wait_chunks(int(s), int(g), 0, 0)[0] != codes.ETIMEOUT
                 for s, g in zip(slots, gens)]
        assert waits == [True, False, False, True, True]
        # b settled with no new chunk: its word is the one seen, and it moved
        assert r.complete_some(0, np.array([b], np.uint32), np.array([gb], np.uint32), 0, b"") == 1
        assert r.poll_chunks(slots[1:2], gens[1:2], seen[1:2], moved[:1]) == 1


def test_late_completion_after_abandon_never_reaches_the_next_owner(segment):
    r = segment.ring
    _, slot, gen = r.acquire(os.getpid(), 0)
    r.publish(slot, gen, 0)
    claim_all(r)
    assert r.abandon(slot, gen) == codes.OK          # CLAIMED -> ABANDONED
    assert not complete(r, slot, gen)  # the batcher frees it, answer dropped
    # the same slot, reused: the old ticket can touch nothing
    for _ in range(64):
        code, s, g = r.acquire(os.getpid(), 0)
        if s == slot:
            break
    assert (s, g) == (slot, gen + 1)
    assert not complete(r, slot, gen)
    assert r.release_slot(slot, gen) == codes.ESTALE
    assert r.abandon(slot, gen) == codes.ESTALE
    assert r.publish(s, g, 0) == codes.OK
    assert r.word(codes.W_STALE) >= 1


def test_abandon_of_a_queued_request_frees_the_slot_at_once(segment):
    r = segment.ring
    _, slot, gen = r.acquire(os.getpid(), 0)
    r.publish(slot, gen, 0)
    assert r.abandon(slot, gen) == codes.OK
    assert ready_slots(r)[0] == 0
    assert claim_all(r)[0] == []


def queue(r, n, order=lambda tickets: tickets):
    """Acquires n slots, then publishes them in `order`; returns the tickets published, in order."""
    tickets = [r.acquire(os.getpid(), 0)[1:] for _ in range(n)]
    published = order(tickets)
    for slot, gen in published:
        r.publish(slot, gen, 0)
        ring.spin_ns(1000)  # distinct arrival stamps
    return published


def test_claim_takes_the_oldest_first_and_at_most_max_n(segment):
    r = segment.ring
    # published highest slot first: oldest-first and lowest-slot-first now disagree
    published = queue(r, 10, order=lambda tickets: tickets[::-1])
    slots, _, _ = claim_all(r, max_n=4)
    assert slots == sorted(slot for slot, _ in published[:4])


def test_claim_takes_none_until_flush_n_are_ready_or_the_oldest_is_due(segment):
    r = segment.ring
    b = ring.ClaimBuffers(segment.capacity, 8)
    published = queue(r, 3)
    oldest_ns = ready_slots(r)[1]
    # 3 ready, 4 wanted, the oldest not yet due: nothing claimed, but seen
    assert r.claim(0, 8, 4, oldest_ns - 1, b) == (0, 0, 3, oldest_ns, 0)
    # the oldest due at the cutoff: all three go, though fewer than flush_n
    n, claim_ns, ready, _, _ = r.claim(0, 8, 4, oldest_ns, b)
    assert (n, ready) == (3, 3) and claim_ns >= oldest_ns
    assert b.slots[:n].tolist() == sorted(slot for slot, _ in published)


def test_claim_flushes_once_flush_n_are_ready_before_the_cutoff(segment):
    r = segment.ring
    b = ring.ClaimBuffers(segment.capacity, 8)
    queue(r, 4)
    assert r.claim(0, 8, 4, 0, b)[0] == 4


def test_consecutive_requests_take_consecutive_slots_and_a_freed_lower_one_comes_first(segment):
    r, pid = segment.ring, os.getpid()
    tickets = [r.acquire(pid, 0)[1:] for _ in range(6)]
    slots = [slot for slot, _ in tickets]
    assert slots == list(range(slots[0], slots[0] + 6))  # one contiguous run of rows
    slot, gen = tickets[1]
    r.publish(slot, gen, 0)
    claim_all(r)
    complete(r, slot, gen)
    assert r.release_slot(slot, gen) == codes.OK
    assert r.acquire(pid, 0)[1] == slot  # the lowest freed row is reused while it is warm
    assert r.acquire(pid, 0)[1] == slots[-1] + 1  # then on past the rows in use


def test_full_ring_refuses_and_leaves_the_count_to_the_client(segment):
    r = segment.ring
    for _ in range(64):
        assert r.acquire(os.getpid(), 0)[0] == codes.OK
    assert r.acquire(os.getpid(), 0)[0] == codes.EFULL
    assert r.acquire_wait(os.getpid(), 0, 1_000_000)[0] == codes.EFULL  # after its bound
    assert r.word(codes.W_REJECTED) == 0  # the client counts a refusal, once it has made room


def test_a_client_waiting_on_a_full_ring_gets_the_slot_freed_by_another_thread(segment):
    r = segment.ring
    tickets = [r.acquire(os.getpid(), 0)[1:] for _ in range(64)]
    got = []
    waiter = threading.Thread(target=lambda: got.append(r.acquire_wait(os.getpid(), 0, 30 * 10**9)))
    started = ring.now_ns()
    waiter.start()
    assert r.cancel(*tickets[40]) == codes.OK  # before or during its sleep: it must see it
    waiter.join(timeout=60)
    assert got and got[0][:2] == (codes.OK, 40)
    assert ring.now_ns() - started < 30 * 10**9  # woken, not timed out


def _killed_between_bit_and_publish(name, out):
    """A client that dies right after publish's first step: its slot's READY
    bit is set, its CAS to READY never made (the slot stays WRITING)."""
    seg = Segment.attach(name)
    code, slot, gen = seg.ring.acquire(os.getpid(), liveness.start_ticks(os.getpid()))
    seg.in_regions[0][slot][:] = -1
    seg.ready_words[0, slot // 64] |= np.uint64(1 << (slot % 64))  # publish's first step
    out.put((code, slot, gen))
    signal.pause()  # SIGKILLed here


def test_a_client_killed_between_its_ready_bit_and_publish_loses_nor_doubles_a_slot(segment):
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_killed_between_bit_and_publish, args=(segment.name, out))
    child.start()
    code, slot, gen = out.get(timeout=60)
    assert code == codes.OK
    os.kill(child.pid, signal.SIGKILL)
    child.join(timeout=30)
    r = segment.ring
    b = ring.ClaimBuffers(segment.capacity, 8)
    assert r.claim(0, 8, 1, ring.MAX_NS, b)[0] == 0  # a set bit on a WRITING slot: skipped
    census = reaper.Census(r, segment.capacity)
    assert reaper.reap_dead_clients(r, census) == [(slot, child.pid)]  # not lost: reclaimed
    code, again, new_gen = r.acquire(os.getpid(), 0)
    assert (code, again, new_gen) == (codes.OK, slot, gen + 1)  # the slot comes back, once
    segment.in_regions[0][slot][:] = 7
    assert r.publish(slot, new_gen, 0) == codes.OK
    assert r.claim(0, 8, 1, ring.MAX_NS, b)[:1] == (1,) and b.slots[0] == slot
    assert r.claim(0, 8, 1, ring.MAX_NS, b)[0] == 0  # claimed once, not twice
    assert int(segment.ready_words[0, slot // 64]) & (1 << (slot % 64)) == 0


def test_reaping_a_dead_batcher_fails_its_claims_only(segment):
    r = segment.ring
    mine = queue(r, 3)
    claim_all(r, max_n=2, batcher=5)
    assert r.reap_batcher(5, b"gone") == (2, 0)
    outcomes = sorted(r.wait_slot(s, g, 0) for s, g in mine)
    assert outcomes == sorted([codes.EFAILED, codes.EFAILED, codes.ETIMEOUT])
    failed = [s for s, g in mine if r.wait_slot(s, g, 0) == codes.EFAILED]
    assert r.slot_error(failed[0]) == (codes.STATUS_BATCHER_DIED, "gone")


def test_a_dead_batchers_claims_are_kept_for_its_successor_to_retry_alone(segment):
    r = segment.ring
    mine = queue(r, 3)
    claim_all(r, max_n=3, batcher=5)
    assert r.reap_batcher(5, b"gone", retry=True) == (0, 3)  # kept CLAIMED, none failed
    assert all(r.wait_slot(s, g, 0) == codes.ETIMEOUT for s, g in mine)  # still pending
    assert len(r.inherit(4, 0, segment.capacity)[0]) == 0  # another number inherits nothing
    slots, gens, lengths = r.inherit(5, 0, segment.capacity)
    assert sorted(zip(slots.tolist(), gens.tolist())) == sorted(mine)
    # the successor retries the first alone and dies in it: that one fails (poison),
    # the two not yet retried are kept again
    assert r.retry_alone(5, int(slots[0]), int(gens[0])) == codes.OK
    assert r.reap_batcher(5, b"poison", retry=True) == (1, 2)
    assert r.wait_slot(int(slots[0]), int(gens[0]), 0) == codes.EFAILED
    assert r.slot_error(int(slots[0])) == (codes.STATUS_BATCHER_DIED, "poison")
    assert r.retry_alone(5, int(slots[0]), int(gens[0])) == codes.ESTALE  # failed: not ours
    assert r.word(codes.W_RETRIED) == 1
    assert r.reap_batcher(5, b"no successor") == (2, 0)  # without retry: all fail


def test_a_successor_frees_what_was_withdrawn_while_kept_and_fails_what_expired(segment):
    r = segment.ring
    tickets = [r.acquire(os.getpid(), 0)[1:] for _ in range(3)]
    deadline_ns = ring.now_ns() + 1_000_000
    for k, (slot, gen) in enumerate(tickets):  # the second with a deadline that will pass
        r.publish(slot, gen, 0, deadline_ns if k == 1 else 0)
    claim_all(r, max_n=3, batcher=2)
    assert r.reap_batcher(2, b"gone", retry=True) == (0, 3)
    (s0, g0), (s1, g1), (s2, g2) = tickets
    assert r.abandon(s0, g0) == codes.OK  # its client gave up while no batcher held it
    abandoned = reaper.Census(r, segment.capacity).count(codes.ABANDONED)
    slots, gens, _ = r.inherit(2, deadline_ns + 1, segment.capacity)
    assert slots.tolist() == [s2]  # the only one left to retry
    assert reaper.Census(r, segment.capacity).count(codes.ABANDONED) == abandoned - 1  # freed
    assert r.wait_slot(s1, g1, 0) == codes.EFAILED
    assert r.slot_error(s1)[0] == codes.STATUS_EXPIRED and r.word(codes.W_EXPIRED) == 1


def _ring_client(name, client_id, n, results):
    seg = Segment.attach(name)
    r = seg.ring
    wrong = 0
    for k in range(n):
        while True:
            code, slot, gen = r.acquire(os.getpid(), 0)
            if code == codes.OK:
                break
        seg.in_regions[0][slot][:] = client_id * 1_000_000 + k
        r.publish(slot, gen, 0)
        assert r.wait_slot(slot, gen, 10_000_000_000) == codes.OK
        # the whole row is this request's answer (in place: it overwrote the input)
        wrong += not (seg.out_regions[0][slot] == (client_id * 1_000_000 + k) * 2 + 1).all()
        r.release_slot(slot, gen)
    results.put(wrong)


def _ring_batcher(name, batcher, stop):
    seg = Segment.attach(name)
    r = seg.ring
    b = ring.ClaimBuffers(seg.capacity, 8)
    while not stop.is_set():
        seen = r.work_seq()
        n, claim_ns, *_ = r.claim(batcher, 8, 1, ring.MAX_NS, b)
        if n == 0:
            r.wait_work(seen, 50_000_000)
            continue
        for s in b.slots[:n].tolist():
            seg.out_regions[0][s] = seg.in_regions[0][s] * 2 + 1
        assert r.complete(batcher, b, n) == n
        r.finish_batch(b, n, claim_ns, ring.now_ns(), False)


def test_many_client_processes_and_two_batchers_get_their_own_answers(segment):
    ctx = multiprocessing.get_context("fork")
    results, stop = ctx.Queue(), ctx.Event()
    batchers = [ctx.Process(target=_ring_batcher, args=(segment.name, b, stop)) for b in (0, 1)]
    clients = [ctx.Process(target=_ring_client, args=(segment.name, c, 500, results))
               for c in range(6)]
    for p in batchers + clients:
        p.start()
    wrong = [results.get(timeout=60) for _ in clients]
    stop.set()
    for p in batchers + clients:
        p.join(10)
        assert p.exitcode == 0
    assert wrong == [0] * 6
    assert segment.ring.word(codes.W_ITEMS) == 3000
    assert segment.ring.word(codes.W_REQUESTS) == 3000
