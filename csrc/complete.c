/*
 * complete.c - a batcher's answers: CLAIMED -> DONE or FAILED (or, for a
 * request withdrawn meanwhile, ABANDONED -> FREE; a stream's end with
 * either), and a dead batcher's successor taking over what it left.
 */
#include "segment.h"

#include <string.h>

/* A CAS on a control word fails when another party moved it; each retry
 * sees a new value. A process writing into the segment at random could
 * keep one word moving: the loops that must end (a batcher's completion,
 * the supervisor's reap) give up after this many and count the slot. */
#define CAS_TRIES 64

void put_error(sb_ring *r, uint32_t slot, uint32_t status, const char *msg,
	       uint32_t msg_len)
{
	sb_slot_meta *m = meta_at(r, slot);
	if (msg_len > SB_ERRMSG_BYTES)
		msg_len = SB_ERRMSG_BYTES;
	memcpy(errmsg_at(r, slot), msg, msg_len);
	/* relaxed: the release CAS to FAILED publishes them */
	sb_store_relaxed(&m->errmsg_len, (uint16_t)msg_len);
	sb_store_relaxed(&m->status, (uint16_t)status);
}

int complete_one(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t batcher,
		 uint32_t status, const char *msg, uint32_t msg_len, uint64_t now,
		 uint32_t batch, sb_wakes *w)
{
	sb_header *h = hdr(r);
	if (slot >= r->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(r, slot);
	uint64_t cur = sb_load_relaxed(c);
	for (int tries = 0; tries < CAS_TRIES; tries++) {
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
			/* ours while CLAIMED: relaxed, the release CAS publishes them */
			sb_store_relaxed(&meta_at(r, slot)->done_ns, now);
			sb_store_relaxed(&meta_at(r, slot)->batch_size, batch);
			if (status != SB_STATUS_OK)
				put_error(r, slot, status, msg, msg_len);
			end_stream(r, slot);
		} else {
			want = freed(cur); /* nobody waits: drop the answer */
		}
		/* release: the output row (or error) is written before DONE;
		 * seq_cst: the waker word is read after it (note_wake) */
		if (!sb_cas_seq_cst(c, &cur, want))
			continue; /* the client set its waiting bit: retry */
		if (SB_CTL_STATE(want) == SB_FREE) {
			slot_freed(r, slot);
			return SB_ESTALE;
		}
		sb_add_relaxed(&h->words[status == SB_STATUS_OK ? SB_W_ANSWERED
					 : status == SB_STATUS_EXPIRED ? SB_W_EXPIRED
					 : SB_W_ERRORS], 1);
		wake_owner(c, cur);
		wake_stream(r, slot);
		note_wake(r, w, slot, gen);
		return SB_OK;
	}
	corrupt(r);
	return SB_ECORRUPT;
}

uint32_t sb_complete(sb_ring *r, uint32_t batcher, const uint32_t *slots,
		     const uint32_t *gens, uint32_t n, uint32_t status,
		     const char *msg, uint32_t msg_len)
{
	uint32_t delivered = 0;
	uint64_t now = sb_now_ns();
	/* the n were answered together: one-shot, their batch (a stream's
	 * batch is its running one, recorded at its first chunk instead) */
	uint32_t batch = r->steps ? 0 : n;
	sb_wakes w = {0};
	for (uint32_t k = 0; k < n; k++)
		delivered += complete_one(r, slots[k], gens[k], batcher, status,
					  msg, msg_len, now, batch, &w) == SB_OK;
	send_wakes(r, &w);
	return delivered;
}

uint32_t sb_inherit(sb_ring *r, uint32_t batcher, uint64_t expire_ns, uint32_t max,
		    uint32_t *slots, uint32_t *gens, uint32_t *lengths)
{
	static const char why[] = "deadline passed before its retry (its batcher died) "
				  "could start it (not computed)";
	uint32_t n = 0, settled = 0;
	uint64_t now = sb_now_ns();
	sb_wakes w = {0};
	for (uint32_t i = 0; i < r->capacity; i++) {
		/* acquire: pairs with the publish's release, the length and
		 * deadline read below are the client's (the claim and the
		 * reaper's keep since changed neither) */
		uint64_t cur = sb_load_acquire(ctl_at(r, i));
		uint32_t st = SB_CTL_STATE(cur), gen = SB_CTL_GEN(cur);
		if ((st != SB_CLAIMED && st != SB_ABANDONED) || SB_CTL_BATCHER(cur) != batcher)
			continue;
		const sb_slot_meta *m = meta_at(r, i);
		uint64_t deadline = sb_load_relaxed(&m->deadline_ns);
		if (st == SB_ABANDONED) { /* withdrawn while kept: completing frees it */
			complete_one(r, i, gen, batcher, SB_STATUS_OK, NULL, 0, now, 0, &w);
		} else if (deadline && deadline < expire_ns) {
			settled += complete_one(r, i, gen, batcher, SB_STATUS_EXPIRED,
						why, sizeof(why) - 1, now, 0, &w) == SB_OK;
		} else {
			if (n < max) {
				slots[n] = i;
				gens[n] = gen;
				lengths[n] = sb_load_relaxed(&m->length);
			}
			n++;
		}
	}
	send_wakes(r, &w);
	if (settled)
		bump_done_seq(r);
	return n;
}

int sb_retry_alone(sb_ring *r, uint32_t batcher, uint32_t slot, uint32_t gen)
{
	if (slot >= r->capacity)
		return SB_EBADARG;
	uint64_t cur = sb_load_relaxed(ctl_at(r, slot));
	if (SB_CTL_STATE(cur) != SB_CLAIMED || SB_CTL_GEN(cur) != gen ||
	    SB_CTL_BATCHER(cur) != batcher)
		return SB_ESTALE; /* abandoned meanwhile: its completion frees it */
	/* CLAIMED by us: ours to write; the reaper reads it only once we are
	 * dead (after waiting for our exit) */
	sb_store_relaxed(&meta_at(r, slot)->retry, SB_RETRY_ALONE);
	sb_add_relaxed(&hdr(r)->words[SB_W_RETRIED], 1);
	return SB_OK;
}
