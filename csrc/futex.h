/*
 * futex.h - private to csrc/: the primitives every wait is built from, on
 * any shared u32 word: the clock, the futex calls, the bounded spin, and a
 * sequence word with a count of its sleepers (futex.c).
 *
 * They know nothing of the segment: which words are sequences, where they
 * sit, and who bumps them is segment.h's and wait.c's. This header includes
 * ring.h alone, for the result codes (SB_OK, SB_ETIMEOUT) and the exported
 * sb_now_ns, sb_spin_ns and sb_pingpong (the cdef's "time" group), which
 * futex.c defines.
 */
#ifndef SB_FUTEX_H
#define SB_FUTEX_H

#include "ring.h"

#include <stdint.h>

/* Sleeps while *addr == expected, at most timeout_ns (< 0: no limit).
 * Returns SB_ETIMEOUT only on expiry; EAGAIN/EINTR/wake all mean "re-check". */
int futex_wait(uint32_t *addr, uint32_t expected, int64_t timeout_ns);
void futex_wake(uint32_t *addr, int n);
/* a sequence word with a count of its sleepers (done_seq, free_seq,
 * evict_seq) */
void seq_bump(uint32_t *seq, uint32_t *sleepers);
int seq_wait(uint32_t *seq, uint32_t *sleepers, uint32_t seen, int64_t timeout_ns);
/* spins until *word != seen or spin_ns pass; returns the word's last value */
uint32_t spin_while32(const uint32_t *word, uint32_t seen, uint64_t spin_ns);

#endif
