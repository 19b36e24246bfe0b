/*
 * wait.c - the segment's sequence words every role sleeps on: done_seq
 * (completion threads), evict_seq (evictors) and work_seq (batchers), built
 * on futex.c's primitives; and the wakes of asyncio loops (ring.h, ASYNCIO).
 *
 * A wake is a hint: every waiter re-reads the word it waits for. A sleeper
 * count beside a word (garbage in it costs a wasted wake or a missed one,
 * which the callers' bounded slices absorb) lets a waker skip the syscall.
 */
#include "segment.h"
#include "futex.h"

#include <limits.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* The socket this process sends asyncio wakes from, made at its first wake
 * (the one a racing thread made instead is closed); -1 if none can be. */
static int wake_socket(sb_ring *r)
{
	int32_t have = sb_load_acquire(&r->wake_sock);
	if (have)
		return have - 1;
	int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	int32_t want = fd + 1; /* 0 when it failed: -1 + 1, tried again next time */
	if (!sb_cas_acq_rel(&r->wake_sock, &have, want)) {
		if (fd >= 0)
			close(fd);
		return have - 1;
	}
	return fd;
}

void send_wakes(sb_ring *r, sb_wakes *w)
{
	static const char hex[] = "0123456789abcdef", name[] = "shmbatch-wake-";
	if (!w->n)
		return;
	int fd = wake_socket(r);
	struct sockaddr_un to = {.sun_family = AF_UNIX};
	/* "\0shmbatch-wake-%08x": an abstract name, sun_path[0] = 0 */
	memcpy(to.sun_path + 1, name, sizeof(name) - 1);
	char *digits = to.sun_path + sizeof(name);
	socklen_t len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + sizeof(name) + 8);
	for (uint32_t k = 0; fd >= 0 && k < w->n; k++) {
		for (int d = 0; d < 8; d++)
			digits[d] = hex[(w->id[k] >> (28 - 4 * d)) & 0xF];
		/* a loop gone (ECONNREFUSED) or behind (EAGAIN: its wake is
		 * pending anyway) costs nothing more */
		(void)sendto(fd, "", 1, MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr *)&to, len);
	}
	w->n = 0;
}

void sb_wake_close(sb_ring *r)
{
	/* acq_rel: one closer takes the fd, after any thread that made it */
	int32_t have = __atomic_exchange_n(&r->wake_sock, 0, __ATOMIC_ACQ_REL);
	if (have > 0)
		close(have - 1);
}

int sb_await_slot(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t waker)
{
	if (slot >= r->capacity)
		return SB_EBADARG;
	sb_store_seq_cst(waker_at(r, slot), (uint64_t)gen << 32 | waker);
	/* the re-check's loads after the store (Dekker, with note_wake) */
	sb_fence_seq_cst();
	return sb_wait_slot(r, slot, gen, 0, 0);
}

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

void sb_expect_work(sb_ring *r)
{
	sb_header *h = hdr(r);
	/* no Dekker pair needed, unlike work_arrived: a batcher falling asleep
	 * after the load misses this hint only, never a request (its publish
	 * wakes it); seq_cst as every other access to these two words but
	 * sb_batchers_sleeping's relaxed hint */
	if (sb_load_seq_cst(&h->batchers_sleeping)) {
		sb_add_seq_cst(&h->work_seq, 1);
		futex_wake(&h->work_seq, 1);
	}
}

uint32_t sb_batchers_sleeping(const sb_ring *r)
{
	/* relaxed: a hint for how long a caller's first look at its answer
	 * spins; a batcher that sleeps or wakes just after costs that look */
	return sb_load_relaxed(&hdr(r)->batchers_sleeping);
}

void sb_wake_work(sb_ring *r)
{
	sb_header *h = hdr(r);
	/* seq_cst: as every other bump of work_seq (work_arrived); the wake is
	 * made whether or not a batcher is counted asleep */
	sb_add_seq_cst(&h->work_seq, 1);
	futex_wake(&h->work_seq, INT_MAX);
}
