"""A value read from the segment is data: one field corrupted at a time.

Every process of the user can write into a live engine's segment. Each test
writes one field the way a stray process would, then runs the role that
reads it (supervisor, batcher or client) in a forked child, and asserts the
outcome: a typed error or a counted event, the other requests unharmed, and
never a signal (the child's exit status says how it ended).
"""
import os
import pathlib
import re
import traceback

import numpy as np
import pytest
from conftest import unique_name

from engine.client import ticket
from engine.config import EngineConfig
from engine.errors import EngineCorrupt
from engine.segment import Segment
from engine.shm import codes, reaper, ring

CSRC = pathlib.Path(__file__).resolve().parent.parent / "csrc"

# header fields as ring.h draws them: (offset, bytes)
CAPACITY, MAX_BATCH, TENSORS, INPUTS, LEVELS = (24, 4), (28, 4), (32, 4), (36, 4), (60, 4)
OFF_CTL, OFF_META, OFF_ERRMSG, OFF_READY = (64, 8), (72, 8), (80, 8), (104, 8)
OFF_TENSOR0, TENSOR_BYTES0 = (6720, 8), (6848, 8)
# sb_slot_meta fields: (offset in the slot's 64 B, bytes)
M_LENGTH, M_STATUS, M_ERRMSG_LEN, M_BATCH_SIZE = (28, 4), (32, 2), (34, 2), (36, 4)
M_DEADLINE, M_PRIORITY = (48, 8), (56, 4)


@pytest.fixture
def seg():
    s = Segment.create(EngineConfig(name=unique_name("trust"), input_shape=(4,),
                                    output_shape=(4,), queue_capacity=64, max_batch_size=8,
                                    priority_levels=2))
    s.own_word(codes.W_ENGINE_STATE, codes.ENGINE_RUNNING)
    yield s
    s.unlink()
    s.close()


def poke(seg, field, value, base=0):
    """Writes value into the segment at base + field's offset, as a stray
    process would (little-endian, truncated to the field's width)."""
    offset, width = field
    seg._mapping[base + offset:base + offset + width] = (value % (1 << 8 * width)).to_bytes(
        width, "little")


def meta(seg, slot):
    return seg.ring.geometry.off_meta + 64 * slot


def in_child(fn):
    """Runs fn() in a forked child; returns its exit status (0: fn returned,
    1: it raised, -N: signal N). The child prints what it raised."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def submit(seg, value, priority=0, deadline_ns=0):
    code, slot, gen = seg.ring.submit(os.getpid(), 0, np.full(4, value, np.float32), 0,
                                      deadline_ns, priority)
    assert code == codes.OK
    return slot, gen


def claim(seg, batcher=0, expire_ns=0):
    b = ring.ClaimBuffers(seg.capacity, 8)
    n, *_ = seg.ring.claim(batcher, 8, 1, ring.MAX_NS, b, expire_ns)
    return b, n


def test_no_c_file_but_setup_reads_the_headers_geometry():
    """The one check at attach protects every use only if no later code reads
    the segment's own copy: setup.c alone names those header fields."""
    fields = ("capacity|max_batch|tensors|inputs|in_place|levels|total_bytes|slot_bytes|"
              "incarnation|off_\\w+|tensor_slot_bytes")
    read = re.compile(rf"(\bh\b|hdr\([^)]*\))\s*->\s*({fields})\b")
    offenders = [f"{p.name}:{n}" for p in sorted(CSRC.glob("*.[ch]")) if p.name != "setup.c"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if read.search(line)]
    assert offenders == []


def test_a_header_rewritten_after_attach_changes_no_address(seg):
    """Capacity, levels, tensors and every offset rewritten with garbage: the
    ring goes on with its own copy, requests answered right."""
    for field, value in ((CAPACITY, 2**30), (LEVELS, 2**31), (TENSORS, 2**32 - 1),
                         (INPUTS, 0), (OFF_CTL, 2**63), (OFF_META, 2**40), (OFF_READY, 7),
                         (OFF_ERRMSG, 2**64 - 1), (OFF_TENSOR0, 2**50), (TENSOR_BYTES0, 1)):
        poke(seg, field, value)

    def roles():
        slots = [submit(seg, k) for k in range(3)]  # client: acquire, copy in, publish
        b, n = claim(seg)                            # batcher: scan and claim
        assert n == 3
        seg.out_regions[0][b.slots[:n]] = seg.in_regions[0][b.slots[:n]] * 2
        assert seg.ring.complete(0, b, n, codes.STATUS_BACKEND, b"x" * 300) == 3
        for k, (slot, gen) in enumerate(slots):     # client: the failure, read and freed
            assert seg.ring.slot_error(slot) == (codes.STATUS_BACKEND, "x" * 256)
            assert seg.ring.release_slot(slot, gen) == codes.OK
        census = reaper.Census(seg.ring, seg.capacity)  # supervisor: snapshot and reap
        assert len(census.ctl) == 64 and reaper.reap_dead_clients(seg.ring, census) == []
        assert seg.ring.reap_batcher(0, b"gone") == (0, 0)
        assert seg.ring.queued(1) == 0
    assert in_child(roles) == 0


def test_a_later_attach_refuses_a_rewritten_header_and_the_creator_restores_it(seg):
    poke(seg, CAPACITY, 2**30)
    with pytest.raises(EngineCorrupt, match="geometry"):
        Segment.attach(seg.name)
    assert seg.restore() >= 1  # the creator writes its own geometry back
    Segment.attach(seg.name).close()
    assert seg.ring.corrupt_total() >= 1


def test_settings_that_disagree_with_the_geometry_are_refused_at_attach(seg):
    blob = seg.config.to_json().replace(b'"queue_capacity": 64', b'"queue_capacity": 65')
    assert b"65" in blob
    seg._mapping[codes.OFF_CONFIG:codes.OFF_CONFIG + codes.CONFIG_BYTES] = blob.ljust(
        codes.CONFIG_BYTES, b"\0")
    with pytest.raises(EngineCorrupt, match="capacity"):
        Segment.attach(seg.name)
    seg._mapping[codes.OFF_CONFIG:codes.OFF_CONFIG + 8] = b"\xff{not js"
    with pytest.raises(EngineCorrupt, match="settings"):
        Segment.attach(seg.name)


def test_a_priority_out_of_range_is_failed_by_the_batcher_and_the_others_served(seg):
    (bad, bad_gen), good = submit(seg, 1), submit(seg, 2, priority=1)
    poke(seg, M_PRIORITY, 2**31 - 1, meta(seg, bad))

    def batcher():
        b, n = claim(seg)
        assert (n, b.slots[0]) == (1, good[0])
        assert seg.ring.wait_slot(bad, bad_gen, 0) == codes.EFAILED
        error = ticket.failed(seg, bad, bad_gen, codes.EFAILED)
        assert isinstance(error, EngineCorrupt), error
        assert seg.ring.corrupt_total() >= 1
    assert in_child(batcher) == 0


@pytest.mark.parametrize("who", ["supervisor reaps it", "client abandons it"])
def test_clearing_the_bit_of_a_slot_whose_priority_is_garbage_writes_in_the_bitmap(seg, who):
    slot, gen = submit(seg, 1)
    poke(seg, M_PRIORITY, 0x7FFFFFFF, meta(seg, slot))

    def clear():
        if who == "client abandons it":
            assert seg.ring.abandon(slot, gen) == codes.OK
        else:
            ctl = reaper.Census(seg.ring, seg.capacity).ctl[slot]
            assert seg.ring.reap_slot(slot, int(ctl)) == codes.OK
        assert not seg.ready_words.any()  # cleared at every level, nothing beyond
        assert seg.ring.corrupt_seen() == 1
    assert in_child(clear) == 0


def test_a_bit_past_the_last_slot_is_cleared_and_counted():
    small = Segment.create(EngineConfig(name=unique_name("trust-small"), input_shape=(4,),
                                        output_shape=(4,), queue_capacity=40))
    try:
        small.own_word(codes.W_ENGINE_STATE, codes.ENGINE_RUNNING)
        small.ready_words[0, 0] = np.uint64(1 << 50)  # slot 50 of 40

        def scan():
            assert claim(small)[1] == 0
            assert int(small.ready_words[0, 0]) == 0 and small.ring.corrupt_seen() == 1
        assert in_child(scan) == 0
    finally:
        small.unlink()
        small.close()


def test_the_claim_never_writes_past_its_scratch(seg):
    """The claim's scratch holds what the caller says; a pass that finds more
    READY slots chooses among those it has room for (none is lost: the rest
    wait for the next claim)."""
    tickets = [submit(seg, k) for k in range(12)]
    b = ring.ClaimBuffers(seg.capacity, 8)
    b.scratch[:] = 0xAB
    b.scratch_n = 3  # room for 3 entries of 4 words
    n, _, ready, _, _ = seg.ring.claim(0, 8, 1, ring.MAX_NS, b)
    assert (n, ready) == (3, 12)
    assert (b.scratch[12:] == 0xAB).all()
    claimed = list(zip(b.slots[:n].tolist(), b.gens[:n].tolist()))
    while n:
        n, *_ = seg.ring.claim(0, 8, 1, ring.MAX_NS, b)
        claimed += zip(b.slots[:n].tolist(), b.gens[:n].tolist())
    assert sorted(claimed) == sorted(tickets)


def test_a_snapshot_fills_no_more_than_its_arrays(seg):
    poke(seg, CAPACITY, 2**20)
    ctl, start = np.zeros(10, np.uint64), np.full(12, 7, np.uint64)

    def supervisor():
        assert seg.ring.snapshot(ctl, start) == 10 and (start[10:] == 7).all()
        assert len(reaper.Census(seg.ring, 2**20).ctl) == 64  # the ring's own count
    assert in_child(supervisor) == 0


def test_admission_figures_that_would_divide_by_zero_saturate(seg):
    """limit x instances wraps to 0 in u64 (2^32 x 2^32): clamped first, and
    the prediction saturates instead of wrapping."""
    seg.ring.set_word(codes.W_BATCH_LIMIT, 2**32)
    seg.ring.set_word(codes.W_INSTANCES, 2**32)
    seg.ring.set_word(codes.W_FIT_FIXED_NS, 2**64 - 1)
    seg.ring.set_word(codes.W_FIT_ITEM_PS, 2**64 - 1)
    submit(seg, 1)

    def client():
        assert seg.ring.predicted_wait_ns(0, ring.now_ns()) == 2**64 - 1
        code, _, _ = seg.ring.submit(os.getpid(), 0, np.ones(4, np.float32), 0,
                                     ring.now_ns() + 10**9, 0, True)
        assert code == codes.EOVERLOADED
    assert in_child(client) == 0


def test_an_error_length_past_its_buffer_is_cut_and_counted(seg):
    slot, gen = submit(seg, 1)
    b, n = claim(seg)
    seg.ring.complete(0, b, n, codes.STATUS_BACKEND, b"E: short")
    poke(seg, M_ERRMSG_LEN, 2**32 - 1, meta(seg, slot))
    status, text = seg.ring.slot_error(slot)
    assert status == codes.STATUS_BACKEND and len(text.encode()) <= codes.ERRMSG_BYTES
    assert seg.ring.corrupt_seen() == 1


def test_a_batch_size_past_max_batch_is_no_batch_size_and_counted(seg):
    tickets = [submit(seg, k) for k in range(3)]
    b, n = claim(seg)
    assert seg.ring.complete(0, b, n, codes.STATUS_OK, b"") == 3
    (slot, gen), out = tickets[0], np.empty(4, np.float32)
    assert seg.ring.slot_times(slot, gen)[codes.T_BATCH] == 3  # the batch that answered it
    poke(seg, M_BATCH_SIZE, seg.config.max_batch_size + 1, meta(seg, slot))
    code, stamps = seg.ring.take_timed(slot, gen, out)
    assert code == codes.OK and stamps[codes.T_BATCH] == 0 and seg.ring.corrupt_seen() == 1
    arrival, claim_ns, done = stamps[codes.T_ARRIVAL], stamps[codes.T_CLAIM], stamps[codes.T_DONE]
    assert 0 < arrival <= claim_ns <= done  # the times are not the batch size's to spoil
    for slot, gen in tickets[1:]:
        assert seg.ring.take_timed(slot, gen, out)[1][codes.T_BATCH] == 3


def test_a_status_no_batcher_writes_is_engine_corrupt(seg):
    slot, gen = submit(seg, 1)
    b, n = claim(seg)
    seg.ring.complete(0, b, n, codes.STATUS_BACKEND, b"E: x")
    poke(seg, M_STATUS, 300, meta(seg, slot))
    error = ticket.failed(seg, slot, gen, codes.EFAILED)
    assert isinstance(error, EngineCorrupt) and "got 300" in str(error)


def test_a_control_word_of_no_state_is_engine_corrupt_for_its_waiter(seg):
    slot, gen = submit(seg, 1)
    ctl = seg._mapping
    off = seg.ring.geometry.off_ctl + 8 * slot
    word = int.from_bytes(ctl[off:off + 8], "little")
    ctl[off:off + 8] = ((word & ~0xF) | 0xD).to_bytes(8, "little")  # state 13
    assert seg.ring.wait_slot(slot, gen, 0) == codes.ECORRUPT
    assert isinstance(ticket.failed(seg, slot, gen, codes.ECORRUPT), EngineCorrupt)


def test_an_expiry_fails_only_the_generation_the_pass_saw(seg):
    """A request past its deadline is failed unstarted, claimed first in the
    generation the pass saw: its slot reused by a request without a deadline
    is not failed, and what the expiry writes lands in no other slot."""
    slot, gen = submit(seg, 1, deadline_ns=ring.now_ns() + 1)
    assert seg.ring.abandon(slot, gen) == codes.OK  # withdrawn: the slot is free again
    again, new_gen = submit(seg, 2)
    assert (again, new_gen) == (slot, gen + 1)
    b, n = claim(seg, expire_ns=ring.now_ns())
    assert (n, b.gens[0]) == (1, new_gen) and seg.ring.word(codes.W_EXPIRED) == 0
    other, other_gen = submit(seg, 3, deadline_ns=ring.now_ns() + 1)
    b, n = claim(seg, expire_ns=ring.now_ns())
    assert n == 0 and seg.ring.wait_slot(other, other_gen, 0) == codes.EFAILED
    assert seg.ring.slot_error(other)[0] == codes.STATUS_EXPIRED
    assert seg.ring.slot_error(again)[0] == codes.STATUS_OK  # the claimed one untouched


def test_a_length_past_the_padding_bound_reaches_the_backend_clamped(make_engine):
    """A request's real length is client-written: a backend that indexes by
    it (a native or CUDA kernel) gets at most the padding bound."""
    eng = make_engine("trust-len", backend="helpers:lengths_seen", input_shape=(None,),
                      max_input_shape=(8,), output_shape=(1,))
    seg = Segment.attach(eng.name)
    try:
        code, slot, gen = seg.ring.acquire(os.getpid(), 0)
        assert code == codes.OK
        seg.lengths[slot, 0] = 2**31  # as a stray write would
        assert seg.ring.publish(slot, gen, 2**31) == codes.OK
        assert seg.ring.wait_slot(slot, gen, 10 * 10**9) == codes.OK
        assert seg.out_regions[0][slot].tolist() == [8.0]
        seg.ring.release_slot(slot, gen)
    finally:
        seg.close()


def test_the_watchdog_kills_no_batcher_for_a_batch_start_no_batch_had(make_engine):
    """A batch start written by a stray process (before the engine started, or
    in the future) is no hung model: the batcher lives on."""
    eng = make_engine("trust-dog", batch_timeout_s=0.05)
    pids, r = eng.stats()["batcher_pids"], eng._seg.ring
    for value in (1, 2**63):
        r.set_word(codes.W_BATCH_START, value)
        deadline = ring.now_ns() + 500_000_000  # the interval watched: 5 supervisor passes
        while ring.now_ns() < deadline:
            r.wait_done_seq(r.done_seq(), 100_000_000)
        assert eng.stats()["batcher_pids"] == pids and r.word(codes.W_RESTARTS) == 0, value
    r.set_word(codes.W_BATCH_START, 0)
