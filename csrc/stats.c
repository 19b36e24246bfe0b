/*
 * stats.c - the figures of finished batches: time histograms (queue wait,
 * service, per priority level), sums and maxima, and the service-time fit's
 * publication. All relaxed: statistics, ordered with nothing.
 */
#include "segment.h"

static uint32_t bucket_of(uint64_t v)
{
	/* 4 linear steps per power of two from 256 ns: <= 25 % error, up to
	 * about 15 minutes in 128 buckets */
	if (v < 256)
		return 0;
	uint32_t msb = 63 - (uint32_t)__builtin_clzll(v);
	uint32_t b = 4 * (msb - 8) + (uint32_t)((v >> (msb - 2)) & 3);
	return b < SB_HIST_BUCKETS ? b : SB_HIST_BUCKETS - 1;
}

uint64_t sb_bucket_lower_ns(uint32_t b)
{
	/* bucket_of inverted: bucket 4k + s starts at (4 + s) << (k + 6) */
	if (b == 0)
		return 0;
	if (b >= SB_HIST_BUCKETS)
		b = SB_HIST_BUCKETS - 1;
	return (uint64_t)(4 + b % 4) << (b / 4 + 6);
}

static void record_max(uint64_t *word, uint64_t v)
{
	uint64_t cur = sb_load_relaxed(word);
	/* relaxed: a statistic; the CAS only keeps the maximum monotonic */
	while (v > cur && !__atomic_compare_exchange_n(word, &cur, v, 0,
						       __ATOMIC_RELAXED, __ATOMIC_RELAXED))
		;
}

void sb_histogram(const sb_ring *r, int which, uint64_t *buckets)
{
	const sb_header *h = hdr(r);
	if (which < 0 || which > SB_H_E2E)
		return;
	const uint64_t *from = which <= SB_H_BATCH_SIZE ? h->hist[which]
				: which == SB_H_E2E ? h->e2e_hist
				: h->stream_hist[which - SB_H_TTFT];
	for (uint32_t b = 0; b < SB_HIST_BUCKETS; b++)
		buckets[b] = sb_load_relaxed(&from[b]);
}

void sb_level_wait(const sb_ring *r, uint32_t level, uint64_t *buckets,
		   uint64_t *sum_ns, uint64_t *max_ns)
{
	const sb_header *h = hdr(r);
	if (level >= SB_MAX_PRIORITIES)
		return;
	for (uint32_t b = 0; b < SB_HIST_BUCKETS; b++)
		buckets[b] = sb_load_relaxed(&h->level_hist[level][b]);
	*sum_ns = sb_load_relaxed(&h->level_wait_sum[level]);
	*max_ns = sb_load_relaxed(&h->level_wait_max[level]);
}

/* Admission's predictions against the waits seen: `compared` requests
 * predicted (uncorrected) to wait `predicted` ns in all waited `seen`, `late`
 * of them longer than their corrected prediction. The correction is the
 * ratio of seen to predicted over the recent comparisons (sums that forget
 * 1/SB_SCALE_MEMORY per batch compared): a long wait weighs more than a
 * short one, as a refusal near a deadline is about long waits. Relaxed,
 * and the read-modify-writes may lose another batcher's: an estimate. */
void judge_predictions(sb_ring *r, uint64_t compared, uint64_t predicted, uint64_t seen,
		       uint64_t late)
{
	sb_add_relaxed(word_at(r, SB_W_ADMIT_COMPARED), compared);
	sb_add_relaxed(word_at(r, SB_W_ADMIT_PREDICTED_NS), predicted);
	sb_add_relaxed(word_at(r, SB_W_ADMIT_SEEN_NS), seen);
	sb_add_relaxed(word_at(r, SB_W_ADMIT_LATE), late);
	uint64_t *p = word_at(r, SB_W_ADMIT_RECENT_PREDICTED_NS);
	uint64_t *s = word_at(r, SB_W_ADMIT_RECENT_SEEN_NS);
	uint64_t recent_p = sb_load_relaxed(p), recent_s = sb_load_relaxed(s);
	recent_p = sat_add(recent_p - recent_p / SB_SCALE_MEMORY, predicted);
	recent_s = sat_add(recent_s - recent_s / SB_SCALE_MEMORY, seen);
	sb_store_relaxed(p, recent_p);
	sb_store_relaxed(s, recent_s);
	double scale = SB_SCALE_ONE * ((double)recent_s / (double)recent_p); /* p >= 1000 */
	double low = (double)SB_SCALE_ONE / SB_SCALE_MIN_INV, high = SB_SCALE_ONE * SB_SCALE_MAX;
	scale = scale < low ? low : scale > high ? high : scale;
	sb_store_relaxed(word_at(r, SB_W_ADMIT_SCALE), (uint64_t)scale);
}

/* The queue waits of n requests claimed at claim_ns, served by done_ns;
 * their worst and sum in *worst, *total; and admission's predictions for
 * them against the waits they saw (to done_ns). */
static inline void record_waits(sb_ring *r, const uint32_t *slots, uint32_t n,
				uint64_t claim_ns, uint64_t done_ns, int ends,
				uint64_t *worst, uint64_t *total)
{
	sb_header *h = hdr(r);
	uint64_t compared = 0, predicted = 0, seen = 0, late = 0, scale = 0, served = 0;
	uint64_t e2e_sum = 0, e2e_max = 0; /* the shared words once a batch, not once a request */
	for (uint32_t k = 0; k < n; k++) {
		if (slots[k] >= r->capacity)
			continue;
		/* the batcher's own copy of claim_ns; arrival_ns was set before
		 * the publish that our claim acquired */
		const sb_slot_meta *m = meta_at(r, slots[k]);
		uint64_t arrival = sb_load_relaxed(&m->arrival_ns);
		uint64_t wait = claim_ns > arrival ? claim_ns - arrival : 0;
		uint32_t level = sb_load_relaxed(&m->priority); /* once: checked, then used */
		if (level >= r->levels) {
			corrupt(r);
			level = r->levels - 1; /* r->levels <= SB_MAX_PRIORITIES */
		}
		sb_add_relaxed(&h->hist[SB_H_QUEUE_WAIT][bucket_of(wait)], 1);
		if (ends) { /* a one-shot batch: its requests end with it, served from
			     * their claim (or their arrival, if it came during the claim) */
			uint64_t from = arrival > claim_ns ? arrival : claim_ns;
			uint64_t e2e = done_ns > arrival ? done_ns - arrival : 0;
			sb_add_relaxed(&h->e2e_hist[bucket_of(e2e)], 1);
			e2e_sum += e2e;
			e2e_max = e2e > e2e_max ? e2e : e2e_max;
			served += done_ns > from ? done_ns - from : 0;
		}
		sb_add_relaxed(&h->level_hist[level][bucket_of(wait)], 1);
		sb_add_relaxed(&h->level_wait_sum[level], wait);
		record_max(&h->level_wait_max[level], wait);
		*total += wait;
		if (wait > *worst)
			*worst = wait;
		uint64_t predicted_ns = 1000ull * sb_load_relaxed(&m->predicted_us);
		if (predicted_ns) {
			uint64_t waited = done_ns > arrival ? done_ns - arrival : 0;
			if (!scale) /* once per batch that compares */
				scale = sb_load_relaxed(word_at(r, SB_W_ADMIT_SCALE));
			compared++;
			predicted += predicted_ns;
			seen += waited;
			/* the prediction the rule used: corrected (a scale outside
			 * its bounds only misjudges this count) */
			late += waited > predicted_ns / SB_SCALE_ONE * (scale ? scale : SB_SCALE_ONE);
		}
	}
	if (compared)
		judge_predictions(r, compared, predicted, seen, late);
	if (served)
		sb_add_relaxed(word_at(r, SB_W_SERVED_NS), served);
	if (ends && n) {
		sb_add_relaxed(&h->e2e_sum, e2e_sum);
		record_max(&h->e2e_max, e2e_max);
	}
}

/* A backend call's figures: n requests in service_ns, ended at done_ns; the
 * fit's, with fit */
static inline int record_call(sb_ring *r, uint32_t n, uint64_t service, uint64_t done_ns,
			      uint64_t worst, uint64_t total_wait, int which, sb_fit *fit)
{
	sb_header *h = hdr(r);
	sb_add_relaxed(&h->hist[SB_H_SERVICE][bucket_of(service)], 1);
	sb_add_relaxed(&h->hist[SB_H_BATCH_SIZE][n < SB_HIST_BUCKETS ? n : SB_HIST_BUCKETS - 1], 1);
	sb_add_relaxed(&h->batch_ns[n < SB_BATCH_NS_SIZES ? n : SB_BATCH_NS_SIZES - 1], service);
	record_max(&h->last_done_ns, done_ns);
	record_max(&h->words[SB_W_QUEUE_WAIT_MAX_NS], worst);
	record_max(&h->words[SB_W_SERVICE_MAX_NS], service);
	sb_add_relaxed(&h->words[SB_W_QUEUE_WAIT_SUM_NS], total_wait);
	sb_add_relaxed(&h->words[SB_W_SERVICE_SUM_NS], service);
	if (which >= 0)
		sb_add_relaxed(&h->words[which], 1);
	sb_add_relaxed(&h->words[SB_W_BATCHES], 1);
	sb_add_relaxed(&h->words[SB_W_ITEMS], n);
	bump_done_seq(r);
	if (!fit || !sb_fit_add(fit, n, service) || fit->batches < SB_FIT_CALIBRATED)
		return 0;
	/* relaxed: figures for an estimate, each word read on its own */
	sb_store_relaxed(&h->words[SB_W_FIT_FIXED_NS], (uint64_t)fit->fixed_ns);
	sb_store_relaxed(&h->words[SB_W_FIT_ITEM_PS], (uint64_t)(fit->per_item_ns * 1000));
	return 1;
}

int sb_finish_batch(sb_ring *r, const uint32_t *slots, uint32_t n,
		    uint64_t claim_ns, uint64_t done_ns, uint32_t zero_copy,
		    sb_fit *fit)
{
	uint64_t worst = 0, total_wait = 0;
	record_waits(r, slots, n, claim_ns, done_ns, 1, &worst, &total_wait);
	uint64_t service = done_ns > claim_ns ? done_ns - claim_ns : 0;
	return record_call(r, n, service, done_ns, worst, total_wait,
			   zero_copy ? SB_W_ZERO_COPY : SB_W_GATHERED, fit);
}

int sb_finish_step(sb_ring *r, const uint32_t *joined, uint32_t k, uint32_t active,
		   uint64_t start_ns, uint64_t done_ns, sb_fit *fit)
{
	uint64_t worst = 0, total_wait = 0;
	record_waits(r, joined, k, start_ns, done_ns, 0, &worst, &total_wait);
	sb_add_relaxed(&hdr(r)->steps_total, 1);
	uint64_t service = done_ns > start_ns ? done_ns - start_ns : 0;
	/* each running request spent the step in the backend */
	sb_add_relaxed(word_at(r, SB_W_SERVED_NS), (uint64_t)active * service);
	return record_call(r, active, service, done_ns, worst, total_wait, -1, fit);
}

void sb_set_active(sb_ring *r, uint32_t batcher, uint32_t active, uint32_t room_steps)
{
	if (batcher >= SB_MAX_INSTANCES)
		return;
	/* relaxed: figures */
	sb_store_relaxed(&hdr(r)->active[batcher], active);
	sb_store_relaxed(word_at(r, SB_W_ROOM_STEPS + batcher), 1ull + room_steps);
}

void sb_stream_counts(const sb_ring *r, uint64_t *out)
{
	const sb_header *h = hdr(r);
	out[0] = sb_load_relaxed(&h->steps_total);
	out[1] = sb_load_relaxed(&h->chunks_total);
	out[2] = 0;
	for (uint32_t b = 0; b < SB_MAX_INSTANCES; b++) /* each at most 2^32: no overflow */
		out[2] += (uint32_t)sb_load_relaxed(&h->active[b]);
}

/* a stream's time figure (SB_H_TTFT or SB_H_CHUNK), for stream.c */
void record_stream_time(sb_ring *r, int which, uint64_t ns)
{
	sb_header *h = hdr(r);
	sb_add_relaxed(&h->stream_hist[which - SB_H_TTFT][bucket_of(ns)], 1);
	sb_add_relaxed(&h->stream_sum[which - SB_H_TTFT], ns);
	record_max(&h->stream_max[which - SB_H_TTFT], ns);
}

void record_e2e(sb_ring *r, uint64_t ns)
{
	sb_header *h = hdr(r);
	sb_add_relaxed(&h->e2e_hist[bucket_of(ns)], 1);
	sb_add_relaxed(&h->e2e_sum, ns);
	record_max(&h->e2e_max, ns);
}

void sb_stream_times(const sb_ring *r, int which, uint64_t *sum_ns, uint64_t *max_ns)
{
	*sum_ns = *max_ns = 0;
	if (which == SB_H_E2E) {
		*sum_ns = sb_load_relaxed(&hdr(r)->e2e_sum);
		*max_ns = sb_load_relaxed(&hdr(r)->e2e_max);
	}
	if (which == SB_H_TTFT || which == SB_H_CHUNK) {
		*sum_ns = sb_load_relaxed(&hdr(r)->stream_sum[which - SB_H_TTFT]);
		*max_ns = sb_load_relaxed(&hdr(r)->stream_max[which - SB_H_TTFT]);
	}
}
