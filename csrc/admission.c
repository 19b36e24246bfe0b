/*
 * admission.c - the figures admission by deadline reads, its prediction of
 * a request's wait, and the batcher's fit of its service time that feeds it.
 * Every figure comes from the segment: bounded before it divides, and the
 * arithmetic saturates instead of wrapping.
 */
#include "segment.h"

uint32_t sb_queued(const sb_ring *r, uint32_t max_priority)
{
	uint32_t n = 0;
	for (uint32_t level = 0; level <= max_priority && level < r->levels; level++)
		for (uint32_t w = 0; w < r->ready_words; w++) /* relaxed: a hint */
			n += (uint32_t)__builtin_popcountll(sb_load_relaxed(ready_word(r, level, w)));
	return n;
}

void sb_admission_figures(const sb_ring *r, uint32_t max_priority, uint32_t count,
			  uint64_t *out)
{
	const sb_header *h = hdr(r);
	uint64_t instances = sb_word_get(r, SB_W_INSTANCES), busy_since = 0;
	uint64_t limit = sb_word_get(r, SB_W_BATCH_LIMIT);
	out[SB_A_QUEUED] = count ? sb_queued(r, max_priority) : 0;
	out[SB_A_FIXED_NS] = sb_word_get(r, SB_W_FIT_FIXED_NS);
	out[SB_A_ITEM_PS] = sb_word_get(r, SB_W_FIT_ITEM_PS);
	out[SB_A_LIMIT] = limit == 0 ? 1 : limit > r->max_batch ? r->max_batch : limit;
	for (uint64_t i = 0; i < instances && i < SB_MAX_INSTANCES; i++) {
		/* relaxed: a figure, written by each batcher as its batch starts */
		uint64_t started = sb_load_relaxed(&h->words[SB_W_BATCH_START + i]);
		if (!started) {
			busy_since = 0; /* one is idle */
			break;
		}
		if (started > busy_since)
			busy_since = started;
	}
	out[SB_A_BUSY_SINCE] = busy_since;
}

/* A prediction admitted, for the calling thread's next publish (ring.h):
 * thread-local, as a thread admits and then publishes its own request */
static __thread uint32_t admitted_us;

uint32_t take_predicted_us(void)
{
	uint32_t us = admitted_us;
	admitted_us = 0;
	return us;
}

/* The correction every prediction is multiplied by, in 1/SB_SCALE_ONE:
 * read from the segment, so bounded before it multiplies */
static uint64_t scale_of(const sb_ring *r)
{
	uint64_t scale = sb_word_get(r, SB_W_ADMIT_SCALE);
	if (!scale)
		return SB_SCALE_ONE;
	if (scale < SB_SCALE_ONE / SB_SCALE_MIN_INV)
		return SB_SCALE_ONE / SB_SCALE_MIN_INV;
	return scale > SB_SCALE_ONE * SB_SCALE_MAX ? SB_SCALE_ONE * SB_SCALE_MAX : scale;
}

/* An iterative engine whose every running batch is full: the fewest steps
 * until one has room (each batcher's word, 1 + steps, bounded), else 0 */
static uint64_t steps_to_room(const sb_ring *r)
{
	uint64_t fewest = 0;
	for (uint32_t b = 0; b < SB_MAX_INSTANCES; b++) {
		/* relaxed: a figure each batcher writes after its step */
		uint64_t word = sb_load_relaxed(word_at(r, SB_W_ROOM_STEPS + b));
		if (!word)
			continue; /* not serving */
		if (word == 1)
			return 0; /* room now */
		uint64_t steps = word - 1 < SB_MAX_STEPS ? word - 1 : SB_MAX_STEPS;
		if (!fewest || steps < fewest)
			fewest = steps;
	}
	return fewest;
}

/* the predicted wait with `queued` requests ahead (UINT64_MAX: count them) */
static uint64_t wait_behind(sb_ring *r, uint32_t priority, uint64_t now_ns, uint64_t queued)
{
	uint64_t f[5];
	sb_admission_figures(r, priority, queued == UINT64_MAX, f);
	if (queued == UINT64_MAX)
		queued = f[SB_A_QUEUED];
	uint64_t fixed = f[SB_A_FIXED_NS], item_ps = f[SB_A_ITEM_PS];
	if (!fixed && !item_ps)
		return 0; /* no batch measured yet */
	if (!queued && !f[SB_A_BUSY_SINCE])
		return 0; /* an idle engine takes it at once (its figures may be stale) */
	uint64_t limit = f[SB_A_LIMIT] ? f[SB_A_LIMIT] : 1; /* within [1, max_batch] */
	uint64_t instances = sb_word_get(r, SB_W_INSTANCES);
	if (instances == 0 || instances > SB_MAX_INSTANCES)
		instances = instances ? SB_MAX_INSTANCES : 1;
	/* an iterative engine's batch (a step) holds its running requests too:
	 * a batcher's share of them, each read from the segment and bounded */
	uint64_t running = 0;
	if (r->steps) {
		for (uint32_t b = 0; b < SB_MAX_INSTANCES; b++) /* relaxed: figures */
			running += (uint32_t)sb_load_relaxed(&hdr(r)->active[b]);
		running /= instances;
		if (running > limit)
			running = limit;
	}
	uint64_t batch_ns = sat_add(fixed, sat_mul(limit, item_ps) / 1000), in_service = 0;
	uint64_t now_batch = r->steps ? sat_add(fixed, sat_mul(running, item_ps) / 1000)
				      : batch_ns;
	if (f[SB_A_BUSY_SINCE]) {
		uint64_t ran = now_ns > f[SB_A_BUSY_SINCE] ? now_ns - f[SB_A_BUSY_SINCE] : 0;
		in_service = now_batch > ran ? now_batch - ran : 0;
	}
	uint64_t per_round = limit * instances; /* <= 2^32 * 32: no wrap, never 0 */
	uint64_t rounds = queued / per_round;
	uint64_t own = queued - rounds * per_round + 1 + running;
	if (own > limit)
		own = limit;
	/* a full running batch: nobody joins before a running request leaves,
	 * at the latest at its max_steps */
	uint64_t blocked = r->steps ? sat_mul(steps_to_room(r), now_batch) : 0;
	uint64_t wait = sat_add(sat_add(in_service, blocked),
				sat_add(sat_mul(rounds, batch_ns),
					sat_add(fixed, sat_mul(own, item_ps) / 1000)));
	return wait;
}

/* a prediction with the correction learned from the waits seen */
static uint64_t corrected(const sb_ring *r, uint64_t wait)
{
	uint64_t scale = scale_of(r); /* <= 2^12: the remainder's product cannot wrap */
	return sat_add(sat_mul(wait / SB_SCALE_ONE, scale),
		       (wait % SB_SCALE_ONE) * scale / SB_SCALE_ONE);
}

uint64_t sb_predicted_wait_ns(sb_ring *r, uint32_t priority, uint64_t now_ns)
{
	return corrected(r, wait_behind(r, priority, now_ns, UINT64_MAX));
}

/* The rule: refuse when the predicted wait, plus an eighth of it for the
 * estimate's error, ends after the deadline. Under overload the queue
 * settles where this holds with little to spare: without the eighth, a wait
 * a little longer than predicted would make most answers late; at loads the
 * engine keeps up with, waits are far shorter than deadlines and the eighth
 * refuses nothing. */
int sb_refuses(uint64_t wait_ns, uint64_t left_ns)
{
	return sat_add(wait_ns, wait_ns / 8) > left_ns;
}

int sb_admit(sb_ring *r, uint32_t priority, uint64_t deadline_ns, uint32_t *wait_ms)
{
	uint64_t now = sb_now_ns(), left = deadline_ns > now ? deadline_ns - now : 0;
	admitted_us = 0;
	/* counting the queue costs a pass over the bitmaps: skipped when even
	 * a full queue would leave time enough */
	if (!sb_refuses(corrected(r, wait_behind(r, priority, now, r->capacity)), left))
		return SB_OK;
	uint64_t raw = wait_behind(r, priority, now, UINT64_MAX), wait = corrected(r, raw);
	if (!sb_refuses(wait, left)) {
		/* the uncorrected prediction: what the correction is learned from */
		uint64_t us = raw / 1000;
		admitted_us = us > UINT32_MAX ? UINT32_MAX : (uint32_t)us;
		return SB_OK;
	}
	uint64_t ms = wait / 1000000;
	*wait_ms = ms > UINT32_MAX ? UINT32_MAX : (uint32_t)ms;
	/* relaxed: a figure, read by nobody who orders on it */
	sb_add_relaxed(&hdr(r)->words[SB_W_OVERLOADED], 1);
	return SB_EOVERLOADED;
}

int sb_fit_add(sb_fit *f, uint32_t n, uint64_t service_ns)
{
	if (f->warmup) {
		f->warmup--;
		return 0;
	}
	double s = (double)service_ns, keep = 1.0 - 1.0 / SB_FIT_MEMORY;
	if (f->batches) {
		double cap = SB_FIT_OUTLIER * (f->fixed_ns + n * f->per_item_ns) + 1;
		if (s > cap)
			s = cap;
	}
	f->w = f->w * keep + 1.0;
	f->n = f->n * keep + n;
	f->nn = f->nn * keep + (double)n * n;
	f->s = f->s * keep + s;
	f->ns = f->ns * keep + n * s;
	f->batches++;
	if (f->batches > SB_FIT_REFIT && f->batches % SB_FIT_REFIT)
		return 0;
	/* with one batch size seen so far, all of the time is fixed: no slope */
	double spread = f->w * f->nn - f->n * f->n, per_item = 0;
	if (spread > 1e-9 * f->w * f->nn) {
		per_item = (f->w * f->ns - f->n * f->s) / spread;
		if (per_item < 0)
			per_item = 0;
	}
	double fixed = (f->s - per_item * f->n) / f->w;
	f->fixed_ns = fixed > 0 ? (double)(uint64_t)fixed : 0; /* whole ns */
	f->per_item_ns = per_item;
	return 1;
}
