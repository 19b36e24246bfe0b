"""The one module that calls the C ring (engine._ringc) through cffi.

It turns the mapping of a segment into this process's own view of it (an
sb_ring: the geometry, copied from the header once and checked, from then on
the only source of every bound and offset) and wraps each C function in a
method that returns plain ints (codes, not raised), so that no other module
sees cffi objects.

The SB_* constants of csrc/ring.h are engine.shm.codes'.
"""
import os
import threading
import time

import numpy as np

from engine._ringc import ffi, lib
from engine.shm import codes

# CLOCK_MONOTONIC, as sb_now_ns reads it; from Python without a C call, which
# would let another thread take the GIL (a context switch when one waits)
now_ns = time.monotonic_ns
MAX_NS = 2**64 - 1  # "any time": a cutoff every arrival is before

# How long a waiter (client or batcher) may spin re-reading the word it waits
# for before it sleeps: a spinner is not marked asleep, so its waker skips the
# wake syscall and neither side pays the kernel's wake-up (about half of a
# short round trip). Never on one CPU, where a spinner only delays the other
# side. Read at import, before a batcher pins itself.
SPIN_NS = 50_000 if len(os.sched_getaffinity(0)) > 1 else 0
spin_ns = lib.sb_spin_ns  # busy-waits in C, without the GIL
NO_FIT = ffi.NULL  # a batch that feeds no fit


def pingpong(shared, side: int, rounds: int, spin_ns: int, out=None) -> int:
    """A raw futex ping-pong on the first word of `shared` (a buffer both
    processes map): side 0 starts each round and writes each round trip's ns
    into `out` (uint64), side 1 answers. The rounds done."""
    into = ffi.NULL if out is None else ffi.from_buffer("uint64_t[]", out)
    return lib.sb_pingpong(ffi.from_buffer(shared), side, rounds, spin_ns, into)


def new_fit(warmup: int = 0):
    """A service-time fit (sb_fit), zeroed, skipping its first `warmup` batches."""
    fit = ffi.new("sb_fit *")
    fit.warmup = warmup
    return fit


fit_add = lib.sb_fit_add
refuses = lib.sb_refuses  # (wait_ns, left_ns): admission's rule, the C's


def layout_bytes(capacity: int, inputs: int, slot_bytes, in_place: bool, levels: int = 1,
                 steps: int = 0) -> int:
    """The segment's size for tensors of slot_bytes each (the first `inputs`
    of them inputs; steps: an iterative engine's chunks per slot); 0 if the C
    refuses the layout."""
    table = ffi.new("uint64_t[]", [int(b) for b in slot_bytes])
    return lib.sb_layout_bytes(capacity, len(slot_bytes), inputs, table, in_place, levels, steps)


def _ptr(array: np.ndarray, ctype: str):
    # a typed view of the array's own buffer: ~0.3 us, where .ctypes costs ~2 us
    return ffi.from_buffer(ctype.replace(" *", "[]"), array)


class ClaimBuffers:
    """A batcher's claim arrays, made once with their C pointers (each
    pointer costs ~0.3 us to make; a batch would need seven)."""

    def __init__(self, capacity: int, max_batch: int):
        self.slots = np.zeros(max_batch, np.uint32)
        self.gens = np.zeros(max_batch, np.uint32)
        self.lengths = np.zeros(max_batch, np.uint32)
        self.scratch = np.zeros(4 * capacity, np.uint64)  # 4 u64 an entry: one per slot
        self.c_slots, self.c_gens = _ptr(self.slots, "uint32_t *"), _ptr(self.gens, "uint32_t *")
        self.c_lengths = _ptr(self.lengths, "uint32_t *")
        self.c_scratch = _ptr(self.scratch, "uint64_t *")
        self.scratch_n = capacity
        self.c_report = ffi.new("uint64_t[5]")
        self.c_shape = ffi.NULL  # no batch shapes: the flush rule's count alone
        self.bucket = 0  # the length bucket of the last claim (with a shape)

    def set_shape(self, bounds=(), most=(), take=()) -> None:
        """The batch shapes the claim may form (policy.BatchShapes): length
        bucket bounds with at most most[b] requests a batch, and a take table."""
        shape = ffi.new("sb_shape *")
        shape.buckets = len(bounds)
        for b, (bound, n) in enumerate(zip(bounds, most)):
            shape.bound[b], shape.most[b] = bound, n
        shape.takes = len(take)
        for r, n in enumerate(take):
            shape.take[r] = n
        self.c_shape = shape


class Ring:
    """The C ring over one mapping (an mmap of the segment), through this
    process's own sb_ring (filled by init, attach or attach_header)."""

    def __init__(self, mapping):
        self._mapping = mapping
        self._base_buf = ffi.from_buffer(mapping)
        self.r = ffi.new("sb_ring *")
        self._tls = threading.local()

    def release(self) -> None:
        """Drops the buffer export, so that the mmap can be closed (and the
        socket this process sent asyncio wakes from, if any)."""
        lib.sb_wake_close(self.r)
        if self._base_buf is not None:
            self.r.base = ffi.NULL
            ffi.release(self._base_buf)
            self._base_buf = None

    # -- setup ------------------------------------------------------------
    def init(self, total_bytes, capacity, max_batch, inputs, slot_bytes, in_place, levels,
             steps, incarnation):
        table = ffi.new("uint64_t[]", [int(b) for b in slot_bytes])
        return lib.sb_init(self.r, self._base_buf, total_bytes, capacity, max_batch,
                           len(slot_bytes), inputs, table, in_place, levels, steps, incarnation)

    def attach(self, mapped_bytes: int) -> int:
        """Fills this process's geometry from the header, checked (OK,
        ECORRUPT or EVERSION)."""
        return lib.sb_attach(self.r, self._base_buf, mapped_bytes)

    def attach_header(self, mapped_bytes: int) -> int:
        """The header alone (magic, version): no slots, capacity 0."""
        return lib.sb_attach_header(self.r, self._base_buf, mapped_bytes)

    @property
    def geometry(self):
        """This process's sb_ring (capacity, levels, off_tensor[t], ...): every bound's source."""
        return self.r

    def corrupt_seen(self) -> int:
        """How many values from the segment this process found failing a check."""
        return self.r.corrupt

    def corrupt_total(self) -> int:
        """... and every process of the engine, summed (in the segment)."""
        return lib.sb_corrupt_total(self.r)

    def restore_header(self) -> int:
        """The creator's geometry written back over the header's; how many fields changed."""
        return lib.sb_restore_header(self.r)

    def word(self, word: int) -> int:
        return lib.sb_word_get(self.r, word)

    def set_word(self, word: int, value: int) -> None:
        lib.sb_word_set(self.r, word, value)

    def add_word(self, word: int, delta: int = 1) -> None:
        lib.sb_word_add(self.r, word, delta)

    def header_words(self) -> memoryview:
        """The header's words (W_*) as u64s, for what reads or stamps some per
        request or batch: an index is one aligned load or store, with no C call
        and no numpy scalar (~50 ns, where int(array[i]) costs ~180). It holds
        the mapping: views must be dropped before the segment closes."""
        return memoryview(self._mapping)[codes.OFF_WORDS:codes.OFF_WORDS + codes.WORDS * 8].cast("Q")

    def header_words2(self) -> memoryview:
        """The words from W_WITHDRAWN on (the header's second block), as header_words."""
        return memoryview(self._mapping)[codes.OFF_WORDS2:codes.OFF_WORDS2 +
                                         (codes.WORDS_ALL - codes.WORDS) * 8].cast("Q")

    def batch_figures(self):
        """(service ns summed by batch size, sizes from BATCH_NS_SIZES - 1 on
        in the last; when the latest batch or step ended, monotonic ns, 0 for
        none), copied out of the header."""
        start, words = codes.OFF_BATCH_FIGURES, codes.BATCH_NS_SIZES + 1
        with memoryview(self._mapping) as whole, whole[start:start + words * 8] as part, \
                part.cast("Q") as view:
            values = view.tolist()
        return values[:-1], values[-1]

    # -- client -----------------------------------------------------------
    def _buffer(self, name: str, ctype: str):
        out = getattr(self._tls, name, None)
        if out is None:  # one buffer per thread: ffi.new per call costs ~1 us
            out = ffi.new(ctype)
            setattr(self._tls, name, out)
        return out

    def acquire(self, pid: int, start_ticks: int):
        """(code, slot, generation)."""
        out = self._buffer("ticket", "uint32_t[2]")
        code = lib.sb_acquire(self.r, pid, start_ticks, out, out + 1)
        return code, out[0], out[1]

    def submit(self, pid: int, start_ticks: int, row: np.ndarray, length: int,
               deadline_ns: int = 0, priority: int = 0, admit: bool = False):
        """acquire + copy the C-contiguous row into the slot + publish, in
        one call: (code, slot, generation)."""
        out = self._buffer("ticket", "uint32_t[2]")
        code = lib.sb_submit(self.r, pid, start_ticks, ffi.from_buffer(row), row.nbytes,
                             length, deadline_ns, priority, admit, out)
        return code, out[0], out[1]

    def take(self, slot: int, gen: int, timeout_ns: int, spin_ns: int, out: np.ndarray) -> int:
        """wait_slot, then on OK copy the output row into out and release."""
        return lib.sb_take(self.r, slot, gen, timeout_ns, spin_ns, ffi.from_buffer(out),
                           out.nbytes, ffi.NULL)

    def take_timed(self, slot: int, gen: int, out: np.ndarray):
        """take() with no wait; (code, (arrival_ns, claim_ns, done_ns,
        batch_size)) of the request (T_*), the stamps valid when code is OK."""
        times = self._buffer("times", "uint64_t[4]")
        code = lib.sb_take(self.r, slot, gen, 0, 0, ffi.from_buffer(out), out.nbytes, times)
        return code, tuple(ffi.unpack(times, 4))  # [T_ARRIVAL, T_CLAIM, T_DONE, T_BATCH]

    def slot_times(self, slot: int, gen: int):
        """A published ticket's stamps (as take_timed's, 0 where not
        stamped) read before its release; None when it is not the ticket's."""
        times = self._buffer("times", "uint64_t[4]")
        if lib.sb_slot_times(self.r, slot, gen, times) != codes.OK:
            return None
        return tuple(ffi.unpack(times, 4))

    def acquire_many(self, pid, start_ticks, n, slots, gens) -> int:
        """Takes up to n free slots into the uint32 arrays; returns how many."""
        return lib.sb_acquire_many(self.r, pid, start_ticks, n, _ptr(slots, "uint32_t *"),
                                   _ptr(gens, "uint32_t *"))

    def publish_many(self, slots, gens, n, length, deadline_ns: int = 0, priority: int = 0) -> int:
        return lib.sb_publish_many(self.r, _ptr(slots, "uint32_t *"), _ptr(gens, "uint32_t *"),
                                   n, length, deadline_ns, priority)

    def wait_all(self, slots, gens, n, timeout_ns, spin_ns=0) -> int:
        return lib.sb_wait_all(self.r, _ptr(slots, "uint32_t *"), _ptr(gens, "uint32_t *"),
                               n, timeout_ns, spin_ns)

    def release_many(self, slots, gens, n) -> int:
        return lib.sb_release_many(self.r, _ptr(slots, "uint32_t *"), _ptr(gens, "uint32_t *"), n)

    def publish(self, slot: int, gen: int, length: int, deadline_ns: int = 0,
                priority: int = 0) -> int:
        """READY, with its attributes: real length, deadline (0: none), priority."""
        return lib.sb_publish(self.r, slot, gen, length, deadline_ns, priority)

    def admission_figures(self, max_priority: int):
        """(queued at <= max_priority, fit fixed_ns, fit per-item ps, batch
        limit, busy_since_ns: 0 if a batcher is idle), in one call."""
        out = self._buffer("figures", "uint64_t[5]")
        lib.sb_admission_figures(self.r, max_priority, 1, out)
        return ffi.unpack(out, 5)

    def predicted_wait_ns(self, priority: int, now_ns: int) -> int:
        return lib.sb_predicted_wait_ns(self.r, priority, now_ns)

    def admit(self, priority: int, deadline_ns: int):
        """Admission by deadline for a request of this priority now: (OK, 0),
        or (EOVERLOADED, the predicted wait in ms), counted."""
        out = self._buffer("ticket", "uint32_t[2]")
        code = lib.sb_admit(self.r, priority, deadline_ns, out)
        return code, out[0]

    def queued(self, max_priority: int) -> int:
        """How many requests are READY at priority max_priority or more urgent."""
        return lib.sb_queued(self.r, max_priority)

    def cancel(self, slot: int, gen: int) -> int:
        return lib.sb_cancel(self.r, slot, gen)

    def wait_slot(self, slot: int, gen: int, timeout_ns: int, spin_ns: int = 0) -> int:
        """Waits for the ticket's answer: spins up to spin_ns, then sleeps."""
        return lib.sb_wait_slot(self.r, slot, gen, timeout_ns, spin_ns)

    def await_slot(self, slot: int, gen: int, waker: int) -> int:
        """Marks the ticket awaited by the asyncio loop of wake id waker (0:
        none); returns wait_slot's code without waiting."""
        return lib.sb_await_slot(self.r, slot, gen, waker)

    def release_slot(self, slot: int, gen: int) -> int:
        return lib.sb_release(self.r, slot, gen)

    def abandon(self, slot: int, gen: int) -> int:
        return lib.sb_abandon(self.r, slot, gen)

    def poll(self, slots: np.ndarray, gens: np.ndarray, states: np.ndarray) -> int:
        """Fills states (int32) with each ticket's answer code; returns how many pend."""
        return lib.sb_poll(self.r, _ptr(slots, "uint32_t *"), _ptr(gens, "uint32_t *"),
                           len(slots), _ptr(states, "int32_t *"))

    def slot_error(self, slot: int):
        """(status, message) of a FAILED slot."""
        buf = ffi.new("char[]", codes.ERRMSG_BYTES)
        length = ffi.new("uint32_t *")
        status = lib.sb_slot_error(self.r, slot, buf, codes.ERRMSG_BYTES, length)
        return status, ffi.unpack(buf, length[0]).decode("utf-8", "replace")

    def acquire_wait(self, pid: int, start_ticks: int, timeout_ns: int):
        """acquire(), sleeping up to timeout_ns until a slot is freed:
        (code, slot, generation), code EFULL if none was."""
        out = self._buffer("ticket", "uint32_t[2]")
        code = lib.sb_acquire_wait(self.r, pid, start_ticks, timeout_ns, out, out + 1)
        return code, out[0], out[1]

    def request_evict(self) -> None:
        """Asks every client process to move its answered slots out of the ring."""
        lib.sb_request_evict(self.r)

    def evict_seq(self) -> int:
        return lib.sb_evict_seq(self.r)

    def wait_evict(self, seen: int, timeout_ns: int) -> int:
        return lib.sb_wait_evict(self.r, seen, timeout_ns)

    def wake_done(self) -> None:
        """Wakes the async waiters of requests settled outside a finished batch."""
        lib.sb_wake_done(self.r)

    def done_seq(self) -> int:
        return lib.sb_done_seq(self.r)

    def wait_done_seq(self, seen: int, timeout_ns: int) -> int:
        return lib.sb_wait_done_seq(self.r, seen, timeout_ns)

    # -- batcher ----------------------------------------------------------
    def work_seq(self) -> int:
        return lib.sb_work_seq(self.r)

    def wait_work(self, seen: int, timeout_ns: int, spin_ns: int = 0) -> int:
        """Waits for work_seq to leave seen: spins up to spin_ns, then sleeps."""
        return lib.sb_wait_work(self.r, seen, timeout_ns, spin_ns)

    def wake_work(self) -> None:
        lib.sb_wake_work(self.r)

    def expect_work(self) -> None:
        """Wakes a sleeping batcher ahead of a request about to be published."""
        lib.sb_expect_work(self.r)

    def batchers_sleeping(self) -> int:
        """How many batchers sleep for work now (a hint: it may change at once)."""
        return lib.sb_batchers_sleeping(self.r)

    def claim(self, batcher: int, max_n: int, flush_n: int, cutoff_ns: int, batch: ClaimBuffers,
              expire_ns: int = 0):
        """Fails unstarted the READY requests whose deadline is before expire_ns;
        then claims up to max_n READY slots (most urgent level, then oldest,
        first) into batch.slots/gens/lengths (ascending slot order) if flush_n
        are READY or the oldest arrived by cutoff_ns; returns (claimed,
        claim_ns, ready, oldest_ns, expired)."""
        n = lib.sb_claim(self.r, batcher, max_n, flush_n, cutoff_ns, expire_ns,
                         batch.c_shape, batch.c_scratch, batch.scratch_n, batch.c_slots,
                         batch.c_gens, batch.c_lengths, batch.c_report)
        report = batch.c_report
        batch.bucket = report[codes.R_BUCKET]
        return (n, report[codes.R_CLAIM_NS], report[codes.R_READY], report[codes.R_OLDEST_NS],
                report[codes.R_EXPIRED])

    def claimed_ranks(self, slots: np.ndarray, levels: np.ndarray, arrivals: np.ndarray) -> None:
        """Fills levels (uint32) and arrivals (uint64) of claimed slots (uint32)."""
        lib.sb_claimed_ranks(self.r, _ptr(slots, "uint32_t *"), len(slots),
                             _ptr(levels, "uint32_t *"), _ptr(arrivals, "uint64_t *"))

    def complete(self, batcher: int, batch: ClaimBuffers, n: int, status=0,
                 message: bytes = b"") -> int:
        """Answers batch.slots[:n] (DONE, or FAILED with message); returns how
        many reached a waiting client (the others were abandoned or stale)."""
        return lib.sb_complete(self.r, batcher, batch.c_slots, batch.c_gens, n, status,
                               message, len(message))

    def complete_some(self, batcher: int, slots: np.ndarray, gens: np.ndarray, status: int,
                      message: bytes) -> int:
        """complete() for some of a batch's slots (uint32 arrays of one length)."""
        slots, gens = np.ascontiguousarray(slots), np.ascontiguousarray(gens)
        return lib.sb_complete(self.r, batcher, _ptr(slots, "uint32_t *"),
                               _ptr(gens, "uint32_t *"), len(slots), status, message, len(message))

    def finish_batch(self, batch: ClaimBuffers, n, claim_ns, done_ns, zero_copy: bool,
                     fit=ffi.NULL) -> int:
        """The batch's figures; with a ServiceFit's c_fit, also the fit (1: solved
        anew and published for admission)."""
        return lib.sb_finish_batch(self.r, batch.c_slots, n, claim_ns, done_ns, zero_copy, fit)

    # -- streams (an iterative engine) --------------------------------------
    def stream_open(self, slot: int, gen: int, max_steps: int) -> int:
        """While WRITING: the request's own bound on its chunks (0: the engine's)."""
        return lib.sb_stream_open(self.r, slot, gen, max_steps)

    def wait_chunks(self, slot: int, gen: int, seen: int, timeout_ns: int, spin_ns: int = 0):
        """(code, chunk word): OK once the word is not `seen` or the slot is
        settled; the word counts the chunks written (| CHUNKS_END when final)."""
        out = self._buffer("chunks", "uint32_t[1]")
        code = lib.sb_wait_chunks(self.r, slot, gen, seen, timeout_ns, spin_ns, out)
        return code, out[0]

    def poll_chunks(self, slots: np.ndarray, gens: np.ndarray, seen: np.ndarray,
                    moved: np.ndarray) -> int:
        """Sets moved[k] (uint8) where wait_chunks(slots[k], gens[k], seen[k], 0)
        would not time out, in one pass; returns how many."""
        return lib.sb_poll_chunks(self.r, _ptr(slots, "uint32_t *"), _ptr(gens, "uint32_t *"),
                                  _ptr(seen, "uint32_t *"), len(slots), _ptr(moved, "uint8_t *"))

    def stream_limits(self, slots: np.ndarray, max_steps: np.ndarray,
                      deadlines: np.ndarray) -> None:
        """Each claimed slot's own bound on its chunks (uint32, within [1,
        steps]) and deadline (uint64 ns, 0: none)."""
        lib.sb_stream_limits(self.r, _ptr(slots, "uint32_t *"), len(slots),
                             _ptr(max_steps, "uint32_t *"), _ptr(deadlines, "uint64_t *"))

    def stream_put(self, batcher: int, slots: np.ndarray, gens: np.ndarray, counts: np.ndarray,
                   ends: np.ndarray, states: np.ndarray) -> int:
        """Publishes counts[k] chunks of slots[k], with ends[k] (0, or
        CHUNKS_END | CHUNKS_STOP or CHUNKS_LIMIT: completed) (uint32 arrays);
        states (int32) receives each slot's state (CLAIMED, ABANDONED, or -1:
        not ours)."""
        return lib.sb_stream_put(self.r, batcher, _ptr(slots, "uint32_t *"),
                                 _ptr(gens, "uint32_t *"), len(slots), _ptr(counts, "uint32_t *"),
                                 _ptr(ends, "uint32_t *"), _ptr(states, "int32_t *"))

    def finish_step(self, joined: np.ndarray, active: int, start_ns: int, done_ns: int,
                    fit=ffi.NULL) -> int:
        """A step's figures (joined: the slots it joined, uint32); with a fit, 1
        when solved anew and published for admission."""
        return lib.sb_finish_step(self.r, _ptr(joined, "uint32_t *"), len(joined), active,
                                  start_ns, done_ns, fit)

    def set_active(self, batcher: int, active: int, room_steps: int = 0) -> None:
        """Its running batch size, and the steps until it has room (0: now)."""
        lib.sb_set_active(self.r, batcher, active, room_steps)

    def stream_counts(self):
        """(steps, chunks, requests in the running batches)."""
        out = self._buffer("stream_counts", "uint64_t[3]")
        lib.sb_stream_counts(self.r, out)
        return tuple(ffi.unpack(out, 3))

    def stream_times(self, which: int):
        """(sum_ns, max_ns) of H_TTFT's, H_CHUNK's or H_E2E's times."""
        out = self._buffer("stream_times", "uint64_t[2]")
        lib.sb_stream_times(self.r, which, out, out + 1)
        return out[0], out[1]

    # -- reaper -----------------------------------------------------------
    def snapshot(self, ctl: np.ndarray, owner_start: np.ndarray) -> int:
        """Every slot's ctl and owner start, as many as the arrays hold;
        returns how many were written."""
        return lib.sb_snapshot(self.r, _ptr(ctl, "uint64_t *"), _ptr(owner_start, "uint64_t *"),
                               min(len(ctl), len(owner_start)))

    def reap_slot(self, slot: int, expected_ctl: int) -> int:
        return lib.sb_reap_slot(self.r, slot, expected_ctl)

    def reap_batcher(self, batcher: int, message: bytes, retry: bool = False,
                     begun: bytes = b""):
        """A dead batcher's claimed slots: (failed, kept). With retry, each not
        already being retried alone (nor a stream that had begun) is kept
        CLAIMED for its successor. Begun streams fail with `begun` (default:
        message)."""
        kept = ffi.new("uint32_t *")
        begun = begun or message
        failed = lib.sb_reap_batcher(self.r, batcher, retry, message, len(message), begun,
                                     len(begun), kept)
        return failed, kept[0]

    def inherit(self, batcher: int, expire_ns: int, capacity: int):
        """What a dead predecessor left under this batcher number (sb_inherit):
        withdrawn slots freed, expired ones failed, the rest as (slots, gens,
        lengths), ascending."""
        slots, gens, lengths = (np.zeros(capacity, np.uint32) for _ in range(3))
        n = lib.sb_inherit(self.r, batcher, expire_ns, capacity, _ptr(slots, "uint32_t *"),
                           _ptr(gens, "uint32_t *"), _ptr(lengths, "uint32_t *"))
        return slots[:n], gens[:n], lengths[:n]

    def retry_alone(self, batcher: int, slot: int, gen: int) -> int:
        return lib.sb_retry_alone(self.r, batcher, slot, gen)

    def level_wait(self, level: int):
        """(histogram, max_ns, sum_ns) of the queue wait of one priority level."""
        out = np.zeros(codes.HIST_BUCKETS, dtype=np.uint64)
        sums = ffi.new("uint64_t[2]")
        lib.sb_level_wait(self.r, level, _ptr(out, "uint64_t *"), sums, sums + 1)
        return out, sums[1], sums[0]

    def histogram(self, which: int) -> np.ndarray:
        out = np.zeros(codes.HIST_BUCKETS, dtype=np.uint64)
        lib.sb_histogram(self.r, which, _ptr(out, "uint64_t *"))
        return out


def ctl_state(ctl: np.ndarray) -> np.ndarray:
    """The state field of control words (vectorised; ring.h's bit layout)."""
    return ctl & np.uint64(codes.STATE_MASK)


def ctl_pid(ctl: np.ndarray) -> np.ndarray:
    return (ctl >> np.uint64(codes.PID_SHIFT)) & np.uint64(codes.PID_MASK)


def hist_bounds_ns():
    """(lower, upper) of each time histogram bucket in ns, as csrc/stats.c buckets them
    (the last bucket's upper edge: where the next would start)."""
    lower = np.array([lib.sb_bucket_lower_ns(b) for b in range(codes.HIST_BUCKETS)], np.float64)
    top = float(lower[-1] + (lower[-1] - lower[-2]))
    return lower, np.append(lower[1:], top)
