/*
 * client.c - a client's transitions: acquire, publish, wait, take, release,
 * cancel, abandon. Each touches a slot only through a CAS on its control
 * word, so a client killed between any two instructions leaves the slot in
 * one named state that the reaper moves on.
 */
#include "segment.h"

#include <limits.h>
#include <string.h>

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

void slot_freed(sb_ring *r, uint32_t slot)
{
	sb_header *h = hdr(r);
	lower_alloc_hint(h, slot);
	/* seq_cst: the freeing CAS comes before the read of free_waiters, as
	 * sb_acquire_wait counts itself before its last look (Dekker); on x86
	 * the CAS is a full barrier already and this costs one fence */
	sb_fence_seq_cst();
	if (sb_load_relaxed(&h->free_waiters))
		seq_bump(&h->free_seq, &h->free_waiters);
}

static int acquire_one(sb_ring *r, uint32_t pid, uint64_t start_ticks,
		       uint32_t *slot, uint32_t *gen)
{
	sb_header *h = hdr(r);
	uint32_t cap = r->capacity;
	/* relaxed: the hint only says where to start looking; the CAS below is
	 * what makes a slot ours. Any value is a start within the ring. */
	uint32_t i = sb_load_relaxed(&h->alloc_hint) % cap;
	/* two passes: a slot freed behind a pass while the ring is all but
	 * full would otherwise be missed (a spurious EFULL) */
	for (uint32_t k = 0; k < 2 * cap; k++, i = (i + 1 == cap) ? 0 : i + 1) {
		uint64_t *c = ctl_at(r, i);
		uint64_t cur = sb_load_relaxed(c);
		if (SB_CTL_STATE(cur) != SB_FREE)
			continue;
		/* acquire: the previous owner's last reads of this slot happen
		 * before our writes into it (pairs with the release to FREE) */
		if (!sb_cas_acq_rel(c, &cur, SB_CTL(SB_CTL_GEN(cur), pid, 0, SB_WRITING)))
			continue;
		sb_slot_meta *m = meta_at(r, i);
		/* relaxed: the reaper reads these racily and checks the pid in ctl */
		sb_store_relaxed(&m->owner_start, start_ticks);
		sb_store_relaxed(&m->owner_pid, pid);
		sb_store_relaxed(&m->status, SB_STATUS_OK);
		sb_store_relaxed(&m->errmsg_len, 0);
		*slot = i;
		*gen = SB_CTL_GEN(cur);
		/* the next request takes the next row: a burst is one contiguous batch */
		sb_store_relaxed(&h->alloc_hint, i + 1);
		return SB_OK;
	}
	return SB_EFULL;
}

int sb_acquire(sb_ring *r, uint32_t pid, uint64_t start_ticks,
	       uint32_t *slot, uint32_t *gen)
{
	if (pid == 0 || pid > SB_PID_MASK || r->capacity == 0)
		return SB_EBADARG;
	return acquire_one(r, pid, start_ticks, slot, gen);
}

uint32_t sb_acquire_many(sb_ring *r, uint32_t pid, uint64_t start_ticks,
			 uint32_t n, uint32_t *slots, uint32_t *gens)
{
	uint32_t k = 0;
	if (pid == 0 || pid > SB_PID_MASK || r->capacity == 0)
		return 0;
	while (k < n && acquire_one(r, pid, start_ticks, &slots[k], &gens[k]) == SB_OK)
		k++;
	return k;
}

static int publish_one(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t length,
		       uint64_t deadline_ns, uint32_t priority, uint64_t now,
		       uint32_t predicted_us)
{
	if (slot >= r->capacity || priority >= r->levels)
		return SB_EBADARG;
	uint64_t *c = ctl_at(r, slot);
	sb_slot_meta *m = meta_at(r, slot);
	uint64_t cur = sb_load_relaxed(c);
	if (SB_CTL_GEN(cur) != gen || SB_CTL_STATE(cur) != SB_WRITING)
		return SB_ESTALE;
	/* relaxed: the release CAS below publishes them */
	sb_store_relaxed(&m->length, length);
	sb_store_relaxed(&m->arrival_ns, now);
	sb_store_relaxed(&m->deadline_ns, deadline_ns);
	sb_store_relaxed(&m->priority, priority);
	sb_store_relaxed(&m->retry, SB_RETRY_NONE);
	sb_store_relaxed(&m->predicted_us, predicted_us);
	mark_ready(r, priority, slot); /* before READY: every READY slot has its bit */
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

int sb_publish(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t length,
	       uint64_t deadline_ns, uint32_t priority)
{
	int code = publish_one(r, slot, gen, length, deadline_ns, priority, sb_now_ns(),
			       take_predicted_us());
	if (code == SB_OK)
		work_arrived(hdr(r), 1);
	return code;
}

uint32_t sb_publish_many(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
			 uint32_t n, uint32_t length, uint64_t deadline_ns,
			 uint32_t priority)
{
	uint64_t now = sb_now_ns();
	uint32_t published = 0, predicted_us = take_predicted_us();
	for (uint32_t k = 0; k < n; k++)
		published += publish_one(r, slots[k], gens[k], length, deadline_ns,
					 priority, now, predicted_us) == SB_OK;
	if (published)
		work_arrived(hdr(r), published);
	return published;
}

int sb_submit(sb_ring *r, uint32_t pid, uint64_t start_ticks, const void *src,
	      uint64_t nbytes, uint32_t length, uint64_t deadline_ns,
	      uint32_t priority, uint32_t admit, uint32_t *ticket)
{
	if (r->inputs != 1 || nbytes > r->tensor_slot_bytes[0])
		return SB_EBADARG;
	if (admit && deadline_ns && sb_admit(r, priority, deadline_ns, &ticket[0]) != SB_OK)
		return SB_EOVERLOADED;
	int code = sb_acquire(r, pid, start_ticks, &ticket[0], &ticket[1]);
	if (code != SB_OK)
		return code;
	/* WRITING: the row is ours alone; publish's release CAS shows it */
	memcpy(tensor_row(r, 0, ticket[0]), src, nbytes);
	return sb_publish(r, ticket[0], ticket[1], length, deadline_ns, priority);
}

int sb_cancel(sb_ring *r, uint32_t slot, uint32_t gen)
{
	if (slot >= r->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(r, slot);
	uint64_t cur = sb_load_relaxed(c);
	do {
		if (SB_CTL_GEN(cur) != gen || SB_CTL_STATE(cur) != SB_WRITING)
			return SB_ESTALE;
	} while (!sb_cas_acq_rel(c, &cur, freed(cur)));
	slot_freed(r, slot);
	return SB_OK;
}

/* What a ticket's holder sees: SB_OK answered, SB_EFAILED failed (see
 * sb_slot_error), SB_EBUSY not yet, SB_ESTALE no longer its slot,
 * SB_ECORRUPT a state no engine process writes. */
static int answer_of(uint64_t cur, uint32_t gen)
{
	if (SB_CTL_GEN(cur) != gen)
		return SB_ESTALE;
	switch (SB_CTL_STATE(cur)) {
	case SB_DONE: return SB_OK;
	case SB_FAILED: return SB_EFAILED;
	case SB_READY:
	case SB_CLAIMED: return SB_EBUSY;
	case SB_FREE:
	case SB_WRITING:
	case SB_ABANDONED: return SB_ESTALE;
	}
	return SB_ECORRUPT;
}

int sb_wait_slot(sb_ring *r, uint32_t slot, uint32_t gen, int64_t timeout_ns,
		 uint64_t spin_ns)
{
	if (slot >= r->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(r, slot);
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
		int code = answer_of(cur, gen);
		if (code != SB_EBUSY) {
			if (code == SB_ECORRUPT)
				corrupt(r);
			return code;
		}
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

/* A held slot's stamps into times[SB_T_*] (0: not stamped): all of them once
 * settled (DONE, FAILED); of a stream with a chunk, all but its end. Its
 * batch size is data: one beyond max_batch is counted and reported as 0. */
static void read_times(sb_ring *r, uint32_t slot, int settled, uint64_t *times)
{
	const sb_slot_meta *m = meta_at(r, slot);
	uint32_t batch = 0;
	int begun = 0;
	if (r->steps) {
		/* acquire: the batcher's claim and batch stores before its count */
		begun = (sb_load_acquire(&stream_at(r, slot)->chunks) & SB_CHUNKS_COUNT) != 0;
		if (begun)
			batch = sb_load_relaxed(&stream_at(r, slot)->batch_size);
	} else if (settled) {
		batch = sb_load_relaxed(&m->batch_size);
	}
	if (batch > r->max_batch) {
		corrupt(r);
		batch = 0;
	}
	/* relaxed: the caller's acquire of the settled (or begun) slot orders them */
	times[SB_T_ARRIVAL] = sb_load_relaxed(&m->arrival_ns);
	times[SB_T_CLAIM] = settled || begun ? sb_load_relaxed(&m->claim_ns) : 0;
	times[SB_T_DONE] = settled ? sb_load_relaxed(&m->done_ns) : 0;
	times[SB_T_BATCH] = batch;
}

int sb_slot_times(sb_ring *r, uint32_t slot, uint32_t gen, uint64_t *times)
{
	times[SB_T_ARRIVAL] = times[SB_T_CLAIM] = times[SB_T_DONE] = times[SB_T_BATCH] = 0;
	if (slot >= r->capacity)
		return SB_EBADARG;
	/* acquire: pairs with the release CAS that settled it */
	uint64_t cur = sb_load_acquire(ctl_at(r, slot));
	uint32_t st = SB_CTL_STATE(cur);
	/* published and still its owner's: withdrawn (ABANDONED), its batcher
	 * may free it, and a new request stamp it, while we read */
	if (SB_CTL_GEN(cur) != gen || (st != SB_READY && st != SB_CLAIMED && st != SB_DONE &&
				       st != SB_FAILED))
		return SB_ESTALE;
	read_times(r, slot, st == SB_DONE || st == SB_FAILED, times);
	return SB_OK;
}

int sb_take(sb_ring *r, uint32_t slot, uint32_t gen, int64_t timeout_ns,
	    uint64_t spin_ns, void *dst, uint64_t nbytes, uint64_t *times)
{
	if (r->tensors != r->inputs + 1 || nbytes > r->tensor_slot_bytes[r->inputs])
		return SB_EBADARG;
	int code = sb_wait_slot(r, slot, gen, timeout_ns, spin_ns);
	if (code != SB_OK)
		return code;
	/* DONE is ours until we release it: wait_slot's acquire load made the
	 * row complete, and release's CAS keeps this read before a reuse */
	memcpy(dst, tensor_row(r, r->inputs, slot), nbytes);
	if (times)
		read_times(r, slot, 1, times);
	return sb_release(r, slot, gen);
}

int sb_release(sb_ring *r, uint32_t slot, uint32_t gen)
{
	if (slot >= r->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(r, slot);
	uint64_t cur = sb_load_relaxed(c);
	do {
		int code = answer_of(cur, gen);
		if (code != SB_OK && code != SB_EFAILED)
			return code == SB_EBUSY ? SB_EBUSY : SB_ESTALE;
		/* release: our reads of the output row finish before a new
		 * owner's acquire CAS lets it write the slot */
	} while (!sb_cas_acq_rel(c, &cur, freed(cur)));
	slot_freed(r, slot);
	return SB_OK;
}

int sb_wait_all(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
		uint32_t n, int64_t timeout_ns, uint64_t spin_ns)
{
	uint64_t deadline = timeout_ns < 0 ? 0 : sb_now_ns() + (uint64_t)timeout_ns;
	for (uint32_t k = 0; k < n; k++) {
		int code = sb_wait_slot(r, slots[k], gens[k],
					deadline ? remaining_ns(deadline) : -1, spin_ns);
		if (code != SB_OK && code != SB_EFAILED)
			return code; /* SB_ETIMEOUT, or a ticket no longer ours */
	}
	return SB_OK;
}

uint32_t sb_release_many(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
			 uint32_t n)
{
	uint32_t released = 0;
	for (uint32_t k = 0; k < n; k++)
		released += sb_release(r, slots[k], gens[k]) == SB_OK;
	return released;
}

/* A running request withdrawn: its batcher drops it at its next step, so a
 * place frees within one step (1 + 1 in the room word, ring.h), which admission
 * reads before that batcher has said so itself. Relaxed: a figure, which the
 * batcher overwrites after that step; lowered only, never raised. */
static void place_freeing(sb_ring *r, uint32_t batcher)
{
	uint64_t *word = word_at(r, SB_W_ROOM_STEPS + batcher), cur = sb_load_relaxed(word);
	while (cur > 2 && !__atomic_compare_exchange_n(word, &cur, 2, 0, __ATOMIC_RELAXED,
						       __ATOMIC_RELAXED))
		;
}

int sb_abandon(sb_ring *r, uint32_t slot, uint32_t gen)
{
	if (slot >= r->capacity)
		return SB_EBADARG;
	uint64_t *c = ctl_at(r, slot);
	uint64_t cur = sb_load_acquire(c);
	for (;;) {
		if (SB_CTL_GEN(cur) != gen)
			return SB_ESTALE;
		uint32_t st = SB_CTL_STATE(cur);
		if (st == SB_DONE || st == SB_FAILED)
			return SB_EBUSY; /* answered after all: read and release */
		uint64_t want = withdrawn(cur, 0);
		if (!want)
			return SB_ESTALE;
		if (st == SB_READY)
			unmark_ready(r, slot); /* before the CAS: see ring.h */
		if (sb_cas_acq_rel(c, &cur, want)) {
			if (SB_CTL_STATE(want) == SB_FREE)
				slot_freed(r, slot);
			else if (r->steps)
				place_freeing(r, SB_CTL_BATCHER(cur));
			return SB_OK; /* the caller counts it if it was a timeout */
		}
	}
}

int sb_poll(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
	    uint32_t n, int32_t *states)
{
	int pending = 0;
	for (uint32_t k = 0; k < n; k++) {
		if (slots[k] >= r->capacity) {
			states[k] = SB_EBADARG;
			continue;
		}
		/* acquire: as in sb_wait_slot */
		states[k] = answer_of(sb_load_acquire(ctl_at(r, slots[k])), gens[k]);
		if (states[k] == SB_ECORRUPT)
			corrupt(r);
		pending += states[k] == SB_EBUSY;
	}
	return pending;
}

uint32_t sb_slot_error(sb_ring *r, uint32_t slot, char *msg,
		       uint32_t msg_cap, uint32_t *msg_len)
{
	*msg_len = 0;
	if (slot >= r->capacity)
		return SB_STATUS_OK;
	const sb_slot_meta *m = meta_at(r, slot);
	uint32_t len = sb_load_relaxed(&m->errmsg_len); /* once: checked, then used */
	if (len > SB_ERRMSG_BYTES) {
		corrupt(r);
		len = SB_ERRMSG_BYTES;
	}
	if (len > msg_cap)
		len = msg_cap;
	memcpy(msg, errmsg_at(r, slot), len);
	*msg_len = len;
	return sb_load_relaxed(&m->status); /* a value: the caller maps it */
}

int sb_acquire_wait(sb_ring *r, uint32_t pid, uint64_t start_ticks,
		    int64_t timeout_ns, uint32_t *slot, uint32_t *gen)
{
	sb_header *h = hdr(r);
	if (pid == 0 || pid > SB_PID_MASK || r->capacity == 0)
		return SB_EBADARG;
	uint64_t deadline = sb_now_ns() + (timeout_ns > 0 ? (uint64_t)timeout_ns : 0);
	for (;;) {
		/* counted before the look, so a slot freed after the look wakes us
		 * (see slot_freed); the fence keeps the look after the count */
		uint32_t seen = sb_load_acquire(&h->free_seq);
		sb_add_seq_cst(&h->free_waiters, 1);
		sb_fence_seq_cst();
		int code = acquire_one(r, pid, start_ticks, slot, gen);
		int64_t left = remaining_ns(deadline);
		if (code == SB_EFULL && left > 0)
			futex_wait(&h->free_seq, seen, left);
		sb_sub_seq_cst(&h->free_waiters, 1);
		if (code != SB_EFULL || left == 0)
			return code;
	}
}
