/*
 * ring.c - the slot ring: every transition of ring.h's state machine.
 *
 * Each function is one role's step (client, batcher, reaper) and touches a
 * slot only through a CAS on its control word, so a process killed between
 * any two instructions leaves each slot in one named state. The function
 * never allocates, never prints, and returns an SB_* code.
 */
#define _GNU_SOURCE
#include "ring.h"
#include "atomics.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

_Static_assert(sizeof(sb_header) <= SB_HEADER_BYTES, "header outgrew its region");
_Static_assert(offsetof(sb_header, incarnation) == 16, "layout drawing");
_Static_assert(offsetof(sb_header, total_bytes) == 48, "layout drawing");
_Static_assert(offsetof(sb_header, in_place) == 56, "layout drawing");
_Static_assert(offsetof(sb_header, off_ctl) == 64, "layout drawing");
_Static_assert(offsetof(sb_header, off_lengths) == 88, "layout drawing");
_Static_assert(offsetof(sb_header, off_ready) == 104, "layout drawing");
_Static_assert(offsetof(sb_header, config) == 128, "layout drawing");
_Static_assert(offsetof(sb_header, work_seq) == 2176, "layout drawing");
_Static_assert(offsetof(sb_header, done_seq) == 2240, "layout drawing");
_Static_assert(offsetof(sb_header, alloc_hint) == 2304, "layout drawing");
_Static_assert(offsetof(sb_header, words) == 2368, "layout drawing");
_Static_assert(offsetof(sb_header, hist) == 3392, "layout drawing");
_Static_assert(offsetof(sb_header, free_seq) == 6464, "layout drawing");
_Static_assert(offsetof(sb_header, evict_seq) == 6528, "layout drawing");
_Static_assert(offsetof(sb_header, level_wait_sum) == 6592, "layout drawing");
_Static_assert(offsetof(sb_header, level_wait_max) == 6656, "layout drawing");
_Static_assert(offsetof(sb_header, off_tensor) == 6720, "layout drawing");
_Static_assert(offsetof(sb_header, tensor_slot_bytes) == 6848, "layout drawing");
_Static_assert(offsetof(sb_header, level_hist) == 8192, "layout drawing");
_Static_assert(sizeof(sb_slot_meta) == 64, "one cache line per slot");
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
	       "the futex word is the low half of ctl at its own address");

/* ---- addressing: base + offset, offsets checked by sb_validate ---- */

static inline sb_header *hdr(const void *base) { return (sb_header *)base; }

static inline uint64_t *ctl_at(const void *base, uint32_t slot)
{
	return (uint64_t *)((char *)base + hdr(base)->off_ctl) + slot;
}

static inline sb_slot_meta *meta_at(const void *base, uint32_t slot)
{
	return (sb_slot_meta *)((char *)base + hdr(base)->off_meta) + slot;
}

static inline uint32_t ready_words(uint32_t capacity) { return (capacity + 63) / 64; }

/* the ready[] word of a slot at a priority level, and its bit in it */
static inline uint64_t *ready_word(const void *base, uint32_t level, uint32_t slot)
{
	return (uint64_t *)((char *)base + hdr(base)->off_ready) +
	       (uint64_t)level * ready_words(hdr(base)->capacity) + slot / 64;
}

static inline uint64_t ready_bit(uint32_t slot) { return 1ull << (slot % 64); }

/* relaxed: the bitmap is a hint ordered by the CAS on ctl beside each use
 * (see ring.h, THE READY BITMAP): publish's release CAS comes after the set,
 * claim's acquire CAS before the clear, abandon's and reap's release CAS
 * after theirs */
static inline void mark_ready(const void *base, uint32_t level, uint32_t slot)
{
	sb_or_relaxed(ready_word(base, level, slot), ready_bit(slot));
}

/* a READY slot's level is its meta's priority: set before READY, and not
 * rewritten until the slot is acquired again */
static inline void unmark_ready(const void *base, uint32_t slot)
{
	uint32_t level = meta_at(base, slot)->priority;
	sb_and_relaxed(ready_word(base, level, slot), ~ready_bit(slot));
}


static inline char *errmsg_at(const void *base, uint32_t slot)
{
	return (char *)base + hdr(base)->off_errmsg + (uint64_t)slot * SB_ERRMSG_BYTES;
}

static inline char *tensor_row(const void *base, uint32_t t, uint32_t slot)
{
	const sb_header *h = hdr(base);
	return (char *)base + h->off_tensor[t] + slot * h->tensor_slot_bytes[t];
}

static inline uint32_t *futex_word(uint64_t *ctl) { return (uint32_t *)ctl; }

static inline uint64_t freed(uint64_t cur)
{
	return SB_CTL(SB_CTL_GEN(cur) + 1, 0, 0, SB_FREE);
}

static inline uint64_t with_state(uint64_t cur, uint32_t state)
{
	return (cur & ~SB_STATE_MASK) | state;
}

static void put_error(const void *base, uint32_t slot, uint32_t status,
		      const char *msg, uint32_t msg_len);
static void bump_done_seq(sb_header *h);
static uint64_t wait_behind(const void *base, uint32_t priority, uint64_t now_ns,
			    uint64_t queued);

/* ---- time and futexes ---- */

uint64_t sb_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

void sb_spin_ns(uint64_t ns)
{
	uint64_t end = sb_now_ns() + ns;
	while (sb_now_ns() < end)
		;
}

/* Sleeps while *addr == expected, at most timeout_ns (< 0: no limit).
 * Returns SB_ETIMEOUT only on expiry; EAGAIN/EINTR/wake all mean "re-check". */
static int futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns)
{
	struct timespec ts, *tp = NULL;
	if (timeout_ns >= 0) {
		ts.tv_sec = timeout_ns / 1000000000ll;
		ts.tv_nsec = timeout_ns % 1000000000ll;
		tp = &ts;
	}
	/* not FUTEX_PRIVATE: the word is shared between processes */
	if (syscall(SYS_futex, addr, FUTEX_WAIT, expected, tp, NULL, 0) == -1 &&
	    errno == ETIMEDOUT)
		return SB_ETIMEOUT;
	return SB_OK;
}

static void futex_wake(uint32_t *addr, int n)
{
	syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* A sequence word with a count of its sleepers (done_seq, free_seq,
 * evict_seq): the waker bumps it and makes the wake syscall only while one
 * sleeps. seq_cst on both sides (Dekker): either the waker sees the sleeper
 * counted, or the sleeper's futex_wait sees the word moved on. */
static void seq_bump(uint32_t *seq, uint32_t *sleepers)
{
	sb_add_seq_cst(seq, 1);
	if (sb_load_seq_cst(sleepers))
		futex_wake(seq, INT_MAX);
}

static int seq_wait(uint32_t *seq, uint32_t *sleepers, uint32_t seen, int64_t timeout_ns)
{
	sb_add_seq_cst(sleepers, 1);
	int r = futex_wait(seq, seen, timeout_ns);
	sb_sub_seq_cst(sleepers, 1);
	return r;
}

/* Spins until *word != seen or spin_ns pass; returns the word's last value.
 * acquire: the caller reads what the word's writer published. */
static uint32_t spin_while32(const uint32_t *word, uint32_t seen, uint64_t spin_ns)
{
	uint32_t cur = sb_load_acquire(word);
	if (cur != seen || !spin_ns)
		return cur;
	uint64_t end = sb_now_ns() + spin_ns;
	do {
		for (int i = 0; i < 64 && cur == seen; i++) {
			sb_cpu_relax();
			cur = sb_load_acquire(word);
		}
	} while (cur == seen && sb_now_ns() < end);
	return cur;
}

uint32_t sb_pingpong(void *word, uint32_t role, uint32_t rounds, uint64_t spin_ns,
		     uint64_t *round_trip_ns)
{
	uint32_t *w = word;
	for (uint32_t r = 0; r < rounds; r++) {
		uint32_t ping = 2 * r + 1, pong = 2 * r + 2;
		uint64_t t0 = sb_now_ns();
		if (role == 0) { /* release/acquire: the same pairing as publish/claim */
			sb_store_release(w, ping);
			futex_wake(w, 1);
		}
		uint32_t want = role == 0 ? pong : ping;
		uint32_t cur = sb_load_acquire(w);
		if (cur != want)
			cur = spin_while32(w, cur, spin_ns);
		for (; cur != want; cur = sb_load_acquire(w))
			if (futex_wait(w, cur, 1000000000ll) == SB_ETIMEOUT)
				return r; /* the peer is gone: stop, bounded */
		if (role == 1) {
			sb_store_release(w, pong);
			futex_wake(w, 1);
		} else if (round_trip_ns) {
			round_trip_ns[r] = sb_now_ns() - t0;
		}
	}
	return rounds;
}

static inline int64_t remaining_ns(uint64_t deadline_ns)
{
	uint64_t now = sb_now_ns();
	return deadline_ns > now ? (int64_t)(deadline_ns - now) : 0;
}

/* ---- setup ---- */

struct offsets {
	uint64_t ctl, ready, meta, errmsg, lengths, tensor[SB_MAX_TENSORS], total, slot_bytes;
};

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }

static int compute_offsets(uint32_t cap, uint32_t tensors, uint32_t inputs,
			   const uint64_t *slot_bytes, uint32_t in_place, uint32_t levels,
			   struct offsets *o)
{
	/* caps keep every product below 2^60: no overflow in the sums */
	if (cap == 0 || cap > SB_MAX_CAPACITY || tensors > SB_MAX_TENSORS ||
	    inputs == 0 || inputs >= tensors || in_place > 1 ||
	    (in_place && (tensors != 2 || slot_bytes[0] != slot_bytes[1])) ||
	    levels == 0 || levels > SB_MAX_PRIORITIES)
		return SB_EBADARG;
	o->ctl = SB_HEADER_BYTES;
	o->ready = align_up(o->ctl + 8ull * cap, 64);
	o->meta = align_up(o->ready + 8ull * levels * ready_words(cap), 64);
	o->errmsg = align_up(o->meta + sizeof(sb_slot_meta) * cap, 64);
	o->lengths = align_up(o->errmsg + (uint64_t)SB_ERRMSG_BYTES * cap, 64);
	uint64_t at = align_up(o->lengths + 4ull * inputs * cap, 4096);
	o->slot_bytes = 0;
	for (uint32_t t = 0; t < tensors; t++) {
		if (slot_bytes[t] == 0 || slot_bytes[t] > (1ull << 36))
			return SB_EBADARG;
		if (in_place && t == 1) { /* the answer overwrites its own input row */
			o->tensor[1] = o->tensor[0];
			continue;
		}
		o->tensor[t] = at;
		o->slot_bytes += slot_bytes[t];
		at = align_up(at + slot_bytes[t] * cap, 4096);
	}
	o->total = at;
	return SB_OK;
}

uint64_t sb_layout_bytes(uint32_t capacity, uint32_t tensors, uint32_t inputs,
			 const uint64_t *slot_bytes, uint32_t in_place, uint32_t levels)
{
	struct offsets o;
	if (compute_offsets(capacity, tensors, inputs, slot_bytes, in_place, levels, &o))
		return 0;
	return o.total;
}

int sb_init(void *base, uint64_t total_bytes, uint32_t capacity,
	    uint32_t max_batch, uint32_t tensors, uint32_t inputs,
	    const uint64_t *slot_bytes, uint32_t in_place, uint32_t levels,
	    uint64_t incarnation)
{
	struct offsets o;
	sb_header *h = hdr(base);
	if (compute_offsets(capacity, tensors, inputs, slot_bytes, in_place, levels, &o) ||
	    o.total > total_bytes || max_batch == 0 || max_batch > capacity)
		return SB_EBADARG;
	/* the caller holds the only mapping (created O_EXCL): plain stores */
	memset(base, 0, o.tensor[0]);
	h->layout_version = SB_LAYOUT_VERSION;
	h->header_bytes = SB_HEADER_BYTES;
	h->incarnation = incarnation;
	h->capacity = capacity;
	h->max_batch = max_batch;
	h->tensors = tensors;
	h->inputs = inputs;
	h->slot_bytes = o.slot_bytes;
	h->in_place = in_place;
	h->levels = levels;
	h->total_bytes = o.total;
	h->off_ctl = o.ctl;
	h->off_ready = o.ready;
	h->off_meta = o.meta;
	h->off_errmsg = o.errmsg;
	h->off_lengths = o.lengths;
	for (uint32_t t = 0; t < tensors; t++) {
		h->off_tensor[t] = o.tensor[t];
		h->tensor_slot_bytes[t] = slot_bytes[t];
	}
	/* release: an attacher that acquires the magic sees the whole header */
	sb_store_release(&h->magic, SB_MAGIC);
	return SB_OK;
}

int sb_validate_header(const void *base, uint64_t mapped_bytes)
{
	const sb_header *h = hdr(base);
	if (mapped_bytes < SB_HEADER_BYTES)
		return SB_ECORRUPT;
	/* acquire: pairs with the release store of the magic in sb_init */
	if (sb_load_acquire(&h->magic) != SB_MAGIC)
		return SB_ECORRUPT;
	if (h->layout_version != SB_LAYOUT_VERSION || h->header_bytes != SB_HEADER_BYTES)
		return SB_EVERSION;
	return SB_OK;
}

int sb_validate(const void *base, uint64_t mapped_bytes)
{
	const sb_header *h = hdr(base);
	struct offsets o;
	int r = sb_validate_header(base, mapped_bytes);
	if (r != SB_OK)
		return r;
	if (h->tensors > SB_MAX_TENSORS ||
	    compute_offsets(h->capacity, h->tensors, h->inputs, h->tensor_slot_bytes,
			    h->in_place, h->levels, &o) ||
	    h->max_batch == 0 || h->max_batch > h->capacity ||
	    o.ctl != h->off_ctl || o.ready != h->off_ready || o.meta != h->off_meta ||
	    o.errmsg != h->off_errmsg || o.lengths != h->off_lengths ||
	    o.total != h->total_bytes || o.total > mapped_bytes)
		return SB_ECORRUPT;
	for (uint32_t t = 0; t < h->tensors; t++)
		if (o.tensor[t] != h->off_tensor[t])
			return SB_ECORRUPT;
	return SB_OK;
}

uint64_t sb_header_field(const void *base, int field)
{
	const sb_header *h = hdr(base);
	switch (field) {
	case SB_F_CAPACITY: return h->capacity;
	case SB_F_MAX_BATCH: return h->max_batch;
	case SB_F_TENSORS: return h->tensors;
	case SB_F_INPUTS: return h->inputs;
	case SB_F_TOTAL_BYTES: return h->total_bytes;
	case SB_F_INCARNATION: return h->incarnation;
	case SB_F_OFF_CONFIG: return offsetof(sb_header, config);
	case SB_F_OFF_LENGTHS: return h->off_lengths;
	case SB_F_SLOT_BYTES: return h->slot_bytes;
	case SB_F_OFF_WORDS: return offsetof(sb_header, words);
	case SB_F_IN_PLACE: return h->in_place;
	case SB_F_OFF_READY: return h->off_ready;
	case SB_F_LEVELS: return h->levels;
	}
	if (field >= SB_F_OFF_TENSOR && field < SB_F_OFF_TENSOR + (int)h->tensors)
		return h->off_tensor[field - SB_F_OFF_TENSOR];
	if (field >= SB_F_TENSOR_BYTES && field < SB_F_TENSOR_BYTES + (int)h->tensors)
		return h->tensor_slot_bytes[field - SB_F_TENSOR_BYTES];
	return 0;
}

/* words[]: identities use acquire/release (a pid is read with what was set
 * before it); counters are statistics, relaxed is enough. */
uint64_t sb_word_get(const void *base, int word)
{
	return (unsigned)word < SB_WORDS ? sb_load_acquire(&hdr(base)->words[word]) : 0;
}

void sb_word_set(void *base, int word, uint64_t value)
{
	if ((unsigned)word < SB_WORDS)
		sb_store_release(&hdr(base)->words[word], value);
}

void sb_word_add(void *base, int word, uint64_t delta)
{
	if ((unsigned)word < SB_WORDS)
		sb_add_relaxed(&hdr(base)->words[word], delta);
}

/* ---- client ---- */

/* A freed slot below the hint becomes the next one handed out: the slots in
 * use stay the lowest ones, so their rows stay in the CPU caches (for 1 MiB
 * rows, 3x the round trips of a cursor that walks the whole ring). */
static void lower_alloc_hint(sb_header *h, uint32_t slot)
{
	uint32_t cur = sb_load_relaxed(&h->alloc_hint);
	/* relaxed: a hint; a lost update only makes the next search longer */
	while (slot < cur && !__atomic_compare_exchange_n(&h->alloc_hint, &cur, slot, 0,
							  __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		;
}

/* Every transition to FREE ends here: a lower slot becomes the next one
 * handed out, and a client sleeping on a full ring is woken. */
static void slot_freed(sb_header *h, uint32_t slot)
{
	lower_alloc_hint(h, slot);
	/* seq_cst: the freeing CAS comes before the read of free_waiters, as
	 * sb_acquire_wait counts itself before its last look (Dekker); on x86
	 * the CAS is a full barrier already and this costs one fence */
	sb_fence_seq_cst();
	if (sb_load_relaxed(&h->free_waiters))
		seq_bump(&h->free_seq, &h->free_waiters);
}

static int acquire_one(void *base, uint32_t pid, uint64_t start_ticks,
		       uint32_t *slot, uint32_t *gen)
{
	sb_header *h = hdr(base);
	uint32_t cap = h->capacity;
	/* relaxed: the hint only says where to start looking; the CAS below is
	 * what makes a slot ours */
	uint32_t i = sb_load_relaxed(&h->alloc_hint) % cap;
	/* two passes: a slot freed behind a pass while the ring is all but
	 * full would otherwise be missed (a spurious EFULL) */
	for (uint32_t k = 0; k < 2 * cap; k++, i = (i + 1 == cap) ? 0 : i + 1) {
		uint64_t *c = ctl_at(base, i);
		uint64_t cur = sb_load_relaxed(c);
		if (SB_CTL_STATE(cur) != SB_FREE)
			continue;
		/* acquire: the previous owner's last reads of this slot happen
		 * before our writes into it (pairs with the release to FREE) */
		if (!sb_cas_acq_rel(c, &cur, SB_CTL(SB_CTL_GEN(cur), pid, 0, SB_WRITING)))
			continue;
		sb_slot_meta *m = meta_at(base, i);
		/* relaxed: the reaper reads these racily and checks the pid in ctl */
		sb_store_relaxed(&m->owner_start, start_ticks);
		sb_store_relaxed(&m->owner_pid, pid);
		m->status = SB_STATUS_OK;
		m->errmsg_len = 0;
		*slot = i;
		*gen = SB_CTL_GEN(cur);
		/* the next request takes the next row: a burst is one contiguous batch */
		sb_store_relaxed(&h->alloc_hint, i + 1);
		return SB_OK;
	}
	return SB_EFULL;
}

int sb_acquire(void *base, uint32_t pid, uint64_t start_ticks,
	       uint32_t *slot, uint32_t *gen)
{
	if (pid == 0 || pid > SB_PID_MASK)
		return SB_EBADARG;
	return acquire_one(base, pid, start_ticks, slot, gen);
}

uint32_t sb_acquire_many(void *base, uint32_t pid, uint64_t start_ticks,
			 uint32_t n, uint32_t *slots, uint32_t *gens)
{
	uint32_t k = 0;
	if (pid == 0 || pid > SB_PID_MASK)
		return 0;
	while (k < n && acquire_one(base, pid, start_ticks, &slots[k], &gens[k]) == SB_OK)
		k++;
	return k;
}

static int publish_one(void *base, uint32_t slot, uint32_t gen, uint32_t length,
		       uint64_t deadline_ns, uint32_t priority, uint64_t now)
{
	if (slot >= hdr(base)->capacity || priority >= hdr(base)->levels)
		return SB_EBADARG;
	uint64_t *c = ctl_at(base, slot);
	sb_slot_meta *m = meta_at(base, slot);
	uint64_t cur = sb_load_relaxed(c);
	if (SB_CTL_GEN(cur) != gen || SB_CTL_STATE(cur) != SB_WRITING)
		return SB_ESTALE;
	m->length = length;
	m->arrival_ns = now;
	m->deadline_ns = deadline_ns;
	m->priority = priority;
	m->retry = SB_RETRY_NONE;
	mark_ready(base, priority, slot); /* before READY: every READY slot has its bit */
	do {
		if (SB_CTL_GEN(cur) != gen || SB_CTL_STATE(cur) != SB_WRITING)
			return SB_ESTALE; /* reaped meanwhile: the bit stays, a wasted look */
		/* release: the input row and meta above are visible to the
		 * batcher whose claim CAS reads READY */
	} while (!sb_cas_acq_rel(c, &cur, with_state(cur, SB_READY)));
	return SB_OK;
}

static void work_arrived(sb_header *h, uint32_t published)
{
	sb_add_relaxed(&h->words[SB_W_REQUESTS], published);
	/* seq_cst pair with sb_wait_work: bump work_seq, then look for
	 * sleepers; the batcher counts itself asleep, then futex-checks it */
	sb_add_seq_cst(&h->work_seq, 1);
	if (sb_load_seq_cst(&h->batchers_sleeping))
		futex_wake(&h->work_seq, 1);
}

int sb_publish(void *base, uint32_t slot, uint32_t gen, uint32_t length,
	       uint64_t deadline_ns, uint32_t priority)
{
	int r = publish_one(base, slot, gen, length, deadline_ns, priority, sb_now_ns());
	if (r == SB_OK)
		work_arrived(hdr(base), 1);
	return r;
}

uint32_t sb_publish_many(void *base, const uint32_t *slots, const uint32_t *gens,
			 uint32_t n, uint32_t length, uint64_t deadline_ns,
			 uint32_t priority)
{
	uint64_t now = sb_now_ns();
	uint32_t published = 0;
	for (uint32_t k = 0; k < n; k++)
		published += publish_one(base, slots[k], gens[k], length, deadline_ns,
					 priority, now) == SB_OK;
	if (published)
		work_arrived(hdr(base), published);
	return published;
}

int sb_submit(void *base, uint32_t pid, uint64_t start_ticks, const void *src,
	      uint64_t nbytes, uint32_t length, uint64_t deadline_ns,
	      uint32_t priority, uint32_t admit, uint32_t *ticket)
{
	if (hdr(base)->inputs != 1 || nbytes > hdr(base)->tensor_slot_bytes[0])
		return SB_EBADARG;
	if (admit && deadline_ns) {
		uint64_t now = sb_now_ns();
		/* admission.refuses(): the wait, plus an eighth of it for the
		 * estimate's error, ends after the deadline. Counting the queue
		 * costs a pass over the bitmaps: skipped when even a full queue
		 * would leave time enough */
		uint64_t worst = wait_behind(base, priority, now, hdr(base)->capacity);
		uint64_t wait = now + worst + worst / 8 <= deadline_ns ? 0
				: sb_predicted_wait_ns(base, priority, now);
		if (wait && now + wait + wait / 8 > deadline_ns) {
			ticket[0] = (uint32_t)(wait / 1000000);
			/* relaxed: a figure, read by nobody who orders on it */
			sb_add_relaxed(&hdr(base)->words[SB_W_OVERLOADED], 1);
			return SB_EOVERLOADED;
		}
	}
	int r = sb_acquire(base, pid, start_ticks, &ticket[0], &ticket[1]);
	if (r != SB_OK)
		return r;
	/* WRITING: the row is ours alone; publish's release CAS shows it */
	memcpy(tensor_row(base, 0, ticket[0]), src, nbytes);
	return sb_publish(base, ticket[0], ticket[1], length, deadline_ns, priority);
}

int sb_cancel(void *base, uint32_t slot, uint32_t gen)
{
	if (slot >= hdr(base)->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(base, slot);
	uint64_t cur = sb_load_relaxed(c);
	do {
		if (SB_CTL_GEN(cur) != gen || SB_CTL_STATE(cur) != SB_WRITING)
			return SB_ESTALE;
	} while (!sb_cas_acq_rel(c, &cur, freed(cur)));
	slot_freed(hdr(base), slot);
	return SB_OK;
}

/* What a ticket's holder sees: SB_OK answered, SB_EFAILED failed (see
 * sb_slot_error), SB_EBUSY not yet, SB_ESTALE no longer its slot. */
static int answer_of(uint64_t cur, uint32_t gen)
{
	if (SB_CTL_GEN(cur) != gen)
		return SB_ESTALE;
	switch (SB_CTL_STATE(cur)) {
	case SB_DONE: return SB_OK;
	case SB_FAILED: return SB_EFAILED;
	case SB_READY:
	case SB_CLAIMED: return SB_EBUSY;
	}
	return SB_ESTALE;
}

int sb_wait_slot(void *base, uint32_t slot, uint32_t gen, int64_t timeout_ns,
		 uint64_t spin_ns)
{
	if (slot >= hdr(base)->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(base, slot);
	uint64_t deadline = timeout_ns < 0 ? 0 : sb_now_ns() + (uint64_t)timeout_ns;
	if (timeout_ns >= 0 && spin_ns > (uint64_t)timeout_ns)
		spin_ns = (uint64_t)timeout_ns;
	/* relaxed while spinning: the loop below re-reads with acquire before
	 * anything is trusted */
	if (spin_ns && answer_of(sb_load_relaxed(c), gen) == SB_EBUSY) {
		uint64_t end = sb_now_ns() + spin_ns;
		do {
			for (int i = 0; i < 64 && answer_of(sb_load_relaxed(c), gen) == SB_EBUSY; i++)
				sb_cpu_relax();
		} while (answer_of(sb_load_relaxed(c), gen) == SB_EBUSY && sb_now_ns() < end);
	}
	for (;;) {
		/* acquire: pairs with the batcher's release CAS to DONE, so the
		 * output row is complete before the caller reads it */
		uint64_t cur = sb_load_acquire(c);
		int r = answer_of(cur, gen);
		if (r != SB_EBUSY)
			return r;
		int64_t left = deadline ? remaining_ns(deadline) : -1;
		if (left == 0)
			return SB_ETIMEOUT;
		if (!(cur & SB_WAITING_BIT)) {
			uint64_t want = cur | SB_WAITING_BIT;
			if (!sb_cas_acq_rel(c, &cur, want))
				continue; /* moved on meanwhile: re-check */
			cur = want;
		}
		futex_wait(futex_word(c), (uint32_t)cur, left);
	}
}

int sb_take(void *base, uint32_t slot, uint32_t gen, int64_t timeout_ns,
	    uint64_t spin_ns, void *dst, uint64_t nbytes, uint64_t *times)
{
	const sb_header *h = hdr(base);
	if (h->tensors != h->inputs + 1 || nbytes > h->tensor_slot_bytes[h->inputs])
		return SB_EBADARG;
	int r = sb_wait_slot(base, slot, gen, timeout_ns, spin_ns);
	if (r != SB_OK)
		return r;
	/* DONE is ours until we release it: wait_slot's acquire load made the
	 * row complete, and release's CAS keeps this read before a reuse */
	memcpy(dst, tensor_row(base, h->inputs, slot), nbytes);
	if (times) {
		const sb_slot_meta *m = meta_at(base, slot);
		times[SB_T_ARRIVAL] = m->arrival_ns;
		times[SB_T_CLAIM] = m->claim_ns;
		times[SB_T_DONE] = m->done_ns;
	}
	return sb_release(base, slot, gen);
}

int sb_release(void *base, uint32_t slot, uint32_t gen)
{
	if (slot >= hdr(base)->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(base, slot);
	uint64_t cur = sb_load_relaxed(c);
	do {
		int r = answer_of(cur, gen);
		if (r != SB_OK && r != SB_EFAILED)
			return r == SB_EBUSY ? SB_EBUSY : SB_ESTALE;
		/* release: our reads of the output row finish before a new
		 * owner's acquire CAS lets it write the slot */
	} while (!sb_cas_acq_rel(c, &cur, freed(cur)));
	slot_freed(hdr(base), slot);
	return SB_OK;
}

int sb_wait_all(void *base, const uint32_t *slots, const uint32_t *gens,
		uint32_t n, int64_t timeout_ns, uint64_t spin_ns)
{
	uint64_t deadline = timeout_ns < 0 ? 0 : sb_now_ns() + (uint64_t)timeout_ns;
	for (uint32_t k = 0; k < n; k++) {
		int r = sb_wait_slot(base, slots[k], gens[k],
				     deadline ? remaining_ns(deadline) : -1, spin_ns);
		if (r != SB_OK && r != SB_EFAILED)
			return r; /* SB_ETIMEOUT, or a ticket no longer ours */
	}
	return SB_OK;
}

uint32_t sb_release_many(void *base, const uint32_t *slots, const uint32_t *gens,
			 uint32_t n)
{
	uint32_t released = 0;
	for (uint32_t k = 0; k < n; k++)
		released += sb_release(base, slots[k], gens[k]) == SB_OK;
	return released;
}

int sb_abandon(void *base, uint32_t slot, uint32_t gen)
{
	sb_header *h = hdr(base);
	if (slot >= h->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(base, slot);
	uint64_t cur = sb_load_acquire(c);
	for (;;) {
		uint64_t want;
		if (SB_CTL_GEN(cur) != gen)
			return SB_ESTALE;
		switch (SB_CTL_STATE(cur)) {
		case SB_READY:
			want = freed(cur); /* no batcher has it: take it back now */
			unmark_ready(base, slot); /* before the CAS: see ring.h */
			break;
		case SB_CLAIMED:
			/* a batcher may still write the output row: it frees it */
			want = with_state(cur & ~SB_WAITING_BIT, SB_ABANDONED);
			break;
		case SB_DONE:
		case SB_FAILED:
			return SB_EBUSY; /* answered after all: read and release */
		default:
			return SB_ESTALE;
		}
		if (sb_cas_acq_rel(c, &cur, want)) {
			if (SB_CTL_STATE(want) == SB_FREE)
				slot_freed(h, slot);
			return SB_OK; /* the caller counts it if it was a timeout */
		}
	}
}

int sb_poll(const void *base, const uint32_t *slots, const uint32_t *gens,
	    uint32_t n, int32_t *states)
{
	uint32_t cap = hdr(base)->capacity;
	int pending = 0;
	for (uint32_t k = 0; k < n; k++) {
		if (slots[k] >= cap) {
			states[k] = SB_EBADARG;
			continue;
		}
		/* acquire: as in sb_wait_slot */
		states[k] = answer_of(sb_load_acquire(ctl_at(base, slots[k])), gens[k]);
		pending += states[k] == SB_EBUSY;
	}
	return pending;
}

uint32_t sb_slot_error(const void *base, uint32_t slot, char *msg,
		       uint32_t msg_cap, uint32_t *msg_len)
{
	*msg_len = 0;
	if (slot >= hdr(base)->capacity)
		return SB_STATUS_OK;
	const sb_slot_meta *m = meta_at(base, slot);
	uint32_t len = m->errmsg_len;
	if (len > SB_ERRMSG_BYTES) /* never trust a length read from the segment */
		len = SB_ERRMSG_BYTES;
	if (len > msg_cap)
		len = msg_cap;
	memcpy(msg, errmsg_at(base, slot), len);
	*msg_len = len;
	return m->status;
}

uint32_t sb_done_seq(const void *base)
{
	return sb_load_acquire(&hdr(base)->done_seq);
}

int sb_wait_done_seq(void *base, uint32_t seen, int64_t timeout_ns)
{
	return seq_wait(&hdr(base)->done_seq, &hdr(base)->done_waiters, seen, timeout_ns);
}

static void bump_done_seq(sb_header *h)
{
	seq_bump(&h->done_seq, &h->done_waiters);
}

int sb_acquire_wait(void *base, uint32_t pid, uint64_t start_ticks,
		    int64_t timeout_ns, uint32_t *slot, uint32_t *gen)
{
	sb_header *h = hdr(base);
	if (pid == 0 || pid > SB_PID_MASK)
		return SB_EBADARG;
	uint64_t deadline = sb_now_ns() + (timeout_ns > 0 ? (uint64_t)timeout_ns : 0);
	for (;;) {
		/* counted before the look, so a slot freed after the look wakes us
		 * (see slot_freed); the fence keeps the look after the count */
		uint32_t seen = sb_load_acquire(&h->free_seq);
		sb_add_seq_cst(&h->free_waiters, 1);
		sb_fence_seq_cst();
		int r = acquire_one(base, pid, start_ticks, slot, gen);
		int64_t left = remaining_ns(deadline);
		if (r == SB_EFULL && left > 0)
			futex_wait(&h->free_seq, seen, left);
		sb_sub_seq_cst(&h->free_waiters, 1);
		if (r != SB_EFULL || left == 0)
			return r;
	}
}

void sb_request_evict(void *base)
{
	seq_bump(&hdr(base)->evict_seq, &hdr(base)->evictors);
}

uint32_t sb_evict_seq(const void *base)
{
	return sb_load_acquire(&hdr(base)->evict_seq);
}

int sb_wait_evict(void *base, uint32_t seen, int64_t timeout_ns)
{
	return seq_wait(&hdr(base)->evict_seq, &hdr(base)->evictors, seen, timeout_ns);
}

/* ---- batcher ---- */

uint32_t sb_work_seq(const void *base)
{
	/* acquire: the scan that follows must not read slots from before it */
	return sb_load_acquire(&hdr(base)->work_seq);
}

int sb_wait_work(void *base, uint32_t seen, int64_t timeout_ns, uint64_t spin_ns)
{
	sb_header *h = hdr(base);
	if (timeout_ns >= 0 && spin_ns > (uint64_t)timeout_ns)
		spin_ns = (uint64_t)timeout_ns;
	if (spin_while32(&h->work_seq, seen, spin_ns) != seen)
		return SB_OK;
	/* seq_cst: pairs with sb_publish (Dekker): either the publisher sees
	 * us asleep and wakes us, or the kernel sees work_seq != seen */
	sb_add_seq_cst(&h->batchers_sleeping, 1);
	int r = futex_wait(&h->work_seq, seen, timeout_ns);
	sb_sub_seq_cst(&h->batchers_sleeping, 1);
	return r;
}

void sb_wake_work(void *base)
{
	sb_header *h = hdr(base);
	sb_add_seq_cst(&h->work_seq, 1);
	futex_wake(&h->work_seq, INT_MAX);
}

/* The READY slots, most urgent level first and ascending within a level,
 * from one pass over ready[] and the ctl of each set bit: O(L * C/64 + set
 * bits). Start from READY_ITER; next_ready returns the next READY slot (its
 * level in it->level), or NO_SLOT when the pass is over. A set bit whose slot
 * is not READY at that level is a stale hint: skipped. */
#define NO_SLOT UINT32_MAX
struct ready_iter {
	uint32_t level; /* the level being read */
	uint32_t word;  /* the next word of it to load */
	uint64_t bits;  /* the set bits of the word before it, not yet looked at */
};
#define READY_ITER {0, 0, 0}

static uint32_t next_ready(const void *base, struct ready_iter *it)
{
	uint32_t cap = hdr(base)->capacity, words = ready_words(cap);
	uint32_t levels = hdr(base)->levels;
	for (;;) {
		while (!it->bits) {
			if (it->word == words) {
				if (++it->level >= levels)
					return NO_SLOT;
				it->word = 0;
			}
			/* relaxed: the ctl load below is what is trusted */
			it->bits = sb_load_relaxed(ready_word(base, it->level, 0) + it->word++);
		}
		uint32_t slot = (it->word - 1) * 64 + (uint32_t)__builtin_ctzll(it->bits);
		it->bits &= it->bits - 1;
		if (slot >= cap || SB_CTL_STATE(sb_load_relaxed(ctl_at(base, slot))) != SB_READY)
			continue;
		/* acquire: pairs with the publish CAS, so meta is set */
		sb_fence_acquire();
		if (meta_at(base, slot)->priority == it->level)
			return slot;
	}
}

uint32_t sb_queued(const void *base, uint32_t max_priority)
{
	uint32_t words = ready_words(hdr(base)->capacity), n = 0;
	for (uint32_t level = 0; level <= max_priority && level < hdr(base)->levels; level++)
		for (uint32_t w = 0; w < words; w++) /* relaxed: a hint */
			n += (uint32_t)__builtin_popcountll(sb_load_relaxed(ready_word(base, level, 0) + w));
	return n;
}

void sb_admission_figures(const void *base, uint32_t max_priority, uint32_t count,
			  uint64_t *out)
{
	const sb_header *h = hdr(base);
	uint64_t instances = sb_word_get(base, SB_W_INSTANCES), busy_since = 0;
	out[SB_A_QUEUED] = count ? sb_queued(base, max_priority) : 0;
	out[SB_A_FIXED_NS] = sb_word_get(base, SB_W_FIT_FIXED_NS);
	out[SB_A_ITEM_PS] = sb_word_get(base, SB_W_FIT_ITEM_PS);
	out[SB_A_LIMIT] = sb_word_get(base, SB_W_BATCH_LIMIT);
	for (uint64_t i = 0; i < instances && i < SB_MAX_INSTANCES; i++) {
		/* relaxed: a figure, written by each batcher as its batch starts */
		uint64_t started = sb_load_relaxed(&h->words[SB_W_BATCH_START + i]);
		if (!started) {
			busy_since = 0; /* one is idle */
			break;
		}
		if (started > busy_since)
			busy_since = started;
	}
	out[SB_A_BUSY_SINCE] = busy_since;
}

/* admission.predicted_wait_ns on the header's figures, with `queued`
 * requests ahead (UINT64_MAX: count them) */
static uint64_t wait_behind(const void *base, uint32_t priority, uint64_t now_ns, uint64_t queued)
{
	uint64_t f[5];
	sb_admission_figures(base, priority, queued == UINT64_MAX, f);
	if (queued == UINT64_MAX)
		queued = f[SB_A_QUEUED];
	uint64_t fixed = f[SB_A_FIXED_NS], item_ps = f[SB_A_ITEM_PS];
	if (!fixed && !item_ps)
		return 0; /* no batch measured yet */
	if (!queued && !f[SB_A_BUSY_SINCE])
		return 0; /* an idle engine takes it at once (its figures may be stale) */
	uint64_t limit = f[SB_A_LIMIT] ? f[SB_A_LIMIT] : 1;
	uint64_t instances = sb_word_get(base, SB_W_INSTANCES);
	uint64_t batch_ns = fixed + limit * item_ps / 1000, in_service = 0;
	if (f[SB_A_BUSY_SINCE]) {
		uint64_t ran = now_ns > f[SB_A_BUSY_SINCE] ? now_ns - f[SB_A_BUSY_SINCE] : 0;
		in_service = batch_ns > ran ? batch_ns - ran : 0;
	}
	uint64_t per_round = limit * (instances ? instances : 1);
	uint64_t rounds = queued / per_round;
	uint64_t own = queued - rounds * per_round + 1;
	if (own > limit)
		own = limit;
	return in_service + rounds * batch_ns + fixed + own * item_ps / 1000;
}

uint64_t sb_predicted_wait_ns(const void *base, uint32_t priority, uint64_t now_ns)
{
	return wait_behind(base, priority, now_ns, UINT64_MAX);
}

uint32_t sb_scan(const void *base, uint32_t max_out, uint32_t *slots,
		 uint64_t *arrival_ns, uint32_t *lengths, uint32_t *priorities)
{
	struct ready_iter it = READY_ITER;
	uint32_t k = 0;
	for (uint32_t slot; (slot = next_ready(base, &it)) != NO_SLOT; k++) {
		if (k < max_out) {
			const sb_slot_meta *m = meta_at(base, slot);
			slots[k] = slot;
			arrival_ns[k] = m->arrival_ns;
			lengths[k] = m->length;
			priorities[k] = it.level;
		}
	}
	return k;
}

/* Claims slot i for batcher if it is still READY, adding it to the claimed
 * n (slots/gens/lengths, kept in ascending slot order, so contiguous rows
 * show up as consecutive indices). Returns the new count. */
static uint32_t claim_one(void *base, uint32_t batcher, uint32_t i, uint64_t claim_ns,
			  uint32_t *slots, uint32_t *gens, uint32_t *lengths, uint32_t n)
{
	uint64_t *c = ctl_at(base, i);
	uint64_t cur = sb_load_relaxed(c);
	while (SB_CTL_STATE(cur) == SB_READY) {
		/* keeps the waiting bit: the client may already sleep */
		uint64_t next = with_state(cur, SB_CLAIMED) | ((uint64_t)batcher << SB_BATCHER_SHIFT);
		/* acquire: the client's input row and meta are visible */
		if (!sb_cas_acq_rel(c, &cur, next))
			continue;
		unmark_ready(base, i); /* after the CAS: see ring.h */
		sb_slot_meta *m = meta_at(base, i);
		m->claim_ns = claim_ns;
		uint32_t p = n++;
		for (; p > 0 && slots[p - 1] > i; p--) {
			slots[p] = slots[p - 1];
			gens[p] = gens[p - 1];
			lengths[p] = lengths[p - 1];
		}
		slots[p] = i;
		gens[p] = SB_CTL_GEN(cur);
		lengths[p] = m->length; /* read once: the batcher uses this copy */
		break;
	}
	return n;
}

/* Fails a READY request unstarted (its deadline is past, or certain to be
 * by the time a batch could finish): READY -> FAILED with SB_STATUS_EXPIRED,
 * its bit cleared before the CAS as for an abandon. 1 if it did. */
static int expire_one(void *base, uint32_t slot, uint64_t now)
{
	static const char why[] = "deadline passed before a batch could start it (not computed)";
	uint64_t *c = ctl_at(base, slot);
	uint64_t cur = sb_load_relaxed(c);
	unmark_ready(base, slot); /* before the CAS: see ring.h */
	while (SB_CTL_STATE(cur) == SB_READY) {
		sb_slot_meta *m = meta_at(base, slot);
		m->done_ns = now;
		put_error(base, slot, SB_STATUS_EXPIRED, why, sizeof(why) - 1);
		/* release: the error is written before FAILED */
		if (!sb_cas_acq_rel(c, &cur, SB_CTL(SB_CTL_GEN(cur), SB_CTL_PID(cur), 0, SB_FAILED)))
			continue;
		sb_add_relaxed(&hdr(base)->words[SB_W_EXPIRED], 1);
		if (cur & SB_WAITING_BIT)
			futex_wake(futex_word(c), INT_MAX);
		return 1;
	}
	/* claimed or withdrawn meanwhile: if READY again it has its new bit */
	return 0;
}

uint32_t sb_claim_slots(void *base, uint32_t batcher, const uint32_t *want,
			uint32_t n, uint64_t claim_ns, uint32_t *slots,
			uint32_t *gens, uint32_t *lengths)
{
	uint32_t cap = hdr(base)->capacity, claimed = 0;
	if (batcher > SB_BATCHER_MASK)
		return 0;
	for (uint32_t j = 0; j < n; j++)
		if (want[j] < cap)
			claimed = claim_one(base, batcher, want[j], claim_ns, slots, gens,
					    lengths, claimed);
	return claimed;
}

/* Entries {level, arrival_ns, slot, bucket}: x before y when more urgent,
 * then older, then lower (slots are unique: a total order) */
static inline int before(const uint64_t *x, const uint64_t *y)
{
	if (x[0] != y[0])
		return x[0] < y[0];
	if (x[1] != y[1])
		return x[1] < y[1];
	return x[2] < y[2];
}

static inline void swap_entries(uint64_t *x, uint64_t *y)
{
	for (int f = 0; f < 4; f++) {
		uint64_t t = x[f];
		x[f] = y[f];
		y[f] = t;
	}
}

/* Moves the n entries that come first (before()) to the front of the k in
 * e, in no order among themselves (a claim keeps its slots in slot order
 * anyway): Hoare's selection, O(k) expected, where sorting all k would be
 * O(k log k) on every claim from a deep queue. */
static void select_first(uint64_t *e, uint32_t k, uint32_t n)
{
	int64_t lo = 0, hi = (int64_t)k - 1, want = (int64_t)n - 1;
	while (lo < hi) {
		uint64_t pivot[4];
		memcpy(pivot, e + 4 * (lo + (hi - lo) / 2), sizeof(pivot));
		int64_t i = lo, j = hi;
		while (i <= j) {
			while (before(e + 4 * i, pivot))
				i++;
			while (before(pivot, e + 4 * j))
				j--;
			if (i <= j)
				swap_entries(e + 4 * i++, e + 4 * j--);
		}
		/* now e[lo..j] come before or tie the pivot, e[i..hi] after */
		if (want <= j)
			hi = j;
		else if (want >= i)
			lo = i;
		else
			return;
	}
}

static uint32_t length_bucket(const sb_shape *shape, uint32_t length)
{
	uint32_t b = 0;
	while (b + 1 < shape->buckets && length > shape->bound[b])
		b++;
	return b;
}

/* With a shape: the bucket to claim from (SB_MAX_BUCKETS: none is full or
 * due), its entries moved to the front of scratch (*count of them). */
static uint32_t pick_bucket(const sb_shape *shape, uint64_t *scratch, uint32_t k,
			    uint32_t flush_n, uint64_t cutoff_ns, uint32_t *count)
{
	uint32_t n[SB_MAX_BUCKETS] = {0}, pick = SB_MAX_BUCKETS;
	uint32_t buckets = shape->buckets ? shape->buckets : 1;
	uint64_t oldest[SB_MAX_BUCKETS], first[SB_MAX_BUCKETS][2]; /* {level, arrival} */
	for (uint32_t j = 0; j < k; j++) {
		const uint64_t *e = scratch + 4 * j;
		uint32_t b = (uint32_t)e[3];
		if (n[b]++ == 0 || e[1] < oldest[b])
			oldest[b] = e[1];
		if (n[b] == 1 || e[0] < first[b][0] || (e[0] == first[b][0] && e[1] < first[b][1])) {
			first[b][0] = e[0];
			first[b][1] = e[1];
		}
	}
	for (uint32_t b = 0; b < buckets; b++) {
		uint32_t full = shape->buckets && shape->most[b] < flush_n ? shape->most[b] : flush_n;
		if (n[b] == 0 || (n[b] < full && oldest[b] > cutoff_ns))
			continue;
		if (pick == SB_MAX_BUCKETS || first[b][0] < first[pick][0] ||
		    (first[b][0] == first[pick][0] && first[b][1] < first[pick][1]))
			pick = b;
	}
	*count = 0;
	if (pick == SB_MAX_BUCKETS)
		return pick;
	for (uint32_t j = 0; j < k; j++)
		if (scratch[4 * j + 3] == pick)
			memmove(scratch + 4 * (*count)++, scratch + 4 * j, 4 * sizeof(uint64_t));
	return pick;
}

uint32_t sb_claim(void *base, uint32_t batcher, uint32_t max_n, uint32_t flush_n,
		  uint64_t cutoff_ns, uint64_t expire_ns, const sb_shape *shape,
		  uint64_t *scratch, uint32_t *slots, uint32_t *gens, uint32_t *lengths,
		  uint64_t *report)
{
	struct ready_iter it = READY_ITER;
	uint32_t k = 0, claimed = 0, expired = 0, bucket = 0;
	uint64_t oldest = UINT64_MAX, now = sb_now_ns();
	report[SB_R_CLAIM_NS] = 0;
	report[SB_R_BUCKET] = 0;
	for (uint32_t slot; (slot = next_ready(base, &it)) != NO_SLOT;) {
		const sb_slot_meta *m = meta_at(base, slot);
		uint64_t deadline = m->deadline_ns;
		if (deadline && deadline < expire_ns) {
			expired += expire_one(base, slot, now);
			continue;
		}
		uint64_t *e = scratch + 4 * k++;
		e[0] = it.level;
		e[1] = m->arrival_ns;
		e[2] = slot;
		e[3] = shape && shape->buckets ? length_bucket(shape, m->length) : 0;
		if (m->arrival_ns < oldest)
			oldest = m->arrival_ns;
	}
	if (expired)
		bump_done_seq(hdr(base)); /* their waiters may sleep on done_seq */
	report[SB_R_READY] = k;
	report[SB_R_OLDEST_NS] = oldest;
	report[SB_R_EXPIRED] = expired;
	if (batcher > SB_BATCHER_MASK || max_n == 0 || k == 0)
		return 0;
	uint32_t n = k; /* how many to claim, of the k eligible */
	if (!shape) {
		if (k < flush_n && oldest > cutoff_ns)
			return 0; /* the flush rule says not yet */
		if (n > max_n)
			n = max_n;
	} else {
		bucket = pick_bucket(shape, scratch, k, flush_n, cutoff_ns, &k);
		if (bucket == SB_MAX_BUCKETS)
			return 0; /* no bucket is full or due yet */
		uint32_t most = shape->buckets && shape->most[bucket] < max_n
			? shape->most[bucket] : max_n;
		n = k < most ? k : most;
		if (shape->takes && n < shape->takes && shape->take[n] <= n)
			n = shape->take[n]; /* never more than eligible: slots holds max_n */
	}
	if (n < k) /* more eligible than taken: the most urgent, then the oldest */
		select_first(scratch, k, n);
	for (uint32_t j = 0; j < n; j++)
		claimed = claim_one(base, batcher, (uint32_t)scratch[4 * j + 2], now, slots,
				    gens, lengths, claimed);
	report[SB_R_CLAIM_NS] = now;
	report[SB_R_BUCKET] = bucket;
	return claimed;
}

static void put_error(const void *base, uint32_t slot, uint32_t status,
		      const char *msg, uint32_t msg_len)
{
	sb_slot_meta *m = meta_at(base, slot);
	if (msg_len > SB_ERRMSG_BYTES)
		msg_len = SB_ERRMSG_BYTES;
	memcpy(errmsg_at(base, slot), msg, msg_len);
	m->errmsg_len = msg_len;
	m->status = status;
}

static int complete_one(void *base, uint32_t slot, uint32_t gen, uint32_t batcher,
			uint32_t status, const char *msg, uint32_t msg_len, uint64_t now)
{
	sb_header *h = hdr(base);
	if (slot >= h->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(base, slot);
	uint64_t cur = sb_load_relaxed(c);
	for (;;) {
		uint32_t st = SB_CTL_STATE(cur);
		if (SB_CTL_GEN(cur) != gen || SB_CTL_BATCHER(cur) != batcher ||
		    (st != SB_CLAIMED && st != SB_ABANDONED)) {
			sb_add_relaxed(&h->words[SB_W_STALE], 1);
			return SB_ESTALE;
		}
		uint64_t want;
		if (st == SB_CLAIMED) {
			want = SB_CTL(gen, SB_CTL_PID(cur), 0,
				      status == SB_STATUS_OK ? SB_DONE : SB_FAILED);
			meta_at(base, slot)->done_ns = now; /* ours while CLAIMED */
			if (status != SB_STATUS_OK)
				put_error(base, slot, status, msg, msg_len);
		} else {
			want = freed(cur); /* nobody waits: drop the answer */
		}
		/* release: the output row (or error) is written before DONE */
		if (!sb_cas_acq_rel(c, &cur, want))
			continue; /* the client set its waiting bit: retry */
		if (SB_CTL_STATE(want) == SB_FREE) {
			slot_freed(h, slot);
			return SB_ESTALE;
		}
		sb_add_relaxed(&h->words[status == SB_STATUS_OK ? SB_W_ANSWERED
					 : status == SB_STATUS_EXPIRED ? SB_W_EXPIRED
					 : SB_W_ERRORS], 1);
		if (cur & SB_WAITING_BIT)
			futex_wake(futex_word(c), INT_MAX);
		return SB_OK;
	}
}

uint32_t sb_complete(void *base, uint32_t batcher, const uint32_t *slots,
		     const uint32_t *gens, uint32_t n, uint32_t status,
		     const char *msg, uint32_t msg_len)
{
	uint32_t delivered = 0;
	uint64_t now = sb_now_ns();
	for (uint32_t k = 0; k < n; k++)
		delivered += complete_one(base, slots[k], gens[k], batcher, status,
					  msg, msg_len, now) == SB_OK;
	return delivered;
}

static uint32_t bucket_of(uint64_t v)
{
	/* 4 linear steps per power of two from 256 ns: <= 25 % error, up to
	 * about 15 minutes in 128 buckets */
	if (v < 256)
		return 0;
	uint32_t msb = 63 - (uint32_t)__builtin_clzll(v);
	uint32_t b = 4 * (msb - 8) + (uint32_t)((v >> (msb - 2)) & 3);
	return b < SB_HIST_BUCKETS ? b : SB_HIST_BUCKETS - 1;
}

void sb_level_wait(const void *base, uint32_t level, uint64_t *buckets,
		   uint64_t *sum_ns, uint64_t *max_ns)
{
	const sb_header *h = hdr(base);
	if (level >= SB_MAX_PRIORITIES)
		return;
	for (uint32_t b = 0; b < SB_HIST_BUCKETS; b++)
		buckets[b] = sb_load_relaxed(&h->level_hist[level][b]);
	*sum_ns = sb_load_relaxed(&h->level_wait_sum[level]);
	*max_ns = sb_load_relaxed(&h->level_wait_max[level]);
}

uint64_t sb_bucket_lower_ns(uint32_t b)
{
	/* bucket_of inverted: bucket 4k + s starts at (4 + s) << (k + 6) */
	if (b == 0)
		return 0;
	if (b >= SB_HIST_BUCKETS)
		b = SB_HIST_BUCKETS - 1;
	return (uint64_t)(4 + b % 4) << (b / 4 + 6);
}

static void record_max(uint64_t *word, uint64_t v)
{
	uint64_t cur = sb_load_relaxed(word);
	/* relaxed: a statistic; the CAS only keeps the maximum monotonic */
	while (v > cur && !__atomic_compare_exchange_n(word, &cur, v, 0,
						       __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		;
}

int sb_fit_add(sb_fit *f, uint32_t n, uint64_t service_ns)
{
	if (f->warmup) {
		f->warmup--;
		return 0;
	}
	double s = (double)service_ns, keep = 1.0 - 1.0 / SB_FIT_MEMORY;
	if (f->batches) {
		double cap = SB_FIT_OUTLIER * (f->fixed_ns + n * f->per_item_ns) + 1;
		if (s > cap)
			s = cap;
	}
	f->w = f->w * keep + 1.0;
	f->n = f->n * keep + n;
	f->nn = f->nn * keep + (double)n * n;
	f->s = f->s * keep + s;
	f->ns = f->ns * keep + n * s;
	f->batches++;
	if (f->batches > SB_FIT_REFIT && f->batches % SB_FIT_REFIT)
		return 0;
	/* with one batch size seen so far, all of the time is fixed: no slope */
	double spread = f->w * f->nn - f->n * f->n, per_item = 0;
	if (spread > 1e-9 * f->w * f->nn) {
		per_item = (f->w * f->ns - f->n * f->s) / spread;
		if (per_item < 0)
			per_item = 0;
	}
	double fixed = (f->s - per_item * f->n) / f->w;
	f->fixed_ns = fixed > 0 ? (double)(uint64_t)fixed : 0; /* whole ns */
	f->per_item_ns = per_item;
	return 1;
}

int sb_finish_batch(void *base, const uint32_t *slots, uint32_t n,
		    uint64_t claim_ns, uint64_t done_ns, uint32_t zero_copy,
		    sb_fit *fit)
{
	sb_header *h = hdr(base);
	uint64_t worst = 0, total_wait = 0;
	for (uint32_t k = 0; k < n; k++) {
		if (slots[k] >= h->capacity)
			continue;
		/* the batcher's own copy of claim_ns; arrival_ns was set before
		 * the publish that our claim acquired */
		const sb_slot_meta *m = meta_at(base, slots[k]);
		uint64_t arrival = m->arrival_ns;
		uint64_t wait = claim_ns > arrival ? claim_ns - arrival : 0;
		uint32_t level = m->priority < SB_MAX_PRIORITIES ? m->priority : SB_MAX_PRIORITIES - 1;
		sb_add_relaxed(&h->hist[SB_H_QUEUE_WAIT][bucket_of(wait)], 1);
		sb_add_relaxed(&h->level_hist[level][bucket_of(wait)], 1);
		sb_add_relaxed(&h->level_wait_sum[level], wait);
		record_max(&h->level_wait_max[level], wait);
		total_wait += wait;
		if (wait > worst)
			worst = wait;
	}
	uint64_t service = done_ns > claim_ns ? done_ns - claim_ns : 0;
	sb_add_relaxed(&h->hist[SB_H_SERVICE][bucket_of(service)], 1);
	sb_add_relaxed(&h->hist[SB_H_BATCH_SIZE][n < SB_HIST_BUCKETS ? n : SB_HIST_BUCKETS - 1], 1);
	record_max(&h->words[SB_W_QUEUE_WAIT_MAX_NS], worst);
	record_max(&h->words[SB_W_SERVICE_MAX_NS], service);
	sb_add_relaxed(&h->words[SB_W_QUEUE_WAIT_SUM_NS], total_wait);
	sb_add_relaxed(&h->words[SB_W_SERVICE_SUM_NS], service);
	sb_add_relaxed(&h->words[zero_copy ? SB_W_ZERO_COPY : SB_W_GATHERED], 1);
	sb_add_relaxed(&h->words[SB_W_BATCHES], 1);
	sb_add_relaxed(&h->words[SB_W_ITEMS], n);
	bump_done_seq(h);
	if (!fit || !sb_fit_add(fit, n, service))
		return 0;
	/* relaxed: figures for an estimate, each word read on its own */
	sb_store_relaxed(&h->words[SB_W_FIT_FIXED_NS], (uint64_t)fit->fixed_ns);
	sb_store_relaxed(&h->words[SB_W_FIT_ITEM_PS], (uint64_t)(fit->per_item_ns * 1000));
	return 1;
}

/* ---- reaper ---- */

uint32_t sb_snapshot(const void *base, uint64_t *ctl, uint64_t *owner_start)
{
	uint32_t cap = hdr(base)->capacity;
	for (uint32_t i = 0; i < cap; i++) {
		uint64_t c = sb_load_acquire(ctl_at(base, i));
		const sb_slot_meta *m = meta_at(base, i);
		ctl[i] = c;
		/* the start time belongs to the pid in ctl only once the owner
		 * has written its pid into meta too (right after acquiring) */
		owner_start[i] = sb_load_relaxed(&m->owner_pid) == SB_CTL_PID(c)
					 ? sb_load_relaxed(&m->owner_start) : 0;
	}
	return cap;
}

int sb_reap_slot(void *base, uint32_t slot, uint64_t expected_ctl)
{
	sb_header *h = hdr(base);
	if (slot >= h->capacity)
		return SB_EBADARG;
	uint64_t want;
	switch (SB_CTL_STATE(expected_ctl)) {
	case SB_READY:
		unmark_ready(base, slot); /* before the CAS: see ring.h */
		/* fall through */
	case SB_WRITING:
	case SB_DONE:
	case SB_FAILED:
		want = freed(expected_ctl);
		break;
	case SB_CLAIMED: /* its batcher still writes the output: it frees it */
		want = with_state(expected_ctl & ~SB_WAITING_BIT, SB_ABANDONED);
		break;
	default:
		return SB_ESTALE;
	}
	/* the CAS fails if anything moved since the caller judged the owner */
	if (!sb_cas_acq_rel(ctl_at(base, slot), &expected_ctl, want))
		return SB_ESTALE;
	if (SB_CTL_STATE(want) == SB_FREE)
		slot_freed(h, slot);
	sb_add_relaxed(&h->words[SB_W_RECLAIMED], 1);
	return SB_OK;
}

uint32_t sb_reap_batcher(void *base, uint32_t batcher, uint32_t retry,
			 const char *msg, uint32_t msg_len, uint32_t *kept)
{
	sb_header *h = hdr(base);
	uint32_t failed = 0;
	*kept = 0;
	for (uint32_t i = 0; i < h->capacity; i++) {
		uint64_t *c = ctl_at(base, i);
		uint64_t cur = sb_load_acquire(c);
		for (;;) {
			uint32_t st = SB_CTL_STATE(cur);
			if ((st != SB_CLAIMED && st != SB_ABANDONED) ||
			    SB_CTL_BATCHER(cur) != batcher)
				break;
			/* kept as it is, CLAIMED(g, b), for b's successor: unless
			 * b died retrying it alone (the successor's mark, written
			 * before b died, which the caller saw: its exit) */
			if (st == SB_CLAIMED && retry &&
			    meta_at(base, i)->retry != SB_RETRY_ALONE) {
				(*kept)++;
				break;
			}
			uint64_t want = st == SB_ABANDONED ? freed(cur)
				: SB_CTL(SB_CTL_GEN(cur), SB_CTL_PID(cur), 0, SB_FAILED);
			if (st == SB_CLAIMED)
				put_error(base, i, SB_STATUS_BATCHER_DIED, msg, msg_len);
			/* release: the error text is written before FAILED */
			if (!sb_cas_acq_rel(c, &cur, want))
				continue;
			if (st == SB_ABANDONED)
				slot_freed(h, i);
			if (st == SB_CLAIMED) {
				failed++;
				sb_add_relaxed(&h->words[SB_W_ERRORS], 1);
				if (cur & SB_WAITING_BIT)
					futex_wake(futex_word(c), INT_MAX);
			}
			break;
		}
	}
	if (failed)
		bump_done_seq(h);
	return failed;
}

uint32_t sb_inherit(void *base, uint32_t batcher, uint64_t expire_ns, uint32_t max,
		    uint32_t *slots, uint32_t *gens, uint32_t *lengths)
{
	static const char why[] = "deadline passed before its retry (its batcher died) "
				  "could start it (not computed)";
	uint32_t n = 0, settled = 0;
	uint64_t now = sb_now_ns();
	for (uint32_t i = 0; i < hdr(base)->capacity; i++) {
		/* acquire: pairs with the publish's release, the length and
		 * deadline read below are the client's (the claim and the
		 * reaper's keep since changed neither) */
		uint64_t cur = sb_load_acquire(ctl_at(base, i));
		uint32_t st = SB_CTL_STATE(cur), gen = SB_CTL_GEN(cur);
		if ((st != SB_CLAIMED && st != SB_ABANDONED) || SB_CTL_BATCHER(cur) != batcher)
			continue;
		const sb_slot_meta *m = meta_at(base, i);
		if (st == SB_ABANDONED) { /* withdrawn while kept: completing frees it */
			complete_one(base, i, gen, batcher, SB_STATUS_OK, NULL, 0, now);
		} else if (m->deadline_ns && m->deadline_ns < expire_ns) {
			settled += complete_one(base, i, gen, batcher, SB_STATUS_EXPIRED,
						why, sizeof(why) - 1, now) == SB_OK;
		} else {
			if (n < max) {
				slots[n] = i;
				gens[n] = gen;
				lengths[n] = m->length;
			}
			n++;
		}
	}
	if (settled)
		bump_done_seq(hdr(base));
	return n;
}

int sb_retry_alone(void *base, uint32_t batcher, uint32_t slot, uint32_t gen)
{
	if (slot >= hdr(base)->capacity)
		return SB_EBADARG;
	uint64_t cur = sb_load_relaxed(ctl_at(base, slot));
	if (SB_CTL_STATE(cur) != SB_CLAIMED || SB_CTL_GEN(cur) != gen ||
	    SB_CTL_BATCHER(cur) != batcher)
		return SB_ESTALE; /* abandoned meanwhile: its completion frees it */
	/* CLAIMED by us: ours to write; the reaper reads it only once we are
	 * dead (after waiting for our exit) */
	meta_at(base, slot)->retry = SB_RETRY_ALONE;
	sb_add_relaxed(&hdr(base)->words[SB_W_RETRIED], 1);
	return SB_OK;
}

void sb_histogram(const void *base, int which, uint64_t *buckets)
{
	if (which < 0 || which > SB_H_BATCH_SIZE)
		return;
	for (uint32_t b = 0; b < SB_HIST_BUCKETS; b++)
		buckets[b] = sb_load_relaxed(&hdr(base)->hist[which][b]);
}
