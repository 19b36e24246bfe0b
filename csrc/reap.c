/*
 * reap.c - moving on what dead processes left: a dead client's slots (the
 * supervisor, or a client making room in a full ring, judges the owner by
 * a snapshot and reaps with one CAS from exactly what it judged) and a dead
 * batcher's claims. These run in the supervisor, which every client
 * depends on: every loop is bounded by the process's own geometry.
 */
#include "segment.h"

/* see complete.c: a word that keeps moving is given up on, and counted */
#define CAS_TRIES 64

uint32_t sb_snapshot(const sb_ring *r, uint64_t *ctl, uint64_t *owner_start, uint32_t n)
{
	uint32_t cap = r->capacity < n ? r->capacity : n;
	for (uint32_t i = 0; i < cap; i++) {
		uint64_t c = sb_load_acquire(ctl_at(r, i));
		const sb_slot_meta *m = meta_at(r, i);
		ctl[i] = c;
		/* the start time belongs to the pid in ctl only once the owner
		 * has written its pid into meta too (right after acquiring) */
		owner_start[i] = sb_load_relaxed(&m->owner_pid) == SB_CTL_PID(c)
					 ? sb_load_relaxed(&m->owner_start) : 0;
	}
	return cap;
}

int sb_reap_slot(sb_ring *r, uint32_t slot, uint64_t expected_ctl)
{
	if (slot >= r->capacity)
		return SB_EBADARG;
	uint64_t want;
	switch (SB_CTL_STATE(expected_ctl)) {
	case SB_READY:
		unmark_ready(r, slot); /* before the CAS: see ring.h */
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
	if (!sb_cas_acq_rel(ctl_at(r, slot), &expected_ctl, want))
		return SB_ESTALE;
	if (SB_CTL_STATE(want) == SB_FREE)
		slot_freed(r, slot);
	sb_add_relaxed(&hdr(r)->words[SB_W_RECLAIMED], 1);
	return SB_OK;
}

uint32_t sb_reap_batcher(sb_ring *r, uint32_t batcher, uint32_t retry,
			 const char *msg, uint32_t msg_len, uint32_t *kept)
{
	sb_header *h = hdr(r);
	uint32_t failed = 0;
	*kept = 0;
	for (uint32_t i = 0; i < r->capacity; i++) {
		uint64_t *c = ctl_at(r, i);
		uint64_t cur = sb_load_acquire(c);
		int tries = 0;
		for (;; tries++) {
			uint32_t st = SB_CTL_STATE(cur);
			if ((st != SB_CLAIMED && st != SB_ABANDONED) ||
			    SB_CTL_BATCHER(cur) != batcher)
				break;
			if (tries == CAS_TRIES) {
				corrupt(r);
				break;
			}
			/* kept as it is, CLAIMED(g, b), for b's successor: unless
			 * b died retrying it alone (the successor's mark, written
			 * before b died, which the caller saw: its exit) */
			if (st == SB_CLAIMED && retry &&
			    sb_load_relaxed(&meta_at(r, i)->retry) != SB_RETRY_ALONE) {
				(*kept)++;
				break;
			}
			uint64_t want = st == SB_ABANDONED ? freed(cur)
				: SB_CTL(SB_CTL_GEN(cur), SB_CTL_PID(cur), 0, SB_FAILED);
			if (st == SB_CLAIMED)
				put_error(r, i, SB_STATUS_BATCHER_DIED, msg, msg_len);
			/* release: the error text is written before FAILED */
			if (!sb_cas_acq_rel(c, &cur, want))
				continue;
			if (st == SB_ABANDONED)
				slot_freed(r, i);
			if (st == SB_CLAIMED) {
				failed++;
				sb_add_relaxed(&h->words[SB_W_ERRORS], 1);
				wake_owner(c, cur);
			}
			break;
		}
	}
	if (failed)
		bump_done_seq(r);
	return failed;
}
