/*
 * reap.c - moving on what dead processes left: a dead client's slots (the
 * supervisor, or a client making room in a full ring, judges the owner by
 * a snapshot and reaps with one CAS from exactly what it judged) and a dead
 * batcher's claims. These run in the supervisor, which every client
 * depends on: every loop is bounded by the process's own geometry.
 */
#include "segment.h"

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
	uint64_t want = withdrawn(expected_ctl, 1);
	if (!want)
		return SB_ESTALE;
	if (SB_CTL_STATE(expected_ctl) == SB_READY)
		unmark_ready(r, slot); /* before the CAS: see ring.h */
	/* the CAS fails if anything moved since the caller judged the owner */
	if (!sb_cas_acq_rel(ctl_at(r, slot), &expected_ctl, want))
		return SB_ESTALE;
	if (SB_CTL_STATE(want) == SB_FREE)
		slot_freed(r, slot);
	sb_add_relaxed(&hdr(r)->words[SB_W_RECLAIMED], 1);
	return SB_OK;
}

uint32_t sb_reap_batcher(sb_ring *r, uint32_t batcher, uint32_t retry,
			 const char *msg, uint32_t msg_len, const char *begun_msg,
			 uint32_t begun_len, uint32_t *kept)
{
	uint32_t failed = 0;
	uint64_t now = sb_now_ns();
	sb_wakes w = {0};
	*kept = 0;
	if (batcher < SB_MAX_INSTANCES) /* relaxed: a figure; its running batch is gone */
		sb_store_relaxed(&hdr(r)->active[batcher], 0);
	for (uint32_t i = 0; i < r->capacity; i++) {
		uint64_t cur = sb_load_acquire(ctl_at(r, i));
		uint32_t st = SB_CTL_STATE(cur);
		if ((st != SB_CLAIMED && st != SB_ABANDONED) || SB_CTL_BATCHER(cur) != batcher)
			continue;
		/* kept as it is, CLAIMED(g, b), for b's successor: unless b died
		 * retrying it alone (the successor's mark, written before b died,
		 * which the caller saw: its exit), or its stream had begun (its
		 * client holds chunks a retry would send again) */
		int begun = r->steps && sb_load_relaxed(&stream_at(r, i)->chunks);
		if (st == SB_CLAIMED && retry && !begun &&
		    sb_load_relaxed(&meta_at(r, i)->retry) != SB_RETRY_ALONE) {
			(*kept)++;
			continue;
		}
		/* as b would have: failed, or freed if withdrawn meanwhile */
		failed += complete_one(r, i, SB_CTL_GEN(cur), batcher, SB_STATUS_BATCHER_DIED,
				       begun ? begun_msg : msg, begun ? begun_len : msg_len,
				       now, 0, &w) == SB_OK;
	}
	send_wakes(r, &w);
	if (failed)
		bump_done_seq(r);
	return failed;
}
