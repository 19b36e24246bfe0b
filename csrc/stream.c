/*
 * stream.c - the streamed answers of an iterative engine (steps > 0): each
 * slot's output rows hold up to `steps` chunks, and its chunk word counts
 * those written. One writer at a time: the client while WRITING (it resets
 * the word), then the slot's batcher while CLAIMED (one store per step).
 * The client follows the word and copies the chunks it counts; the word is
 * data like any other: a count beyond steps is refused, never used.
 */
#include "segment.h"

#include <limits.h>

int sb_stream_open(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t max_steps)
{
	if (!r->steps || slot >= r->capacity)
		return SB_EBADARG;
	uint64_t cur = sb_load_relaxed(ctl_at(r, slot));
	if (SB_CTL_STATE(cur) != SB_WRITING || SB_CTL_GEN(cur) != gen)
		return SB_ESTALE;
	sb_slot_stream *s = stream_at(r, slot);
	/* relaxed: the owner's while WRITING; the publish's release CAS orders
	 * them before the batcher's claim reads them */
	sb_store_relaxed(&s->chunks, 0);
	sb_store_relaxed(&s->max_steps, max_steps);
	sb_store_relaxed(&s->last_ns, 0);
	return SB_OK;
}

int sb_wait_chunks(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t seen,
		   int64_t timeout_ns, uint64_t spin_ns, uint32_t *chunks)
{
	if (!r->steps || slot >= r->capacity)
		return SB_EBADARG;
	sb_slot_stream *s = stream_at(r, slot);
	uint64_t until = timeout_ns < 0 ? UINT64_MAX : sat_add(sb_now_ns(), (uint64_t)timeout_ns);
	/* acquire (here and below): the chunk rows written before the count */
	uint32_t cur = spin_while32(&s->chunks, seen, spin_ns);
	for (;;) {
		/* acquire: a settled slot's final count is read after it */
		uint64_t ctl = sb_load_acquire(ctl_at(r, slot));
		uint32_t st = SB_CTL_STATE(ctl);
		if (SB_CTL_GEN(ctl) != gen)
			return SB_ESTALE;
		if (cur != seen || (st != SB_READY && st != SB_CLAIMED)) {
			cur = sb_load_acquire(&s->chunks);
			break;
		}
		uint64_t now = sb_now_ns();
		if (now >= until)
			return SB_ETIMEOUT;
		/* its waker, sb_stream_put or end_stream, is seq_cst as seq_bump */
		seq_wait(&s->chunks, &s->waiters, seen,
			 until == UINT64_MAX ? -1 : (int64_t)(until - now));
		cur = sb_load_acquire(&s->chunks);
	}
	if ((cur & SB_CHUNKS_COUNT) > r->steps) {
		corrupt(r);
		return SB_ECORRUPT;
	}
	*chunks = cur;
	return SB_OK;
}

uint32_t sb_poll_chunks(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
			const uint32_t *seen, uint32_t n, uint8_t *moved)
{
	uint32_t count = 0;
	for (uint32_t k = 0; k < n; k++) {
		uint32_t slot = slots[k];
		uint8_t m = 1; /* a bad argument too: sb_wait_chunks says which */
		if (r->steps && slot < r->capacity) {
			/* acquire: as sb_wait_chunks's, so that a word moved before
			 * the wake that brought its reader here is seen moved */
			uint32_t cur = sb_load_acquire(&stream_at(r, slot)->chunks);
			uint64_t ctl = sb_load_acquire(ctl_at(r, slot));
			uint32_t st = SB_CTL_STATE(ctl);
			m = SB_CTL_GEN(ctl) != gens[k] || cur != seen[k] ||
			    (st != SB_READY && st != SB_CLAIMED);
		}
		moved[k] = m;
		count += m;
	}
	return count;
}

void sb_stream_limits(sb_ring *r, const uint32_t *slots, uint32_t n, uint32_t *max_steps,
		      uint64_t *deadlines)
{
	for (uint32_t k = 0; k < n; k++) {
		uint32_t want = 0;
		deadlines[k] = 0;
		if (r->steps && slots[k] < r->capacity) {
			/* relaxed: set before the publish our claim acquired; each
			 * loaded once */
			want = sb_load_relaxed(&stream_at(r, slots[k])->max_steps);
			deadlines[k] = sb_load_relaxed(&meta_at(r, slots[k])->deadline_ns);
		}
		max_steps[k] = want == 0 || want > r->steps ? r->steps : want;
	}
}

uint32_t sb_stream_put(sb_ring *r, uint32_t batcher, const uint32_t *slots,
		       const uint32_t *gens, uint32_t n, const uint32_t *counts,
		       const uint32_t *ends, int32_t *states)
{
	const uint32_t how = SB_CHUNKS_END | SB_CHUNKS_STOP | SB_CHUNKS_LIMIT;
	uint64_t now = sb_now_ns();
	uint32_t put = 0;
	sb_wakes w = {0};
	for (uint32_t k = 0; k < n; k++) {
		uint32_t slot = slots[k];
		states[k] = -1;
		if (!r->steps || slot >= r->capacity)
			continue;
		uint64_t cur = sb_load_relaxed(ctl_at(r, slot));
		if (SB_CTL_GEN(cur) != gens[k] || SB_CTL_BATCHER(cur) != batcher)
			continue;
		uint32_t st = SB_CTL_STATE(cur);
		states[k] = (int32_t)st;
		if (st != SB_CLAIMED) /* ABANDONED: nobody reads it any more */
			continue;
		sb_slot_stream *s = stream_at(r, slot);
		uint32_t count = counts[k] < r->steps ? counts[k] : r->steps;
		/* last_ns is ours while CLAIMED: relaxed */
		uint64_t last = sb_load_relaxed(&s->last_ns);
		if (last)
			record_stream_time(r, SB_H_CHUNK, now > last ? now - last : 0);
		else { /* its first chunk: n is its running batch, kept for its client
			* (relaxed: the chunk word's store below publishes it) */
			uint64_t arrival = sb_load_relaxed(&meta_at(r, slot)->arrival_ns);
			record_stream_time(r, SB_H_TTFT, now > arrival ? now - arrival : 0);
			sb_store_relaxed(&s->batch_size, n);
		}
		sb_store_relaxed(&s->last_ns, now);
		if (ends[k] & how) { /* its last chunk */
			uint64_t arrival = sb_load_relaxed(&meta_at(r, slot)->arrival_ns);
			record_e2e(r, now > arrival ? now - arrival : 0);
		}
		/* seq_cst, as seq_bump: publishes the rows written before it, and
		 * either we see the client's waiter count or its futex_wait sees
		 * the new count */
		sb_store_seq_cst(&s->chunks, count | (ends[k] & how));
		if (sb_load_seq_cst(&s->waiters))
			futex_wake(&s->chunks, INT_MAX);
		note_wake(r, &w, slot, gens[k]);
		put++;
	}
	send_wakes(r, &w);
	sb_add_relaxed(&hdr(r)->chunks_total, put); /* relaxed: a count */
	return put;
}
