/*
 * setup.c - the segment's layout, its creation, and each process's private
 * copy of its geometry (sb_ring). The only file that reads the header's
 * geometry fields: once, at attach, each field a single load, checked on
 * the copy (a check of the segment itself could change under it).
 */
#include "segment.h"

#include <string.h>

struct offsets {
	uint64_t ctl, ready, meta, errmsg, lengths, stream, waker, tensor[SB_MAX_TENSORS], total;
	uint64_t slot_bytes;
};

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }

static uint32_t ready_words(uint32_t capacity) { return (capacity + 63) / 64; }

static int compute_offsets(uint32_t cap, uint32_t tensors, uint32_t inputs,
			   const uint64_t *slot_bytes, uint32_t in_place, uint32_t levels,
			   uint32_t steps, struct offsets *o)
{
	/* caps keep every product below 2^60: no overflow in the sums */
	if (cap == 0 || cap > SB_MAX_CAPACITY || tensors > SB_MAX_TENSORS ||
	    inputs == 0 || inputs >= tensors || in_place > 1 ||
	    (in_place && (tensors != 2 || slot_bytes[0] != slot_bytes[1])) ||
	    levels == 0 || levels > SB_MAX_PRIORITIES || steps > SB_MAX_STEPS ||
	    (steps && in_place))
		return SB_EBADARG;
	o->ctl = SB_HEADER_BYTES;
	o->ready = align_up(o->ctl + 8ull * cap, 64);
	o->meta = align_up(o->ready + 8ull * levels * ready_words(cap), 64);
	o->errmsg = align_up(o->meta + sizeof(sb_slot_meta) * cap, 64);
	o->lengths = align_up(o->errmsg + (uint64_t)SB_ERRMSG_BYTES * cap, 64);
	o->stream = align_up(o->lengths + 4ull * inputs * cap, 64);
	o->waker = align_up(o->stream + (steps ? sizeof(sb_slot_stream) * cap : 0), 64);
	uint64_t at = align_up(o->waker + 8ull * cap, 4096);
	o->slot_bytes = 0;
	for (uint32_t t = 0; t < tensors; t++) {
		if (slot_bytes[t] == 0 || slot_bytes[t] > (1ull << 36))
			return SB_EBADARG;
		if (in_place && t == 1) { /* the answer overwrites its own input row */
			o->tensor[1] = o->tensor[0];
			continue;
		}
		o->tensor[t] = at;
		o->slot_bytes += slot_bytes[t];
		at = align_up(at + slot_bytes[t] * cap, 4096);
	}
	o->total = at;
	return SB_OK;
}

uint64_t sb_layout_bytes(uint32_t capacity, uint32_t tensors, uint32_t inputs,
			 const uint64_t *slot_bytes, uint32_t in_place, uint32_t levels,
			 uint32_t steps)
{
	struct offsets o;
	if (compute_offsets(capacity, tensors, inputs, slot_bytes, in_place, levels, steps, &o))
		return 0;
	return o.total;
}

/* r from checked values and their offsets */
static void fill(sb_ring *r, char *base, uint64_t mapped, uint32_t capacity,
		 uint32_t max_batch, uint32_t tensors, uint32_t inputs,
		 const uint64_t *slot_bytes, uint32_t in_place, uint32_t levels,
		 uint32_t steps, uint64_t incarnation, const struct offsets *o)
{
	memset(r, 0, sizeof(*r));
	r->base = base;
	r->mapped_bytes = mapped;
	r->total_bytes = o->total;
	r->slot_bytes = o->slot_bytes;
	r->incarnation = incarnation;
	r->capacity = capacity;
	r->max_batch = max_batch;
	r->tensors = tensors;
	r->inputs = inputs;
	r->in_place = in_place;
	r->levels = levels;
	r->steps = steps;
	r->ready_words = ready_words(capacity);
	r->off_ctl = o->ctl;
	r->off_ready = o->ready;
	r->off_meta = o->meta;
	r->off_errmsg = o->errmsg;
	r->off_lengths = o->lengths;
	r->off_stream = o->stream;
	r->off_waker = o->waker;
	for (uint32_t t = 0; t < tensors; t++) {
		r->off_tensor[t] = o->tensor[t];
		r->tensor_slot_bytes[t] = slot_bytes[t];
	}
}

/* one field of the header set to the creator's value: 1 if it had another.
 * relaxed: the release store of the magic after them orders them for attachers */
#define RESTORE(field, value)                                                  \
	((sb_load_relaxed(&(field)) != (value))                                 \
		 ? (sb_store_relaxed(&(field), (value)), 1) : 0)

/* The header's geometry written from r (the creator's): at init, and at
 * each restore; returns how many fields had another value. */
static int put_geometry(sb_header *h, const sb_ring *r)
{
	int changed = 0;
	changed += RESTORE(h->layout_version, (uint32_t)SB_LAYOUT_VERSION);
	changed += RESTORE(h->header_bytes, (uint32_t)SB_HEADER_BYTES);
	changed += RESTORE(h->incarnation, r->incarnation);
	changed += RESTORE(h->capacity, r->capacity);
	changed += RESTORE(h->max_batch, r->max_batch);
	changed += RESTORE(h->tensors, r->tensors);
	changed += RESTORE(h->inputs, r->inputs);
	changed += RESTORE(h->slot_bytes, r->slot_bytes);
	changed += RESTORE(h->total_bytes, r->total_bytes);
	changed += RESTORE(h->in_place, r->in_place);
	changed += RESTORE(h->levels, r->levels);
	changed += RESTORE(h->steps, r->steps);
	changed += RESTORE(h->off_ctl, r->off_ctl);
	changed += RESTORE(h->off_ready, r->off_ready);
	changed += RESTORE(h->off_meta, r->off_meta);
	changed += RESTORE(h->off_errmsg, r->off_errmsg);
	changed += RESTORE(h->off_lengths, r->off_lengths);
	changed += RESTORE(h->off_stream, r->off_stream);
	changed += RESTORE(h->off_waker, r->off_waker);
	for (uint32_t t = 0; t < SB_MAX_TENSORS; t++) {
		changed += RESTORE(h->off_tensor[t], t < r->tensors ? r->off_tensor[t] : 0);
		changed += RESTORE(h->tensor_slot_bytes[t],
				   t < r->tensors ? r->tensor_slot_bytes[t] : 0);
	}
	return changed;
}

int sb_init(sb_ring *r, void *base, uint64_t total_bytes, uint32_t capacity,
	    uint32_t max_batch, uint32_t tensors, uint32_t inputs,
	    const uint64_t *slot_bytes, uint32_t in_place, uint32_t levels,
	    uint32_t steps, uint64_t incarnation)
{
	struct offsets o;
	sb_header *h = base;
	if (compute_offsets(capacity, tensors, inputs, slot_bytes, in_place, levels, steps, &o) ||
	    o.total > total_bytes || max_batch == 0 || max_batch > capacity)
		return SB_EBADARG;
	memset(base, 0, o.tensor[0]);
	fill(r, base, total_bytes, capacity, max_batch, tensors, inputs, slot_bytes,
	     in_place, levels, steps, incarnation, &o);
	put_geometry(h, r);
	/* release: an attacher that acquires the magic sees the whole header */
	sb_store_release(&h->magic, SB_MAGIC);
	return SB_OK;
}

static int check_header(const sb_header *h, uint64_t mapped_bytes)
{
	if (mapped_bytes < SB_HEADER_BYTES)
		return SB_ECORRUPT;
	/* acquire: pairs with the release store of the magic in sb_init */
	if (sb_load_acquire(&h->magic) != SB_MAGIC)
		return SB_ECORRUPT;
	if (sb_load_relaxed(&h->layout_version) != SB_LAYOUT_VERSION ||
	    sb_load_relaxed(&h->header_bytes) != SB_HEADER_BYTES)
		return SB_EVERSION;
	return SB_OK;
}

int sb_attach_header(sb_ring *r, void *base, uint64_t mapped_bytes)
{
	int code = check_header(base, mapped_bytes);
	if (code != SB_OK)
		return code;
	memset(r, 0, sizeof(*r));
	r->base = base;
	r->mapped_bytes = mapped_bytes;
	r->incarnation = sb_load_relaxed(&((sb_header *)base)->incarnation);
	return SB_OK;
}

int sb_attach(sb_ring *r, void *base, uint64_t mapped_bytes)
{
	const sb_header *h = base;
	int code = check_header(h, mapped_bytes);
	if (code != SB_OK)
		return code;
	/* each field loaded once (relaxed: the magic's acquire ordered them);
	 * from here only these copies are looked at */
	uint32_t capacity = sb_load_relaxed(&h->capacity);
	uint32_t max_batch = sb_load_relaxed(&h->max_batch);
	uint32_t tensors = sb_load_relaxed(&h->tensors);
	uint32_t inputs = sb_load_relaxed(&h->inputs);
	uint32_t in_place = sb_load_relaxed(&h->in_place);
	uint32_t levels = sb_load_relaxed(&h->levels);
	uint32_t steps = sb_load_relaxed(&h->steps);
	uint64_t total = sb_load_relaxed(&h->total_bytes);
	uint64_t incarnation = sb_load_relaxed(&h->incarnation);
	uint64_t off[7] = {
		sb_load_relaxed(&h->off_ctl), sb_load_relaxed(&h->off_ready),
		sb_load_relaxed(&h->off_meta), sb_load_relaxed(&h->off_errmsg),
		sb_load_relaxed(&h->off_lengths), sb_load_relaxed(&h->off_stream),
		sb_load_relaxed(&h->off_waker),
	};
	uint64_t slot_bytes[SB_MAX_TENSORS], off_tensor[SB_MAX_TENSORS];
	struct offsets o;
	if (tensors > SB_MAX_TENSORS)
		return SB_ECORRUPT;
	for (uint32_t t = 0; t < tensors; t++) {
		slot_bytes[t] = sb_load_relaxed(&h->tensor_slot_bytes[t]);
		off_tensor[t] = sb_load_relaxed(&h->off_tensor[t]);
	}
	if (compute_offsets(capacity, tensors, inputs, slot_bytes, in_place, levels, steps, &o) ||
	    max_batch == 0 || max_batch > capacity ||
	    o.ctl != off[0] || o.ready != off[1] || o.meta != off[2] ||
	    o.errmsg != off[3] || o.lengths != off[4] || o.stream != off[5] ||
	    o.waker != off[6] ||
	    o.total != total || o.total > mapped_bytes)
		return SB_ECORRUPT;
	for (uint32_t t = 0; t < tensors; t++)
		if (o.tensor[t] != off_tensor[t])
			return SB_ECORRUPT;
	fill(r, base, mapped_bytes, capacity, max_batch, tensors, inputs, slot_bytes,
	     in_place, levels, steps, incarnation, &o);
	return SB_OK;
}

/* words[]: identities use acquire/release (a pid is read with what was set
 * before it); counters are statistics, relaxed is enough. */
uint64_t sb_word_get(const sb_ring *r, int word)
{
	return (unsigned)word < SB_WORDS_ALL ? sb_load_acquire(word_at(r, (uint32_t)word)) : 0;
}

void sb_word_set(sb_ring *r, int word, uint64_t value)
{
	if ((unsigned)word < SB_WORDS_ALL)
		sb_store_release(word_at(r, (uint32_t)word), value);
}

void sb_word_add(sb_ring *r, int word, uint64_t delta)
{
	if ((unsigned)word < SB_WORDS_ALL)
		sb_add_relaxed(word_at(r, (uint32_t)word), delta);
}

uint64_t sb_corrupt_total(const sb_ring *r)
{
	return sb_load_relaxed(&hdr(r)->corrupt_total); /* relaxed: a count */
}

int sb_restore_header(sb_ring *r)
{
	sb_header *h = hdr(r);
	if (r->capacity == 0)
		return 0; /* a header-only view owns no geometry */
	int changed = put_geometry(h, r) + (sb_load_relaxed(&h->magic) != SB_MAGIC);
	/* release: an attacher that acquires the magic sees the fields above */
	sb_store_release(&h->magic, SB_MAGIC);
	if (changed)
		sb_add_relaxed(&h->corrupt_total, (uint64_t)changed);
	return changed;
}
