/*
 * wait.c - the segment's sequence words every role sleeps on: done_seq
 * (async waiters), evict_seq (evictors) and work_seq (batchers), built on
 * futex.c's primitives.
 *
 * A wake is a hint: every waiter re-reads the word it waits for. A sleeper
 * count beside a word (garbage in it costs a wasted wake or a missed one,
 * which the callers' bounded slices absorb) lets a waker skip the syscall.
 */
#include "segment.h"
#include "futex.h"

#include <limits.h>

void sb_wake_done(sb_ring *r)
{
	bump_done_seq(r);
}

uint32_t sb_done_seq(const sb_ring *r)
{
	/* acquire: pairs with seq_bump's seq_cst add, which every settler makes
	 * after its CASes: a waiter that sees the new value sees those slots
	 * settled */
	return sb_load_acquire(&hdr(r)->done_seq);
}

int sb_wait_done_seq(sb_ring *r, uint32_t seen, int64_t timeout_ns)
{
	return seq_wait(&hdr(r)->done_seq, &hdr(r)->done_waiters, seen, timeout_ns);
}

void sb_request_evict(sb_ring *r)
{
	seq_bump(&hdr(r)->evict_seq, &hdr(r)->evictors);
}

uint32_t sb_evict_seq(const sb_ring *r)
{
	/* acquire: as sb_done_seq's, pairs with seq_bump's seq_cst add: what
	 * the asking client wrote before it is visible to the evictor */
	return sb_load_acquire(&hdr(r)->evict_seq);
}

int sb_wait_evict(sb_ring *r, uint32_t seen, int64_t timeout_ns)
{
	return seq_wait(&hdr(r)->evict_seq, &hdr(r)->evictors, seen, timeout_ns);
}

uint32_t sb_work_seq(const sb_ring *r)
{
	/* acquire: the scan that follows must not read slots from before it */
	return sb_load_acquire(&hdr(r)->work_seq);
}

int sb_wait_work(sb_ring *r, uint32_t seen, int64_t timeout_ns, uint64_t spin_ns)
{
	sb_header *h = hdr(r);
	if (timeout_ns >= 0 && spin_ns > (uint64_t)timeout_ns)
		spin_ns = (uint64_t)timeout_ns;
	if (spin_while32(&h->work_seq, seen, spin_ns) != seen)
		return SB_OK;
	/* seq_cst: pairs with the publisher's work_arrived (Dekker): either it
	 * sees us asleep and wakes us, or the kernel sees work_seq != seen */
	sb_add_seq_cst(&h->batchers_sleeping, 1);
	int code = futex_wait(&h->work_seq, seen, timeout_ns);
	sb_sub_seq_cst(&h->batchers_sleeping, 1);
	return code;
}

void sb_wake_work(sb_ring *r)
{
	sb_header *h = hdr(r);
	/* seq_cst: as every other bump of work_seq (work_arrived); the wake is
	 * made whether or not a batcher is counted asleep */
	sb_add_seq_cst(&h->work_seq, 1);
	futex_wake(&h->work_seq, INT_MAX);
}
