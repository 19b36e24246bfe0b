/*
 * segment.h - private to csrc/: the segment's structs as ring.h draws them,
 * the addressing of slots through a process's own sb_ring, and the steps
 * that several roles share.
 *
 * The rule of every file that includes this: geometry (capacity, levels,
 * tensor counts, offsets, row sizes) comes from the sb_ring, filled once by
 * setup.c; the segment's own copy of it is read by setup.c alone. A value
 * read from the segment is data: a field that becomes an index, a length,
 * a shift or a divisor is loaded once (relaxed atomic: no re-fetch after
 * the check) and checked against a private bound; one that fails is counted
 * (corrupt()) and nothing is derived from it.
 *
 * The includes point down: every .c but futex.c includes this; this
 * includes futex.h (the clock, futex calls and sequence words, which know
 * nothing of the segment), atomics.h and ring.h, none of which includes it.
 */
#ifndef SB_SEGMENT_H
#define SB_SEGMENT_H

#define _GNU_SOURCE
#include "ring.h"
#include "atomics.h"
#include "futex.h" /* the clock and the futex calls below the segment */

#include <stddef.h>
#include <stdint.h>

#define SB_MAGIC 0x48435441424d4853ull /* "SHMBATCH" as little-endian bytes */

#define SB_WAITING_BIT 0x10ull
#define SB_BATCH_NS_SIZES 63
#define SB_OFF_BATCH_FIGURES 19968
#define SB_CTL(gen, pid, batcher, state)                                       \
	(((uint64_t)(gen) << 32) | ((uint64_t)(pid) << SB_PID_SHIFT) |         \
	 ((uint64_t)(batcher) << SB_BATCHER_SHIFT) | (uint64_t)(state))
#define SB_CTL_STATE(c) ((uint32_t)((c) & SB_STATE_MASK))
#define SB_CTL_BATCHER(c) ((uint32_t)(((c) >> SB_BATCHER_SHIFT) & SB_BATCHER_MASK))
#define SB_CTL_PID(c) ((uint32_t)(((c) >> SB_PID_SHIFT) & SB_PID_MASK))
#define SB_CTL_GEN(c) ((uint32_t)((c) >> 32))

typedef struct {
	uint64_t magic;
	uint32_t layout_version;
	uint32_t header_bytes;
	uint64_t incarnation;
	uint32_t capacity;
	uint32_t max_batch;
	uint32_t tensors;     /* regions of rows: the inputs, then the outputs */
	uint32_t inputs;
	uint64_t slot_bytes;  /* one slot's rows of every tensor, summed */
	uint64_t total_bytes;
	uint32_t in_place;    /* 1: the output region is the input's */
	uint32_t levels;      /* priority levels: ready[] has one bitmap each */
	uint64_t off_ctl, off_meta, off_errmsg, off_lengths, off_stream, off_ready;
	uint32_t steps;       /* an iterative engine's chunks per slot; 0: one-shot */
	uint32_t _pad1;
	uint64_t off_waker;
	char config[SB_CONFIG_BYTES];
	/* each futex word on its own cache line: clients and batchers both
	 * write them, and they must not false-share with the counters */
	uint32_t work_seq, batchers_sleeping, _pad2[14];
	uint32_t done_seq, done_waiters, _pad3[14];
	uint32_t alloc_hint, _pad4[15];
	uint64_t words[SB_WORDS];
	uint64_t hist[3][SB_HIST_BUCKETS];
	uint32_t free_seq, free_waiters, _pad5[14];
	uint32_t evict_seq, evictors, _pad6[14];
	uint64_t level_wait_sum[SB_MAX_PRIORITIES];
	uint64_t level_wait_max[SB_MAX_PRIORITIES];
	uint64_t off_tensor[SB_MAX_TENSORS];
	uint64_t tensor_slot_bytes[SB_MAX_TENSORS];
	uint64_t corrupt_total; /* every process's corrupt() counts, summed */
	uint64_t _pad7[(7040 - 6984) / 8];
	uint64_t words2[SB_WORDS_ALL - SB_WORDS]; /* SB_W_* from SB_WORDS on */
	uint64_t _pad7b[(8192 - 7552) / 8];
	uint64_t level_hist[SB_MAX_PRIORITIES][SB_HIST_BUCKETS];
	uint64_t steps_total, chunks_total;
	uint64_t stream_sum[2], stream_max[2]; /* ns: time to first chunk, between chunks */
	uint64_t e2e_sum, e2e_max; /* ns: arrival to end (SB_H_E2E) */
	uint64_t active[SB_MAX_INSTANCES]; /* each batcher's running batch: its own word */
	uint64_t _pad9[(16896 - 16704) / 8];
	uint64_t stream_hist[2][SB_HIST_BUCKETS]; /* time to first chunk, between chunks */
	uint64_t e2e_hist[SB_HIST_BUCKETS]; /* a request's arrival to its end */
	/* for Triton's statistics: service ns summed by batch size (sizes from
	 * SB_BATCH_NS_SIZES - 1 on in the last), and when the latest batch (or
	 * step) ended. Beside ring.h's figures, which is at its cap: Python reads
	 * them at SB_OFF_BATCH_FIGURES (engine/shm/codes.py). */
	uint64_t batch_ns[SB_BATCH_NS_SIZES];
	uint64_t last_done_ns;
} sb_header;

/* An iterative engine's slot: how many of its chunks are written. chunks
 * is the futex word its client follows; only the slot's batcher writes it
 * while CLAIMED (SB_CHUNKS_END and why with the last count of a request it
 * completes; SB_CHUNKS_END alone when it fails or frees the slot), its
 * client resets it while WRITING. */
typedef struct {
	uint32_t chunks;      /* chunks written (SB_CHUNKS_COUNT), | how it ended */
	uint32_t waiters;     /* clients asleep on chunks */
	uint32_t max_steps;   /* the request's own bound (0: the engine's), set while WRITING */
	uint32_t batch_size;  /* the batcher's: its running batch at the first chunk */
	uint64_t last_ns;     /* the batcher's: when it wrote the last chunk (0: none yet) */
	uint64_t _pad2[5];
} sb_slot_stream;

typedef struct {
	uint64_t arrival_ns;  /* CLOCK_MONOTONIC, stamped at publish */
	uint64_t owner_start; /* owner's start time (/proc ticks), vs pid reuse */
	uint64_t claim_ns;    /* when a batcher claimed it */
	uint32_t owner_pid;
	uint32_t length;      /* real length of the variable dim, else 0 */
	uint16_t status;      /* SB_STATUS_* of a FAILED slot */
	uint16_t errmsg_len;  /* <= SB_ERRMSG_BYTES */
	uint32_t batch_size;  /* requests answered with it, set before DONE/FAILED; 0: none
			       * (failed unstarted, its batcher died, or a stream: see
			       * sb_slot_stream) */
	uint64_t done_ns;     /* when its batch finished, set before DONE/FAILED */
	uint64_t deadline_ns; /* CLOCK_MONOTONIC; 0: none */
	uint16_t priority;    /* its level: 0 is the most urgent */
	uint16_t retry;       /* SB_RETRY_*: retried alone since its batcher died */
	uint32_t predicted_us; /* the wait admission predicted for it (0: none counted) */
} sb_slot_meta;

_Static_assert(sizeof(sb_header) == SB_HEADER_BYTES, "the header is its region");
_Static_assert(offsetof(sb_header, incarnation) == 16, "layout drawing");
_Static_assert(offsetof(sb_header, capacity) == 24, "layout drawing");
_Static_assert(offsetof(sb_header, total_bytes) == 48, "layout drawing");
_Static_assert(offsetof(sb_header, in_place) == 56, "layout drawing");
_Static_assert(offsetof(sb_header, off_ctl) == 64, "layout drawing");
_Static_assert(offsetof(sb_header, off_lengths) == 88, "layout drawing");
_Static_assert(offsetof(sb_header, off_ready) == 104, "layout drawing");
_Static_assert(offsetof(sb_header, config) == SB_OFF_CONFIG, "layout drawing");
_Static_assert(offsetof(sb_header, work_seq) == 2176, "layout drawing");
_Static_assert(offsetof(sb_header, done_seq) == 2240, "layout drawing");
_Static_assert(offsetof(sb_header, alloc_hint) == 2304, "layout drawing");
_Static_assert(offsetof(sb_header, words) == SB_OFF_WORDS, "layout drawing");
_Static_assert(offsetof(sb_header, hist) == 3392, "layout drawing");
_Static_assert(offsetof(sb_header, free_seq) == 6464, "layout drawing");
_Static_assert(offsetof(sb_header, evict_seq) == 6528, "layout drawing");
_Static_assert(offsetof(sb_header, level_wait_sum) == 6592, "layout drawing");
_Static_assert(offsetof(sb_header, level_wait_max) == 6656, "layout drawing");
_Static_assert(offsetof(sb_header, off_tensor) == 6720, "layout drawing");
_Static_assert(offsetof(sb_header, tensor_slot_bytes) == 6848, "layout drawing");
_Static_assert(offsetof(sb_header, corrupt_total) == 6976, "layout drawing");
_Static_assert(offsetof(sb_header, words2) == 7040, "layout drawing");
_Static_assert(offsetof(sb_header, off_stream) == 96, "layout drawing");
_Static_assert(offsetof(sb_header, steps) == 112, "layout drawing");
_Static_assert(offsetof(sb_header, off_waker) == 120, "layout drawing");
_Static_assert(offsetof(sb_header, level_hist) == 8192, "layout drawing");
_Static_assert(offsetof(sb_header, batch_ns) == SB_OFF_BATCH_FIGURES, "layout drawing");
_Static_assert(offsetof(sb_header, last_done_ns) == SB_OFF_BATCH_FIGURES + 8 * SB_BATCH_NS_SIZES,
	       "layout drawing");
_Static_assert(offsetof(sb_header, steps_total) == 16384, "layout drawing");
_Static_assert(offsetof(sb_header, active) == 16448, "layout drawing");
_Static_assert(offsetof(sb_header, stream_hist) == 16896, "layout drawing");
_Static_assert(sizeof(sb_slot_stream) == 64, "one cache line per slot");
_Static_assert(sizeof(sb_slot_meta) == 64, "one cache line per slot");
_Static_assert(offsetof(sb_slot_meta, batch_size) == 36, "the offsets tests poke");
_Static_assert(SB_ERRMSG_BYTES <= UINT16_MAX && SB_STATUS_CORRUPT <= UINT16_MAX,
	       "errmsg_len and status are u16");
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
	       "the futex word is the low half of ctl at its own address");

/* sb_slot_meta.retry: reset by publish (WRITING, the owner's), set only by
 * a dead batcher's successor while the slot is CLAIMED by it, read by the
 * reaper alone. A request whose batch killed its batcher is retried once,
 * alone; killing one again then, it fails as poison */
#define SB_RETRY_NONE 0
#define SB_RETRY_ALONE 1 /* being retried alone */

/* ---- addressing: the base plus offsets from the process's own sb_ring;
 * callers have checked slot < r->capacity and level < r->levels ---- */

static inline sb_header *hdr(const sb_ring *r) { return (sb_header *)r->base; }

/* SB_W_* word `word` (< SB_WORDS_ALL: the caller checks), in either block */
static inline uint64_t *word_at(const sb_ring *r, uint32_t word)
{
	return word < SB_WORDS ? &hdr(r)->words[word] : &hdr(r)->words2[word - SB_WORDS];
}

static inline uint64_t *ctl_at(const sb_ring *r, uint32_t slot)
{
	return (uint64_t *)(r->base + r->off_ctl) + slot;
}

static inline sb_slot_meta *meta_at(const sb_ring *r, uint32_t slot)
{
	return (sb_slot_meta *)(r->base + r->off_meta) + slot;
}

static inline uint64_t *ready_word(const sb_ring *r, uint32_t level, uint32_t word)
{
	return (uint64_t *)(r->base + r->off_ready) + (uint64_t)level * r->ready_words + word;
}

static inline sb_slot_stream *stream_at(const sb_ring *r, uint32_t slot)
{
	return (sb_slot_stream *)(r->base + r->off_stream) + slot;
}

/* gen << 32 | the wake id of the asyncio loop awaiting the slot (0: none) */
static inline uint64_t *waker_at(const sb_ring *r, uint32_t slot)
{
	return (uint64_t *)(r->base + r->off_waker) + slot;
}

static inline char *errmsg_at(const sb_ring *r, uint32_t slot)
{
	return r->base + r->off_errmsg + (uint64_t)slot * SB_ERRMSG_BYTES;
}

static inline char *tensor_row(const sb_ring *r, uint32_t t, uint32_t slot)
{
	return r->base + r->off_tensor[t] + (uint64_t)slot * r->tensor_slot_bytes[t];
}

static inline uint32_t *futex_word(uint64_t *ctl) { return (uint32_t *)ctl; }

static inline uint64_t ready_bit(uint32_t slot) { return 1ull << (slot % 64); }

static inline uint64_t freed(uint64_t cur)
{
	return SB_CTL(SB_CTL_GEN(cur) + 1, 0, 0, SB_FREE);
}

static inline uint64_t with_state(uint64_t cur, uint32_t state)
{
	return (cur & ~SB_STATE_MASK) | state;
}

/* What withdrawing a request makes of its slot's control word: a queued one
 * (READY) is freed, and so is one written or answered (WRITING, DONE,
 * FAILED) when its owner is dead; a CLAIMED one becomes ABANDONED, which its
 * batcher frees. 0: none of these, nothing to withdraw. */
static inline uint64_t withdrawn(uint64_t cur, int owner_dead)
{
	switch (SB_CTL_STATE(cur)) {
	case SB_READY:
		return freed(cur);
	case SB_WRITING:
	case SB_DONE:
	case SB_FAILED:
		return owner_dead ? freed(cur) : 0;
	case SB_CLAIMED: /* a batcher may still write the output row */
		return with_state(cur & ~SB_WAITING_BIT, SB_ABANDONED);
	}
	return 0;
}

/* A value read from the segment failed its check: counted here, in this
 * process (r->corrupt) and for everyone (the header's corrupt_total).
 * relaxed: counts, ordered with nothing */
static inline void corrupt(sb_ring *r)
{
	sb_add_relaxed(&r->corrupt, 1);
	sb_add_relaxed(&hdr(r)->corrupt_total, 1);
}

/* relaxed: the bitmap is a hint ordered by the CAS on ctl beside each use
 * (ring.h, THE READY BITMAP): publish's release CAS comes after the set,
 * claim's acquire CAS before the clear, abandon's and reap's release CAS
 * after theirs */
static inline void mark_ready(const sb_ring *r, uint32_t level, uint32_t slot)
{
	sb_or_relaxed(ready_word(r, level, slot / 64), ready_bit(slot));
}

static inline void clear_ready(const sb_ring *r, uint32_t level, uint32_t slot)
{
	sb_and_relaxed(ready_word(r, level, slot / 64), ~ready_bit(slot));
}

/* A READY slot's level is its meta's priority, set before READY. Read from
 * the segment, it is checked: out of range, the bit is cleared at every
 * level (only a READY slot WITHOUT its bit would be harmful, and the caller
 * holds the slot against a new publish until its CAS). */
static inline void unmark_ready(sb_ring *r, uint32_t slot)
{
	uint32_t level = sb_load_relaxed(&meta_at(r, slot)->priority);
	if (level < r->levels) {
		clear_ready(r, level, slot);
		return;
	}
	corrupt(r);
	for (level = 0; level < r->levels; level++)
		clear_ready(r, level, slot);
}

static inline int64_t remaining_ns(uint64_t deadline_ns)
{
	uint64_t now = sb_now_ns();
	return deadline_ns > now ? (int64_t)(deadline_ns - now) : 0;
}

/* u64 arithmetic on figures from the segment: saturates, never wraps */
static inline uint64_t sat_add(uint64_t a, uint64_t b)
{
	uint64_t s;
	return __builtin_add_overflow(a, b, &s) ? UINT64_MAX : s;
}

static inline uint64_t sat_mul(uint64_t a, uint64_t b)
{
	uint64_t p;
	return __builtin_mul_overflow(a, b, &p) ? UINT64_MAX : p;
}

/* ---- shared steps (client.c, complete.c, stats.c; the futex and clock
 * primitives they wake and sleep with are futex.h's) ---- */

/* The asyncio loops to wake after a call that settled slots or put chunks,
 * each once (ring.h, ASYNCIO). A slot's waker word is read after the CAS or
 * store that settled it or put its chunks, seq_cst as the loop's store and
 * re-check (sb_await_slot): either the loop sees the slot moved, or we see
 * its id. Only a word of the slot's own generation counts; its id only
 * names a socket, never an index. */
#define SB_WAKES 16
typedef struct {
	uint32_t n;
	uint32_t id[SB_WAKES];
} sb_wakes;
void send_wakes(sb_ring *r, sb_wakes *w);
static inline void note_wake(sb_ring *r, sb_wakes *w, uint32_t slot, uint32_t gen)
{
	uint64_t v = sb_load_seq_cst(waker_at(r, slot));
	uint32_t id = (uint32_t)v;
	if (!id || (uint32_t)(v >> 32) != gen)
		return;
	for (uint32_t k = 0; k < w->n; k++)
		if (w->id[k] == id)
			return;
	if (w->n == SB_WAKES)
		send_wakes(r, w);
	w->id[w->n++] = id;
}

/* every transition to FREE ends here */
void slot_freed(sb_ring *r, uint32_t slot);
/* a CLAIMED or ABANDONED slot of `batcher` answered (DONE or FAILED with
 * status and msg, done_ns now, by a batch of `batch` requests, 0: none) or,
 * withdrawn, freed; its waiter woken */
int complete_one(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t batcher,
		 uint32_t status, const char *msg, uint32_t msg_len, uint64_t now,
		 uint32_t batch, sb_wakes *w);
/* a FAILED slot's status and message, written before the CAS that fails it */
void put_error(sb_ring *r, uint32_t slot, uint32_t status, const char *msg,
	       uint32_t msg_len);
/* the wake after the CAS that answered a slot, if its client sleeps there */
static inline void wake_owner(uint64_t *ctl, uint64_t cur)
{
	if (cur & SB_WAITING_BIT)
		futex_wake(futex_word(ctl), 0x7fffffff);
}
/* An iterative engine's slot being answered or failed: END is set before
 * the CAS that settles it (the slot is still its settler's), the wake made
 * after it. seq_cst, as seq_bump: either the settler sees the client's
 * waiter count, or the client's futex_wait sees the word moved on. */
static inline void end_stream(sb_ring *r, uint32_t slot)
{
	if (r->steps)
		sb_or_seq_cst(&stream_at(r, slot)->chunks, SB_CHUNKS_END);
}

static inline void wake_stream(sb_ring *r, uint32_t slot)
{
	if (r->steps && sb_load_seq_cst(&stream_at(r, slot)->waiters))
		futex_wake(&stream_at(r, slot)->chunks, 0x7fffffff);
}

/* admission's predictions of `compared` requests (ns, summed) against the
 * waits they saw, `late` of them longer than predicted (stats.c) */
void judge_predictions(sb_ring *r, uint64_t compared, uint64_t predicted, uint64_t seen,
		       uint64_t late);
/* a stream's time figure (SB_H_TTFT or SB_H_CHUNK) in its histogram */
void record_stream_time(sb_ring *r, int which, uint64_t ns);
/* a request's arrival to its end (SB_H_E2E): its answer, or its last chunk */
void record_e2e(sb_ring *r, uint64_t ns);
/* the prediction sb_admit left for this thread's next publish (admission.c):
 * returned once, then 0 */
uint32_t take_predicted_us(void);

/* a finished batch, or requests failed unstarted: their async waiters sleep
 * on done_seq */
static inline void bump_done_seq(sb_ring *r)
{
	seq_bump(&hdr(r)->done_seq, &hdr(r)->done_waiters);
}

#endif
