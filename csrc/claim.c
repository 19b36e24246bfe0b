/*
 * claim.c - the batcher's claim: one pass over the ready[] bitmaps, the
 * flush rule's test, the choice of the most urgent, oldest requests, and
 * their CAS READY -> CLAIMED. The pass is bounded by the process's own
 * geometry; a slot is claimed (or failed unstarted) only in the generation
 * the pass saw, so a slot reused meanwhile is never acted on by mistake.
 */
#include "segment.h"

#include <string.h>

/* The READY slots, most urgent level first and ascending within a level,
 * from one pass over ready[] and the ctl of each set bit: O(L * C/64 + set
 * bits). Start from READY_ITER; next_ready returns the next READY slot (its
 * level, control word and whether its priority is out of range in it), or
 * NO_SLOT when the pass is over. A set bit whose slot is not READY at that
 * level is a stale hint: skipped. */
#define NO_SLOT UINT32_MAX
struct ready_iter {
	uint32_t level; /* the level being read */
	uint32_t word;  /* the next word of it to load */
	uint64_t bits;  /* the set bits of the word before it, not yet looked at */
	uint64_t ctl;   /* the returned slot's control word, as the pass saw it */
	uint32_t bad;   /* the returned slot's priority is no level */
};
#define READY_ITER {0, 0, 0, 0, 0}

static uint32_t next_ready(sb_ring *r, struct ready_iter *it)
{
	for (;;) {
		while (!it->bits) {
			if (it->word >= r->ready_words) {
				if (++it->level >= r->levels)
					return NO_SLOT;
				it->word = 0;
			}
			/* relaxed: the ctl load below is what is trusted */
			it->bits = sb_load_relaxed(ready_word(r, it->level, it->word++));
		}
		uint32_t slot = (it->word - 1) * 64 + (uint32_t)__builtin_ctzll(it->bits);
		it->bits &= it->bits - 1;
		if (slot >= r->capacity) { /* past the last slot: no publish sets it */
			clear_ready(r, it->level, slot);
			corrupt(r);
			continue;
		}
		uint64_t cur = sb_load_relaxed(ctl_at(r, slot));
		if (SB_CTL_STATE(cur) != SB_READY)
			continue;
		/* acquire: pairs with the publish CAS, so meta is set */
		sb_fence_acquire();
		uint32_t priority = sb_load_relaxed(&meta_at(r, slot)->priority);
		it->ctl = cur;
		it->bad = priority >= r->levels;
		if (priority == it->level || it->bad)
			return slot;
	}
}

/* READY(gen) -> CLAIMED(gen, batcher), its bit at `level` (as the pass saw
 * it; no level: all of them) cleared after the CAS (ring.h). 1 if it did. */
static int claim_exact(sb_ring *r, uint32_t batcher, uint32_t slot, uint32_t gen,
		       uint32_t level)
{
	uint64_t *c = ctl_at(r, slot);
	uint64_t cur = sb_load_relaxed(c);
	for (;;) {
		if (SB_CTL_STATE(cur) != SB_READY || SB_CTL_GEN(cur) != gen)
			return 0; /* withdrawn, or reused since the pass saw it */
		/* keeps the waiting bit: the client may already sleep */
		uint64_t next = with_state(cur, SB_CLAIMED) | ((uint64_t)batcher << SB_BATCHER_SHIFT);
		/* acquire: the client's input row and meta are visible */
		if (sb_cas_acq_rel(c, &cur, next))
			break;
	}
	if (level < r->levels) {
		clear_ready(r, level, slot);
	} else {
		for (level = 0; level < r->levels; level++)
			clear_ready(r, level, slot);
	}
	return 1;
}

/* Claims slot i (generation gen) for batcher, adding it to the claimed n
 * (slots/gens/lengths, kept in ascending slot order, so contiguous rows
 * show up as consecutive indices). Returns the new count. */
static uint32_t claim_one(sb_ring *r, uint32_t batcher, uint32_t i, uint32_t gen,
			  uint32_t level, uint64_t claim_ns, uint32_t *slots,
			  uint32_t *gens, uint32_t *lengths, uint32_t n)
{
	if (!claim_exact(r, batcher, i, gen, level))
		return n;
	sb_slot_meta *m = meta_at(r, i);
	sb_store_relaxed(&m->claim_ns, claim_ns); /* ours while CLAIMED */
	uint32_t p = n++;
	for (; p > 0 && slots[p - 1] > i; p--) {
		slots[p] = slots[p - 1];
		gens[p] = gens[p - 1];
		lengths[p] = lengths[p - 1];
	}
	slots[p] = i;
	gens[p] = gen;
	/* read once: the batcher uses this copy (a value: Python bounds it) */
	lengths[p] = sb_load_relaxed(&m->length);
	return n;
}

/* Fails a READY request unstarted, in the generation the pass saw: claimed
 * first (so nothing is written to a slot that is not ours), then failed
 * with status as any claimed request is. 1 if it did. */
static int fail_unstarted(sb_ring *r, uint32_t batcher, uint32_t slot, uint64_t seen,
			  uint32_t level, uint32_t status, const char *why,
			  uint32_t why_len, uint64_t now, sb_wakes *w)
{
	uint32_t gen = SB_CTL_GEN(seen);
	if (!claim_exact(r, batcher, slot, gen, level))
		return 0;
	/* ours while CLAIMED: its queue wait ends here, unserved (no batch) */
	sb_store_relaxed(&meta_at(r, slot)->claim_ns, now);
	return complete_one(r, slot, gen, batcher, status, why, why_len, now, 0, w) == SB_OK;
}

/* Entries {level, arrival_ns, slot, bucket | gen << 32}: x before y when more
 * urgent, then older, then lower (slots are unique: a total order) */
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
	while (b + 1 < shape->buckets && b + 1 < SB_MAX_BUCKETS && length > shape->bound[b])
		b++;
	return b;
}

static inline uint32_t entry_bucket(const uint64_t *e) { return (uint32_t)e[3]; }
static inline uint32_t entry_gen(const uint64_t *e) { return (uint32_t)(e[3] >> 32); }

/* With a shape: the bucket to claim from (SB_MAX_BUCKETS: none is full or
 * due), its entries moved to the front of scratch (*count of them). */
static uint32_t pick_bucket(const sb_shape *shape, uint64_t *scratch, uint32_t k,
			    uint32_t flush_n, uint64_t cutoff_ns, uint32_t *count)
{
	uint32_t n[SB_MAX_BUCKETS] = {0}, pick = SB_MAX_BUCKETS;
	uint32_t buckets = shape->buckets ? shape->buckets : 1;
	uint64_t oldest[SB_MAX_BUCKETS], first[SB_MAX_BUCKETS][2]; /* {level, arrival} */
	if (buckets > SB_MAX_BUCKETS)
		buckets = SB_MAX_BUCKETS;
	for (uint32_t j = 0; j < k; j++) {
		const uint64_t *e = scratch + 4 * j;
		uint32_t b = entry_bucket(e);
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
		if (entry_bucket(scratch + 4 * j) == pick)
			memmove(scratch + 4 * (*count)++, scratch + 4 * j, 4 * sizeof(uint64_t));
	return pick;
}

uint32_t sb_claim(sb_ring *r, uint32_t batcher, uint32_t max_n, uint32_t flush_n,
		  uint64_t cutoff_ns, uint64_t expire_ns, const sb_shape *shape,
		  uint64_t *scratch, uint32_t scratch_n, uint32_t *slots, uint32_t *gens,
		  uint32_t *lengths, uint64_t *report)
{
	static const char expired_why[] =
		"deadline passed before a batch could start it (not computed)";
	static const char corrupt_why[] =
		"its priority in the segment is no priority level (not computed)";
	struct ready_iter it = READY_ITER;
	uint32_t k = 0, ready = 0, claimed = 0, expired = 0, failed = 0, bucket = 0;
	uint64_t missed = 0, missed_predicted = 0, missed_seen = 0;
	uint64_t oldest = UINT64_MAX, now = sb_now_ns();
	sb_wakes w = {0};
	report[SB_R_CLAIM_NS] = 0;
	report[SB_R_BUCKET] = 0;
	report[SB_R_READY] = 0;
	report[SB_R_OLDEST_NS] = oldest;
	report[SB_R_EXPIRED] = 0;
	if (batcher > SB_BATCHER_MASK)
		return 0;
	for (uint32_t slot; (slot = next_ready(r, &it)) != NO_SLOT;) {
		if (it.bad) { /* a batcher that meets a corrupt slot fails it, goes on */
			corrupt(r);
			failed += fail_unstarted(r, batcher, slot, it.ctl, UINT32_MAX,
						 SB_STATUS_CORRUPT, corrupt_why,
						 sizeof(corrupt_why) - 1, now, &w);
			continue;
		}
		const sb_slot_meta *m = meta_at(r, slot);
		uint64_t deadline = sb_load_relaxed(&m->deadline_ns);
		if (deadline && deadline < expire_ns) {
			expired += fail_unstarted(r, batcher, slot, it.ctl, it.level,
						  SB_STATUS_EXPIRED, expired_why,
						  sizeof(expired_why) - 1, now, &w);
			/* admitted on a prediction: it would have waited past its
			 * deadline at least. Left out, the predictions would be
			 * judged by the requests that made it alone (too short
			 * waits), and the correction would admit ever more */
			uint64_t predicted_ns = 1000ull * sb_load_relaxed(&m->predicted_us);
			uint64_t arrival = sb_load_relaxed(&m->arrival_ns), until = now > deadline ? now : deadline;
			if (predicted_ns) {
				missed++;
				missed_predicted += predicted_ns;
				missed_seen += until > arrival ? until - arrival : 0;
			}
			continue;
		}
		uint64_t arrival = sb_load_relaxed(&m->arrival_ns);
		ready++;
		if (arrival < oldest)
			oldest = arrival;
		if (k == scratch_n)
			continue; /* the claim chooses among those it has room for */
		uint64_t *e = scratch + 4 * k++;
		e[0] = it.level;
		e[1] = arrival;
		e[2] = slot;
		e[3] = (uint64_t)SB_CTL_GEN(it.ctl) << 32 |
		       (shape && shape->buckets ? length_bucket(shape, sb_load_relaxed(&m->length)) : 0);
	}
	if (expired + failed) {
		send_wakes(r, &w);
		bump_done_seq(r);
	}
	if (missed)
		judge_predictions(r, missed, missed_predicted, missed_seen, missed);
	report[SB_R_READY] = ready;
	report[SB_R_OLDEST_NS] = oldest;
	report[SB_R_EXPIRED] = expired;
	if (max_n == 0 || k == 0)
		return 0;
	uint32_t n = k; /* how many to claim, of the k eligible */
	if (!shape) {
		if (ready < flush_n && oldest > cutoff_ns)
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
		if (shape->takes && n < shape->takes && n <= SB_MAX_TAKE && shape->take[n] <= n)
			n = shape->take[n]; /* never more than eligible: slots holds max_n */
	}
	if (n < k) /* more eligible than taken: the most urgent, then the oldest */
		select_first(scratch, k, n);
	for (uint32_t j = 0; j < n; j++) {
		const uint64_t *e = scratch + 4 * j;
		claimed = claim_one(r, batcher, (uint32_t)e[2], entry_gen(e), (uint32_t)e[0],
				    now, slots, gens, lengths, claimed);
	}
	report[SB_R_CLAIM_NS] = now;
	report[SB_R_BUCKET] = bucket;
	return claimed;
}

void sb_claimed_ranks(sb_ring *r, const uint32_t *slots, uint32_t n, uint32_t *levels,
		      uint64_t *arrivals)
{
	for (uint32_t k = 0; k < n; k++) {
		if (slots[k] >= r->capacity) {
			levels[k] = r->levels;
			arrivals[k] = UINT64_MAX;
			continue;
		}
		/* relaxed: written before the publish our claim acquired */
		const sb_slot_meta *m = meta_at(r, slots[k]);
		uint32_t level = sb_load_relaxed(&m->priority);
		levels[k] = level < r->levels ? level : r->levels;
		arrivals[k] = sb_load_relaxed(&m->arrival_ns);
	}
}
