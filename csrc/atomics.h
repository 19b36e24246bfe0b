/*
 * atomics.h - the only place in csrc/ that names a memory order.
 *
 * Every shared word is a plain uint32_t / uint64_t in the segment; these
 * wrappers apply the GCC/Clang __atomic builtins to it (C11 _Atomic types
 * would not survive cffi's cdef). Call sites say why they need the order.
 */
#ifndef SB_ATOMICS_H
#define SB_ATOMICS_H

#include <stdint.h>

#define sb_load_relaxed(p)      __atomic_load_n((p), __ATOMIC_RELAXED)
#define sb_load_acquire(p)      __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define sb_load_seq_cst(p)      __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define sb_store_relaxed(p, v)  __atomic_store_n((p), (v), __ATOMIC_RELAXED)
#define sb_store_release(p, v)  __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define sb_store_seq_cst(p, v)  __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
#define sb_or_seq_cst(p, v)     __atomic_fetch_or((p), (v), __ATOMIC_SEQ_CST)
#define sb_fence_acquire()      __atomic_thread_fence(__ATOMIC_ACQUIRE)
#define sb_fence_seq_cst()      __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define sb_add_relaxed(p, v)    __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)
#define sb_add_seq_cst(p, v)    __atomic_fetch_add((p), (v), __ATOMIC_SEQ_CST)
#define sb_sub_seq_cst(p, v)    __atomic_fetch_sub((p), (v), __ATOMIC_SEQ_CST)
#define sb_or_relaxed(p, v)     __atomic_fetch_or((p), (v), __ATOMIC_RELAXED)
#define sb_and_relaxed(p, v)    __atomic_fetch_and((p), (v), __ATOMIC_RELAXED)

/* A spin-wait hint: lets the sibling hyperthread run and saves power. */
#if defined(__x86_64__) || defined(__i386__)
#define sb_cpu_relax() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define sb_cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define sb_cpu_relax() __asm__ __volatile__("" ::: "memory")
#endif

/* Strong CAS; on failure *expected receives the current value. */
#define sb_cas_acq_rel(p, expected, desired)                                   \
	__atomic_compare_exchange_n((p), (expected), (desired), 0,              \
				    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
#define sb_cas_seq_cst(p, expected, desired)                                   \
	__atomic_compare_exchange_n((p), (expected), (desired), 0,              \
				    __ATOMIC_SEQ_CST, __ATOMIC_ACQUIRE)

#endif
