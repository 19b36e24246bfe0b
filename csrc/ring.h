/*
 * ring.h - the shared-memory slot ring of shmbatch: layout, slot states, API.
 *
 * One POSIX shared-memory object "/shmbatch-NAME" (mode 0600) holds everything.
 * Every process maps it at its own address, so the segment holds offsets and
 * indices only, never pointers. Every process of the user can write into it,
 * so each keeps its own copy of the geometry (sb_ring: capacity, levels,
 * tensors, offsets, row sizes), filled and checked once at init or attach;
 * every function takes that copy and never reads the segment's again.
 *
 * SEGMENT LAYOUT (byte offsets from base; C = capacity, the number of slots)
 *
 *   0      +-----------------------------------------------------------+
 *          | sb_header                                 20480 B, 64-al. |
 *          |    0 magic "SHMBATCH" (u64, stored last with release)     |
 *          |    8 layout_version u32     12 header_bytes u32           |
 *          |   16 incarnation u64 (random per creation)                |
 *          |   24 capacity u32           28 max_batch u32              |
 *          |   32 tensors u32 (T, inputs first)  36 inputs u32 (I)     |
 *          |   40 slot_bytes u64: one slot's rows of all T, summed     |
 *          |   48 total_bytes u64  56 in_place u32  60 levels u32      |
 *          |   64 off_ctl  72 off_meta  80 off_errmsg  88 off_lengths  |
 *          |   96 off_stream  104 off_ready   (u64 each)               |
 *          |  112 steps u32 (0: one-shot)  120 off_waker u64           |
 *          |  128 config: 2048 B of UTF-8 JSON (the engine's settings) |
 *          | 2176 work_seq u32 (futex)  2180 batchers_sleeping u32     |
 *          | 2240 done_seq u32 (futex)  2244 done_waiters u32          |
 *          | 2304 alloc_hint u32: where acquire starts looking         |
 *          | 2368 words[128] u64: engine state, pids, counters (SB_W_*)|
 *          | 3392 hist[3][128] u64: queue wait, service, batch size    |
 *          | 6464 free_seq u32 (futex)  6468 free_waiters u32          |
 *          | 6528 evict_seq u32 (futex) 6532 evictors u32              |
 *          | 6592 level_wait_sum[8] u64  6656 level_wait_max[8] u64    |
 *          | 6720 off_tensor[16] u64   6848 tensor_slot_bytes[16] u64  |
 *          | 6976 corrupt_total u64: values that failed checks, summed |
 *          | 7040 words2[64] u64: more engine words (SB_W_* from 128)  |
 *          | 8192 level_hist[8][128] u64: queue wait per priority      |
 *          |16384 steps_total u64  16392 chunks_total u64              |
 *          |16400 stream_sum[2], stream_max[2], e2e_sum, e2e_max (ns)|
 *          |16448 active[32] u64: each batcher's running batch size    |
 *          |16896 stream_hist[2][128] u64: SB_H_TTFT, SB_H_CHUNK       |
 *          |18944 e2e_hist[128]; 19968 batch_ns[63], last_done_ns u64  |
 *  20480   +-----------------------------------------------------------+
 *          | ctl[C]      u64 per slot: each slot's one control word    |
 *          +------------------------------------------- 64-aligned ----+
 *          | ready[L][ceil(C/64)] u64, L = priority levels: bit s%64   |
 *          |             of word s/64 of level p set while slot s may  |
 *          |             be READY at priority p (the batcher's scan)   |
 *          +------------------------------------------- 64-aligned ----+
 *          | meta[C]     sb_slot_meta, 64 B per slot                   |
 *          +------------------------------------------- 64-aligned ----+
 *          | errmsg[C]   SB_ERRMSG_BYTES per slot                      |
 *          +------------------------------------------- 64-aligned ----+
 *          | lengths[C][I] u32: each input tensor's real length along  |
 *          |             its variable dim (0: fixed), set while WRITING|
 *          +------------------------------------------- 64-aligned ----+
 *          | stream[C]   sb_slot_stream, 64 B per slot (steps > 0):    |
 *          |             chunks written (the client's futex word: bits |
 *          |             0-28 the count, 29-31 how it ended), sleepers,|
 *          |             its max_steps, its batch at its first chunk   |
 *          +------------------------------------------- 64-aligned ----+
 *          | waker[C]    u64: gen << 32 | the wake id of an asyncio    |
 *          |             loop awaiting the slot (its owner's; 0: none) |
 *          +------------------------------------------- 4096-aligned --+
 *          | tensor 0    tensor_slot_bytes[0] per slot: ONE C-order    |
 *          |             array [C, *max_shape] of its dtype            |
 *          +------------------------------------------- 4096-aligned --+
 *          | tensor 1 .. tensor I-1: the other inputs, each the same   |
 *          +------------------------------------------- 4096-aligned --+
 *          | tensor I .. tensor T-1: the outputs, [C, *output_shape]   |
 *          |             (iterative: [C, steps, *chunk_shape])         |
 *          |             (none when in_place: one input, one output of |
 *          |             its spec; an answer overwrites its input row) |
 *          +-----------------------------------------------------------+
 *   A single-array engine has T = 2, I = 1 (one unnamed tensor each way);
 *   the fused calls (sb_submit, sb_take) copy tensor 0 in and tensor I out.
 *
 * THE CONTROL WORD (ctl[slot], u64; each transition is ONE CAS on it)
 *
 *   63            32 31          10 9       5 4       3     0
 *   +---------------+--------------+---------+---------+-------+
 *   |  generation   |  owner pid   | batcher | waiting | state |
 *   +---------------+--------------+---------+---------+-------+
 *   The low 32 bits are the futex word a blocked client sleeps on (little-
 *   endian: they sit at the word's own address). "waiting" says a client
 *   sleeps there, so the batcher makes the wake syscall only when needed.
 *
 * SLOT STATE MACHINE (g = generation; a ticket is (slot, g))
 *
 *           acquire (client CAS)            publish (client CAS)
 *   FREE(g) --------------------> WRITING(g) -------------------> READY(g)
 *     ^                             |  cancel (client) / reap       |
 *     |<---------- FREE(g+1) -------+                               | claim
 *     |                                                             v (batcher CAS)
 *     |<-- release (client) --- DONE(g) <----- complete ------ CLAIMED(g, b)
 *     |<-- release (client) --- FAILED(g) <--- fail / reap b --+    |
 *     |                                                             | abandon (client
 *     |<-- batcher completes it: FREE(g+1) ---- ABANDONED(g, b) <---+ timeout) / reap
 *     |<-- abandon (client) or reap: READY(g) / DONE(g) / FAILED(g) -> FREE(g+1)
 *
 *   A dead batcher b's CLAIMED(g, b) slots may instead stay CLAIMED(g, b) for
 *   b's successor (same number), which retries each alone (meta.retry).
 *
 *   STREAMS (iterative): a slot stays CLAIMED(g, b) while its batcher writes
 *   a chunk a step and publishes the count in the slot's chunk word; the
 *   client reads chunks [seen, count) meanwhile. The step that completes a
 *   request publishes its last count with SB_CHUNKS_END and why (_STOP: its
 *   model said done; _LIMIT: its max_steps), so the client knows the last
 *   chunk as it reads it. Settling it (DONE, FAILED, FREE once withdrawn)
 *   sets END before its CAS, wakes after. A dead batcher's slots that had a
 *   chunk fail; those that had none are kept for its successor.
 *
 *   Every transition that leaves a slot FREE bumps the generation, so a late
 *   actor holding an old ticket fails its CAS and changes nothing. Each state
 *   names who may move it on: WRITING/READY/DONE/FAILED the owner (or the
 *   reaper once the owner is proven dead), CLAIMED/ABANDONED the batcher
 *   (or the reaper once that batcher is proven dead).
 *
 * WHY LOCK-FREE AND NOT A ROBUST MUTEX
 *   A queue of positions (Disruptor, Vyukov, ck_ring's MP enqueue) blocks
 *   every consumer behind a producer killed between taking a position and
 *   publishing it. A robust mutex recovers, but its EOWNERDEAD path must
 *   repair a half-updated multi-word structure. Here a request's whole
 *   shared state is its control word: a process killed at any instruction
 *   leaves every slot in one known state naming its actor, and one CAS by
 *   the reaper moves it on. The batcher finds READY slots in the ready[]
 *   bitmap, not a list: a dead writer is never READY. A request takes the
 *   slot after the last one taken, unless a lower one was freed since:
 *   batches are mostly one contiguous run of rows (no copy), and the slots
 *   in use stay the lowest (their rows stay in the CPU caches).
 *
 * THE READY BITMAP: a hint, never the truth (ctl is)
 *   A claim costs O(C/64 + ready), not O(C): the batcher reads the words,
 *   and the ctl of each slot whose bit is set. Invariant: every READY slot's
 *   bit is set (a set bit on a slot not READY is only a wasted look). Each
 *   bit change sits where no other party can move the slot:
 *   - publish sets it BEFORE its CAS WRITING -> READY (the owner's alone);
 *   - claim clears it AFTER its CAS READY -> CLAIMED (only that batcher
 *     moves a CLAIMED slot on, after the clear: no new READY is cleared);
 *   - abandon and reap clear it BEFORE their CAS READY -> FREE (the slot
 *     cannot be published again until that CAS).
 *   A process killed between two of these steps leaves a set bit on a
 *   WRITING or FREE slot (looked at, skipped) or a READY slot with its bit
 *   (claimed as usual): never a READY slot without its bit. Clients killed
 *   between the bit and the CAS leave a WRITING slot that the reaper frees.
 *
 * BLOCKING: futexes on shared words, never polling. Clients sleep on their
 * slot's ctl (low half); batchers on work_seq, which every publish bumps (and
 * expect_work, ahead of one); completion threads on done_seq, which every
 * finished batch bumps; a client that found the ring full on free_seq, which
 * a freed slot bumps while someone waits (free_waiters); each client
 * process's evictor on evict_seq, bumped to ask every process to move its
 * unread answers out. A wake is a hint: every waiter re-reads its word. A
 * waiter may first spin a bounded spin_ns, re-reading it: a spinner is not
 * marked asleep, so its waker skips the syscall and it the kernel's wake-up
 * (half a short round trip). spin_ns is the caller's (0: none), never the C's.
 * ASYNCIO: a loop binds a datagram socket at the abstract address
 * "\0shmbatch-wake-%08x" of its wake id and puts gen << 32 | id in each slot
 * it awaits (sb_await_slot); who settles a slot or puts a stream's chunks
 * sends one byte to each id of a matching generation, once a call,
 * MSG_DONTWAIT, errors ignored: a dead or full loop costs it nothing.
 *
 * WHAT COMES FROM THE SEGMENT IS DATA
 *   Every per-slot field and header word may hold anything. A field that
 *   becomes an index, a length, a shift or a divisor is loaded once (relaxed
 *   atomic: no re-fetch after the check) and checked against the process's
 *   own sb_ring; one that fails is counted (corrupt_total, and its own) and
 *   nothing is derived from it: a slot with a priority out of range is
 *   failed (SB_STATUS_CORRUPT), a stray bitmap bit cleared, a count beyond a
 *   caller's buffer cut to it. Caller buffers carry their capacity.
 *
 * FILES, from the bottom up (each includes only files listed before it):
 *   ring.h      this contract: the layout, the constants, the exported API
 *   atomics.h   the atomic wrappers, one per memory order
 *   futex.h/.c  the clock, futex calls, bounded spin, sequence words: on
 *               any u32 word, nothing of the segment (ring.h, atomics.h)
 *   segment.h   the structs drawn above, slot addressing, shared steps
 *               (ring.h, atomics.h, futex.h)
 *   setup.c client.c wait.c admission.c claim.c complete.c stats.c stream.c
 *   reap.c: a role each, as the API groups them (segment.h; wait.c futex.h)
 *
 * C holds no policy: when to flush, whether a process is dead, what an error
 * means, whether a dead batcher's batch is retried are Python's (engine/).
 * It measures (histograms, the fit) and applies the thresholds it is given.
 */
#ifndef SB_RING_H
#define SB_RING_H
#include <stdint.h>
/* --- cdef: everything from here to "cdef end" is read by cffi --------- */
#define SB_LAYOUT_VERSION 14 /* 13: e2e, served_ns; 14: waker[] */
#define SB_HEADER_BYTES 20480
#define SB_CONFIG_BYTES 2048
#define SB_OFF_CONFIG 128
#define SB_OFF_WORDS 2368
#define SB_ERRMSG_BYTES 256
#define SB_MAX_CAPACITY 65536
#define SB_MAX_INSTANCES 32
#define SB_MAX_PRIORITIES 8
#define SB_MAX_TENSORS 16
#define SB_MAX_BUCKETS 16
#define SB_MAX_TAKE 1024
#define SB_HIST_BUCKETS 128
#define SB_MAX_STEPS 65536      /* an iterative engine's chunks per slot */
#define SB_CHUNKS_END 0x80000000u   /* a slot's chunk count is final */
#define SB_CHUNKS_STOP 0x40000000u  /* ... its model said done at that count */
#define SB_CHUNKS_LIMIT 0x20000000u /* ... it reached its max_steps */
#define SB_CHUNKS_COUNT 0x1FFFFFFFu /* the count's bits */

/* the control word's fields (drawn above) that Python reads too */
#define SB_STATE_MASK 0xF
#define SB_PID_SHIFT 10
#define SB_PID_MASK 0x3FFFFF
#define SB_BATCHER_SHIFT 5
#define SB_BATCHER_MASK 0x1F
/* slot states (ctl bits 0-3) */
#define SB_FREE 0
#define SB_WRITING 1
#define SB_READY 2
#define SB_CLAIMED 3
#define SB_DONE 4
#define SB_FAILED 5
#define SB_ABANDONED 6

/* results */
#define SB_OK 0
#define SB_EFULL 1
#define SB_ESTALE 2
#define SB_ETIMEOUT 3
#define SB_EBADARG 4
#define SB_ECORRUPT 5   /* the segment holds a value no engine process writes */
#define SB_EVERSION 6
#define SB_EBUSY 7
#define SB_EFAILED 8
#define SB_EOVERLOADED 9

/* words[]: identities and counters, all u64 */
#define SB_W_ENGINE_STATE 0
#define SB_W_SUPERVISOR_PID 1
#define SB_W_SUPERVISOR_START 2
#define SB_W_INSTANCES 3
#define SB_W_EPOCH 4          /* batchers started before the current epoch retire */
#define SB_W_TOKENS 5         /* variable dim: real lengths served, summed */
#define SB_W_PADDED_TOKENS 6  /* ... and the padded lengths the backend saw */
#define SB_W_RETRIED 7        /* requests retried alone after their batcher died */
#define SB_W_REQUESTS 8
#define SB_W_REJECTED 9
#define SB_W_TIMEOUTS 10
#define SB_W_ERRORS 11
#define SB_W_ANSWERED 12
#define SB_W_BATCHES 13
#define SB_W_ITEMS 14
#define SB_W_ZERO_COPY 15
#define SB_W_GATHERED 16
#define SB_W_RECLAIMED 17
#define SB_W_STALE 18
#define SB_W_RESTARTS 19
#define SB_W_QUEUE_WAIT_MAX_NS 20
#define SB_W_SERVICE_MAX_NS 21
#define SB_W_INVALID 22
#define SB_W_QUEUE_WAIT_SUM_NS 23
#define SB_W_SERVICE_SUM_NS 24
#define SB_W_EXPIRED 25       /* failed unstarted: deadline passed (or certain to) */
#define SB_W_OVERLOADED 26    /* refused at enqueue by the admission estimate */
#define SB_W_ISOLATED 27      /* failed alone after their batch was split */
#define SB_W_BATCH_LIMIT 28   /* the batchers' current batch limit (AIMD) */
#define SB_W_FIT_FIXED_NS 29  /* measured service time S(n) ~ fixed + n * per_item */
#define SB_W_FIT_ITEM_PS 30   /* per_item, in picoseconds */
#define SB_W_RETRY_CALLS 31   /* extra backend calls made to isolate failures */
#define SB_W_BATCH_START 32   /* + instance: claim_ns of the batch it serves, 0 idle */
#define SB_W_BATCHER_PID 64
#define SB_W_BATCHER_START 96
#define SB_WORDS 128          /* the first block (words[]); words2[] holds the rest */
#define SB_W_WITHDRAWN 128    /* requests their client withdrew (not a timeout) */
/* admission by deadline, judged by the waits its admitted requests saw: */
#define SB_W_ADMIT_COMPARED 129     /* requests admitted on a counted prediction */
#define SB_W_ADMIT_PREDICTED_NS 130 /* ... their predicted waits, summed */
#define SB_W_ADMIT_SEEN_NS 131      /* ... the waits they saw, summed */
#define SB_W_ADMIT_LATE 132         /* ... those that waited longer than predicted */
#define SB_W_ADMIT_SCALE 133        /* the correction of predictions, 1/1024ths (0: 1024) */
#define SB_W_ADMIT_RECENT_PREDICTED_NS 134 /* ... predicted and seen, recent (forgetting) */
#define SB_W_ADMIT_RECENT_SEEN_NS 135
#define SB_W_UNSERVED_UNTIL_NS 136 /* 0 while a batcher serves, else when one is expected to */
#define SB_W_SERVED_NS 137    /* each request's time in backend calls, summed */
#define SB_W_NETNS 138        /* the engine's network namespace (its inode): wakes reach it */
#define SB_W_ROOM_STEPS 160   /* + instance: 0 not serving, else 1 + steps until its
			       * running batch has room (an iterative engine) */
#define SB_WORDS_ALL 192
#define SB_ENGINE_STARTING 0
#define SB_ENGINE_RUNNING 1
#define SB_ENGINE_STOPPING 2
#define SB_ENGINE_STOPPED 3

#define SB_H_QUEUE_WAIT 0 /* the histograms */
#define SB_H_SERVICE 1
#define SB_H_BATCH_SIZE 2
#define SB_H_TTFT 3       /* an iterative request's arrival to its first chunk */
#define SB_H_CHUNK 4      /* ... and between its chunks */
#define SB_H_E2E 5        /* a request's arrival to its end (answer, or last chunk) */

/* error status of a FAILED slot */
#define SB_STATUS_OK 0
#define SB_STATUS_BACKEND 1
#define SB_STATUS_BATCHER_DIED 2
#define SB_STATUS_EXPIRED 3
#define SB_STATUS_CORRUPT 4   /* its fields in the segment failed a check */

/* One process's view of one segment: the geometry, copied out of the header
 * once and checked (sb_init, sb_attach), and from then on the only source of
 * every bound and offset. It lives in the process's own memory. */
typedef struct {
	char *base;               /* this process's mapping */
	uint64_t mapped_bytes;
	uint64_t total_bytes, slot_bytes, incarnation;
	uint32_t capacity, max_batch, tensors, inputs, in_place, levels;
	uint32_t steps;           /* an iterative engine's chunks per slot; 0: one-shot */
	uint32_t ready_words;     /* u64 words of one level's bitmap */
	uint64_t off_ctl, off_ready, off_meta, off_errmsg, off_lengths, off_stream, off_waker;
	uint64_t off_tensor[SB_MAX_TENSORS];
	uint64_t tensor_slot_bytes[SB_MAX_TENSORS];
	uint64_t corrupt;         /* values this process found failing a check */
	int32_t wake_sock;        /* the socket its wakes are sent from, + 1 (0: none yet) */
} sb_ring;

/* setup (setup.c). tensors regions, the first `inputs` of them inputs,
 * slot_bytes[t] bytes per slot each; in_place: one input, one output of
 * equal size. sb_init fills the creator's r; sb_attach another process's,
 * from single reads of the header, checked on the copy (SB_ECORRUPT,
 * SB_EVERSION: r untouched). sb_attach_header checks the magic and version
 * and fills base alone (capacity 0): a dead engine's figures and lock. */
uint64_t sb_layout_bytes(uint32_t capacity, uint32_t tensors, uint32_t inputs,
			 const uint64_t *slot_bytes, uint32_t in_place, uint32_t levels,
			 uint32_t steps);
int sb_init(sb_ring *r, void *base, uint64_t total_bytes, uint32_t capacity,
	    uint32_t max_batch, uint32_t tensors, uint32_t inputs,
	    const uint64_t *slot_bytes, uint32_t in_place, uint32_t levels,
	    uint32_t steps, uint64_t incarnation);
int sb_attach(sb_ring *r, void *base, uint64_t mapped_bytes);
int sb_attach_header(sb_ring *r, void *base, uint64_t mapped_bytes);
uint64_t sb_word_get(const sb_ring *r, int word);
void sb_word_set(sb_ring *r, int word, uint64_t value);
void sb_word_add(sb_ring *r, int word, uint64_t delta);
uint64_t sb_corrupt_total(const sb_ring *r);
/* the creator's geometry and magic over the header's: fields changed (counted) */
int sb_restore_header(sb_ring *r);

/* client (client.c); EFULL is not counted: the caller, having tried to make
 * room, decides whether it is a rejection. */
int sb_acquire(sb_ring *r, uint32_t pid, uint64_t start_ticks,
	       uint32_t *slot, uint32_t *gen);
/* a request's attributes, set at publish: its real length (0: fixed shape),
 * its deadline (CLOCK_MONOTONIC ns, 0: none) and its priority level */
int sb_publish(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t length,
	       uint64_t deadline_ns, uint32_t priority);
int sb_cancel(sb_ring *r, uint32_t slot, uint32_t gen);
/* SB_OK answered, SB_EFAILED failed (see sb_slot_error), SB_ETIMEOUT, SB_ESTALE
 * no longer the ticket's slot, SB_ECORRUPT its control word holds no state */
int sb_wait_slot(sb_ring *r, uint32_t slot, uint32_t gen, int64_t timeout_ns,
		 uint64_t spin_ns);
int sb_release(sb_ring *r, uint32_t slot, uint32_t gen);
int sb_abandon(sb_ring *r, uint32_t slot, uint32_t gen);
/* fused, one call each way for a contiguous input: acquire + copy src into
 * tensor 0's row + publish (ticket = [slot, gen]); and wait + copy tensor I's
 * row to dst + release (SB_OK only; a FAILED slot is the caller's); times,
 * if not NULL, gets its SB_T_* stamps (0: none), as sb_slot_times does
 * before a release (a stream not yet settled: from its 1st chunk) */
#define SB_T_ARRIVAL 0 /* ns, as the next two */
#define SB_T_CLAIM 1
#define SB_T_DONE 2
#define SB_T_BATCH 3   /* its batch's requests (a stream's: at its first chunk) */
/* with admit and a deadline: SB_EOVERLOADED (nothing taken; the predicted wait,
 * ms, in ticket[0]; counted in SB_W_OVERLOADED) if that wait would end after
 * the deadline: the caller's admission by deadline, before a slot is taken */
int sb_submit(sb_ring *r, uint32_t pid, uint64_t start_ticks, const void *src,
	      uint64_t nbytes, uint32_t length, uint64_t deadline_ns,
	      uint32_t priority, uint32_t admit, uint32_t *ticket);
int sb_take(sb_ring *r, uint32_t slot, uint32_t gen, int64_t timeout_ns,
	    uint64_t spin_ns, void *dst, uint64_t nbytes, uint64_t *times);
int sb_slot_times(sb_ring *r, uint32_t slot, uint32_t gen, uint64_t *times);
/* bulk: n requests in one call each (same real length), for Client.infer_many */
uint32_t sb_acquire_many(sb_ring *r, uint32_t pid, uint64_t start_ticks,
			 uint32_t n, uint32_t *slots, uint32_t *gens);
uint32_t sb_publish_many(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
			 uint32_t n, uint32_t length, uint64_t deadline_ns,
			 uint32_t priority);
int sb_wait_all(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
		uint32_t n, int64_t timeout_ns, uint64_t spin_ns);
uint32_t sb_release_many(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
			 uint32_t n);
int sb_poll(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
	    uint32_t n, int32_t *states);
uint32_t sb_slot_error(sb_ring *r, uint32_t slot, char *msg,
		       uint32_t msg_cap, uint32_t *msg_len);
/* making room in a full ring: acquire, asleep until a slot is freed (SB_EFULL
 * after timeout_ns); ask every evictor to move its answers out; its wait */
int sb_acquire_wait(sb_ring *r, uint32_t pid, uint64_t start_ticks,
		    int64_t timeout_ns, uint32_t *slot, uint32_t *gen);

/* waits and wakes (wait.c) */
uint32_t sb_done_seq(const sb_ring *r);
/* requests settled outside a finished batch: their async waiters are woken */
void sb_wake_done(sb_ring *r);
int sb_wait_done_seq(sb_ring *r, uint32_t seen, int64_t timeout_ns);
/* an asyncio loop awaits the ticket: waker (its wake id; 0: none) in the slot's
 * waker word, seq_cst as the settler's CAS and load of it (one sees the other);
 * sb_wait_slot's code, never waiting. sb_wake_close: this process's socket. */
int sb_await_slot(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t waker);
void sb_wake_close(sb_ring *r);
void sb_request_evict(sb_ring *r);
uint32_t sb_evict_seq(const sb_ring *r);
int sb_wait_evict(sb_ring *r, uint32_t seen, int64_t timeout_ns);
uint32_t sb_work_seq(const sb_ring *r);
int sb_wait_work(sb_ring *r, uint32_t seen, int64_t timeout_ns, uint64_t spin_ns);
void sb_wake_work(sb_ring *r);
void sb_expect_work(sb_ring *r); /* a request comes: wake one asleep */
uint32_t sb_batchers_sleeping(const sb_ring *r); /* asleep now: a hint */
/* time (futex.c, under wait.c's waits); and the floor a cross-process
 * request cannot beat: a futex ping-pong on word[0] of a shared mapping (role
 * 0 pings, 1 answers), each side spinning spin_ns before it sleeps, as waits do */
uint64_t sb_now_ns(void);
void sb_spin_ns(uint64_t ns);
uint32_t sb_pingpong(void *word, uint32_t role, uint32_t rounds, uint64_t spin_ns,
		     uint64_t *round_trip_ns);

/* admission (admission.c): how many requests are READY at priority
 * max_priority or more urgent (a popcount of their bitmaps: a hint) */
uint32_t sb_queued(const sb_ring *r, uint32_t max_priority);
/* the figures admission reads, in one call: out[SB_A_*] */
#define SB_A_QUEUED 0      /* sb_queued(max_priority), if count */
#define SB_A_FIXED_NS 1    /* SB_W_FIT_FIXED_NS */
#define SB_A_ITEM_PS 2     /* SB_W_FIT_ITEM_PS */
#define SB_A_LIMIT 3       /* SB_W_BATCH_LIMIT, within [1, max_batch] */
#define SB_A_BUSY_SINCE 4  /* 0 if a batcher is idle, else the latest batch start */
void sb_admission_figures(const sb_ring *r, uint32_t max_priority, uint32_t count,
			  uint64_t *out);
/* engine/admission.py's predicted_wait_ns on those figures, in integers
 * that saturate: how long a request of this priority, enqueued at now_ns,
 * would wait for its answer (an iterative engine's: its first chunk, its
 * batches being steps that also hold the running requests; 0 before any
 * batch is measured) */
uint64_t sb_predicted_wait_ns(sb_ring *r, uint32_t priority, uint64_t now_ns);
/* admission by deadline: 1 when a request that would wait wait_ns for its
 * answer, with left_ns to its deadline, is refused (the one rule); and the
 * rule applied to a request of this priority now: SB_OK, or SB_EOVERLOADED
 * (counted in SB_W_OVERLOADED) with the predicted wait in *wait_ms */
int sb_refuses(uint64_t wait_ns, uint64_t left_ns);
int sb_admit(sb_ring *r, uint32_t priority, uint64_t deadline_ns, uint32_t *wait_ms);
/* An admitted prediction that counted the queue is left, uncorrected, for
 * the thread's next publish (meta.predicted_us); the batcher that answers
 * it (iterative: first steps it) compares it with the wait seen (SB_W_ADMIT_*)
 * and sets SB_W_ADMIT_SCALE, every prediction's factor, to seen / predicted
 * recently (a batch forgets 1/SB_SCALE_MEMORY), in [1/_MIN_INV, _MAX]. */
#define SB_SCALE_ONE 1024
#define SB_SCALE_MEMORY 64
#define SB_SCALE_MIN_INV 16
#define SB_SCALE_MAX 4
/* a batcher's running fit of its service time, S(n) ~ fixed + n * per_item,
 * least squares with exponential forgetting (each older batch weighs
 * 1 - 1/SB_FIT_MEMORY times less): admission's figures, in the batcher's own
 * memory. A batch slower than SB_FIT_OUTLIER times the prediction counts as
 * that much (a stall or a recompile cannot lock admission out for the many
 * batches the fit takes to forget it); solved after each of the first
 * SB_FIT_REFIT batches, then every SB_FIT_REFIT; the first `warmup` skipped.
 * Published once SB_FIT_CALIBRATED batches are in it: until then the
 * header's figures are a predecessor's, or none (nothing is refused). */
#define SB_FIT_MEMORY 50
#define SB_FIT_OUTLIER 4
#define SB_FIT_REFIT 8
#define SB_FIT_CALIBRATED 8
typedef struct {
	double w, n, nn, s, ns;   /* the weighted sums */
	double fixed_ns, per_item_ns; /* as last solved; 0 before any batch */
	uint64_t batches;         /* batches added */
	uint32_t warmup;          /* batches still to skip */
} sb_fit;
/* adds a batch; 1 when the fit was solved anew */
int sb_fit_add(sb_fit *fit, uint32_t n, uint64_t service_ns);

/* batcher: the claim (claim.c) */
/* The shapes a batch may take, as the caller's policy hands them to the
 * claim: length buckets (a request of length L is in the first bucket b
 * with L <= bound[b]; a batch holds one bucket, at most most[b] requests)
 * and a take table (of r eligible requests, r <= max_n <= takes - 1, claim
 * the take[r] most urgent, oldest first: the allowed batch sizes' rule). */
typedef struct {
	uint32_t buckets;               /* 0: no buckets (one, unbounded) */
	uint32_t bound[SB_MAX_BUCKETS];
	uint32_t most[SB_MAX_BUCKETS];
	uint32_t takes;                 /* 0: no table (take all r) */
	uint32_t take[SB_MAX_TAKE + 1];
} sb_shape;
/* One call for the flush rule's thresholds (the fast path): first fails,
 * unstarted, every READY request whose deadline is before expire_ns
 * (SB_STATUS_EXPIRED) or whose priority is out of range (SB_STATUS_CORRUPT);
 * then, if at least flush_n are READY or the oldest of any level arrived at
 * or before cutoff_ns, claims up to max_n, most urgent level first, oldest
 * first within it, else none. scratch holds scratch_n entries (4 u64 each;
 * capacity of them sees every READY slot): the claim chooses among the
 * first scratch_n it finds. With a shape (NULL: none), test and count are
 * per bucket: of those holding min(flush_n, most[b]) or one due request, the
 * one holding the most urgent, oldest is claimed, at most min(max_n,
 * most[b]), as the take table says. slots/gens/lengths hold max_n. Returns
 * how many it claimed; report[SB_R_*] says when and what it saw. */
#define SB_R_CLAIM_NS 0
#define SB_R_READY 1
#define SB_R_OLDEST_NS 2
#define SB_R_EXPIRED 3
#define SB_R_BUCKET 4
uint32_t sb_claim(sb_ring *r, uint32_t batcher, uint32_t max_n, uint32_t flush_n,
		  uint64_t cutoff_ns, uint64_t expire_ns, const sb_shape *shape,
		  uint64_t *scratch, uint32_t scratch_n, uint32_t *slots, uint32_t *gens,
		  uint32_t *lengths, uint64_t *report);
/* each claimed slot's level (r->levels if out of range) and arrival */
void sb_claimed_ranks(sb_ring *r, const uint32_t *slots, uint32_t n, uint32_t *levels,
		      uint64_t *arrivals);

/* batcher: answers (complete.c) */
uint32_t sb_complete(sb_ring *r, uint32_t batcher, const uint32_t *slots,
		     const uint32_t *gens, uint32_t n, uint32_t status,
		     const char *msg, uint32_t msg_len);
/* a dead batcher's successor, on start, under its number: takes over what
 * the dead one left: frees the slots withdrawn meanwhile (ABANDONED), fails
 * unstarted (SB_STATUS_EXPIRED) the CLAIMED ones whose deadline is before
 * expire_ns, and lists the other CLAIMED ones, up to max, with their real
 * lengths; returns how many there are */
uint32_t sb_inherit(sb_ring *r, uint32_t batcher, uint64_t expire_ns, uint32_t max,
		    uint32_t *slots, uint32_t *gens, uint32_t *lengths);
/* an inherited slot is now retried alone (SB_RETRY_ALONE), counted in
 * SB_W_RETRIED; SB_ESTALE if it is no longer CLAIMED(gen) by this batcher */
int sb_retry_alone(sb_ring *r, uint32_t batcher, uint32_t slot, uint32_t gen);

/* figures (stats.c) */
/* the batch's figures; with fit (else NULL), also sb_fit_add, and on a new
 * solve the fit is published in SB_W_FIT_*: returns 1 then */
int sb_finish_batch(sb_ring *r, const uint32_t *slots, uint32_t n, uint64_t claim_ns,
		    uint64_t done_ns, uint32_t zero_copy, sb_fit *fit);
void sb_histogram(const sb_ring *r, int which, uint64_t *buckets);
/* the queue wait of one priority level: histogram, sum and max (ns) */
void sb_level_wait(const sb_ring *r, uint32_t level, uint64_t *buckets,
		   uint64_t *sum_ns, uint64_t *max_ns);
/* the lowest value (ns) that lands in a time histogram's bucket */
uint64_t sb_bucket_lower_ns(uint32_t bucket);
/* streamed answers (stream.c), steps > 0: each output's row of a slot holds
 * `steps` chunks; the slot's chunk word counts those written. The client,
 * while WRITING: the request's own bound (0: the engine's); then follows the
 * word: sb_wait_chunks returns SB_OK once it is not `seen` (in *chunks: the
 * count, | SB_CHUNKS_END when final, | _STOP or _LIMIT when its request
 * completed) or the slot is settled, SB_ETIMEOUT, SB_ESTALE (not the ticket's
 * slot), SB_ECORRUPT (a count beyond steps). A spinning reader costs its
 * batcher no wake. sb_poll_chunks: moved[k] = 1 on each of n streams where it
 * would not time out. */
int sb_stream_open(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t max_steps);
int sb_wait_chunks(sb_ring *r, uint32_t slot, uint32_t gen, uint32_t seen,
		   int64_t timeout_ns, uint64_t spin_ns, uint32_t *chunks);
uint32_t sb_poll_chunks(sb_ring *r, const uint32_t *slots, const uint32_t *gens,
			const uint32_t *seen, uint32_t n, uint8_t *moved);
/* the batcher, at join: each slot's own bound, within [1, steps], and its
 * deadline (CLOCK_MONOTONIC ns, 0: none) */
void sb_stream_limits(sb_ring *r, const uint32_t *slots, uint32_t n, uint32_t *max_steps,
		      uint64_t *deadlines);
/* the batcher, after a step of its n running slots wrote chunk counts[k] - 1
 * of slots[k]: publishes the counts (a wake only for a client asleep), their
 * time figures and n as each first chunk's batch, each with ends[k]: 0, or
 * SB_CHUNKS_END | SB_CHUNKS_STOP or | SB_CHUNKS_LIMIT for one this step ended
 * (other bits are dropped); states[k] receives the slot's state (SB_CLAIMED;
 * SB_ABANDONED: withdrawn; -1: not this batcher's). Returns how many it put. */
uint32_t sb_stream_put(sb_ring *r, uint32_t batcher, const uint32_t *slots,
		       const uint32_t *gens, uint32_t n, const uint32_t *counts,
		       const uint32_t *ends, int32_t *states);
/* a step's figures: the queue wait of the k requests it joined (claimed at
 * start_ns), its service time and its `active` requests (the batch size),
 * and with fit (else NULL) the fit of step time by active requests: 1 when
 * solved anew and published (as sb_finish_batch) */
int sb_finish_step(sb_ring *r, const uint32_t *joined, uint32_t k, uint32_t active,
		   uint64_t start_ns, uint64_t done_ns, sb_fit *fit);
/* batcher `batcher`'s running batch size, for the figures, and how many
 * steps until it has room for one more (0: room now; else the fewest steps
 * a running request has left to its max_steps), for admission (written to
 * SB_W_ROOM_STEPS + batcher as 1 + room_steps; the batcher sets the word
 * to 0 as it stops); and the figures: out[0] steps, out[1] chunks,
 * out[2] requests in every running batch */
void sb_set_active(sb_ring *r, uint32_t batcher, uint32_t active, uint32_t room_steps);
void sb_stream_counts(const sb_ring *r, uint64_t *out);
/* the sum and maximum (ns) of SB_H_TTFT's, SB_H_CHUNK's or SB_H_E2E's times */
void sb_stream_times(const sb_ring *r, int which, uint64_t *sum_ns, uint64_t *max_ns);

/* reaper (reap.c): the supervisor, and a client making room */
/* every slot's ctl and (if its owner has written it) owner start, up to n
 * of them; returns how many it wrote */
uint32_t sb_snapshot(const sb_ring *r, uint64_t *ctl, uint64_t *owner_start, uint32_t n);
int sb_reap_slot(sb_ring *r, uint32_t slot, uint64_t expected_ctl);
/* a dead batcher's CLAIMED slots: with retry, those not being retried alone
 * and (iterative) without a chunk yet stay CLAIMED under its number for its
 * successor (counted in *kept), streams that had begun fail with begun_msg,
 * the others with msg; without retry all fail with msg. Its ABANDONED slots
 * are freed. Returns how many failed. */
uint32_t sb_reap_batcher(sb_ring *r, uint32_t batcher, uint32_t retry,
			 const char *msg, uint32_t msg_len, const char *begun_msg,
			 uint32_t begun_len, uint32_t *kept);
/* --- cdef end --------------------------------------------------------- */
#endif
