/*
 * futex.c - time, futexes, the bounded spin and the sequence words: the
 * primitives every wait is built from, on any shared u32 word (futex.h).
 * Nothing here knows the segment; wait.c applies them to its words.
 *
 * A wake is a hint: every waiter re-reads the word it waits for. A sleeper
 * count beside a word (garbage in it costs a wasted wake or a missed one,
 * which the callers' bounded slices absorb) lets a waker skip the syscall.
 */
#define _GNU_SOURCE
#include "futex.h"
#include "atomics.h"

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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
int futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns)
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

void futex_wake(uint32_t *addr, int n)
{
	syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* A sequence word with a count of its sleepers (done_seq, free_seq,
 * evict_seq): the waker bumps it and makes the wake syscall only while one
 * sleeps. seq_cst on both sides (Dekker): either the waker sees the sleeper
 * counted, or the sleeper's futex_wait sees the word moved on. */
void seq_bump(uint32_t *seq, uint32_t *sleepers)
{
	sb_add_seq_cst(seq, 1);
	if (sb_load_seq_cst(sleepers))
		futex_wake(seq, INT_MAX);
}

int seq_wait(uint32_t *seq, uint32_t *sleepers, uint32_t seen, int64_t timeout_ns)
{
	sb_add_seq_cst(sleepers, 1);
	int r = futex_wait(seq, seen, timeout_ns);
	sb_sub_seq_cst(sleepers, 1);
	return r;
}

/* Spins until *word != seen or spin_ns pass; returns the word's last value.
 * acquire: the caller reads what the word's writer published. */
uint32_t spin_while32(const uint32_t *word, uint32_t seen, uint64_t spin_ns)
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
