"""Client.infer_many: n requests enqueued, waited for and released in bulk.

The requests go in chunks of at most half the queue_capacity, so one bulk call
leaves room for other clients; each chunk is one C call each way (acquire,
publish, wait, release), its rows written and read as one numpy copy.

A chunk is admitted as its rows sent one by one would be: it takes no more
rows than its priority's share has room for (engine.client.shares: QueueFull
when not one), and with admission by deadline its first row is admitted as a
single submit is (Overloaded when refused); the next chunk starts once this
one is answered, so the call never holds more of the queue than its share.

On an iterative engine each request also opens its stream before its publish,
and each answer is its own chunks stacked (infer's): a list, not one array.
On a sampling engine each row's Sampling record is written beside its input
(sampled.records: one Sampling for every row, or one per row).
"""
import sys
from typing import Any, Optional

import numpy as np

from engine.client import room, sampled, shares, ticket, tracing
from engine.client.handle import Handle
from engine.client.tracing import TRACE_MODULE
from engine.errors import EngineCorrupt, EngineUnavailable, InvalidInput, Overloaded
from engine.shm import codes, ring


def infer_many(client: Handle, xs, timeout: Optional[float], priority: int,
               max_steps: Optional[int] = None, sampling=None):
    """The answers to xs[0], xs[1], ... stacked, or on an iterative engine
    listed (see Client.infer_many); traced, one span for the call
    (engine.client.tracing)."""
    began = tracing.begin() if TRACE_MODULE in sys.modules else None
    if began is None:
        return _infer_many(client, xs, timeout, priority, max_steps, sampling)
    error = None
    try:
        return _infer_many(client, xs, timeout, priority, max_steps, sampling)
    except BaseException as e:
        error = e
        raise
    finally:
        tracing.record(began, client.name, None, error,
                       len(xs) if hasattr(xs, "__len__") else None)


def _infer_many(client: Handle, xs, timeout: Optional[float], priority: int,
                max_steps: Optional[int], sampling):
    deadline = ticket.deadline_ns(timeout)
    seg, (xs,), (length,), _ = client.validated(xs, many=True, priority=priority,
                                                max_steps=max_steps, deadline=deadline)
    cfg, n, r = seg.config, len(xs), seg.ring
    try:
        if max_steps is not None and not seg.iterative:
            raise InvalidInput(f"max_steps: a one-shot engine answers once; expected None, got "
                               f"{max_steps!r}")
        records, ks = sampled.records(seg, sampling, n, max_steps)
    except InvalidInput:
        r.add_word(codes.W_INVALID)
        raise
    out: Any = [] if seg.iterative else np.empty((n, *cfg.output_shape), cfg.output_dtype)
    chunk = min(n, max(1, seg.capacity // 2))
    slots, gens = np.empty(chunk, np.uint32), np.empty(chunk, np.uint32)
    outcomes = np.empty(chunk, np.int32)
    done = 0
    while done < n:
        want = min(chunk, n - done, shares.room(seg, priority))
        if want == 0:
            raise shares.refused(seg, priority)
        if deadline is not None and seg.admit_by_deadline:
            code, wait_ms = r.admit(priority, deadline)
            if code == codes.EOVERLOADED:
                raise Overloaded.predicted(wait_ms, (deadline - ring.now_ns()) / 1e6)
        k = r.acquire_many(client.pid, client.start_ticks, want, slots, gens)
        if k == 0:
            code, slots[0], gens[0] = room.make_room(seg, client.pid, client.start_ticks, deadline)
            if code != codes.OK:
                raise EngineUnavailable(f"cannot enqueue on engine {client.name!r} (code {code})")
            k = 1 + r.acquire_many(client.pid, client.start_ticks, want - 1, slots[1:], gens[1:])
        s, g = slots[:k], gens[:k]
        rows = xs[done:done + k]
        if cfg.var_axis is not None:  # equal lengths, zero-padded to the bound
            padded = np.zeros((k, *cfg.padded_shape), cfg.input_dtype)
            padded[(slice(None),) * (cfg.var_axis + 1) + (slice(0, length),)] = rows
            rows = padded
        seg.in_regions[0][s] = rows
        if cfg.var_axis is not None:
            seg.lengths[s, 0] = length
        if records is not None:  # beside the inputs, read by the batcher at join
            seg.records[s] = records[done:done + k]
        if seg.iterative:  # a stream is opened between its write and its publish
            for slot, gen in zip(s.tolist(), g.tolist()):
                r.stream_open(slot, gen, max_steps or 0)
        r.publish_many(s, g, k, length, deadline or 0, priority)
        _await_all(client, seg, s, g, k, deadline, timeout)
        r.poll(s, g, outcomes[:k])
        failed = np.nonzero(outcomes[:k] == codes.EFAILED)[0]
        if len(failed):
            error = ticket.failed(seg, int(s[failed[0]]), int(g[failed[0]]), codes.EFAILED)
            r.release_many(s, g, k)
            raise error
        if seg.iterative:
            out += _chunks_of(seg, s, g, ks[done:done + k])
        else:
            out[done:done + k] = seg.out_regions[0][s]
            r.release_many(s, g, k)
        done += k
    return out


def _chunks_of(seg, slots, gens, ks) -> list:
    """Each answered iterative request's chunks stacked, as infer() returns
    them; every slot freed, even when one's chunk count is corrupt."""
    answers, error = [], None
    for slot, gen, k in zip(slots.tolist(), gens.tolist(), ks):
        try:
            answers.append(sampled.cut(seg.config.answer(ticket.read(seg, slot, gen, None)), k))
        except EngineCorrupt as e:  # read() freed its slot: the others still are ours
            error = error or e
    if error is not None:
        raise error
    return answers


def _await_all(client: Handle, seg, slots, gens, k, deadline, timeout) -> None:
    """Waits for k tickets; on a timeout or a dead engine abandons them all
    (answered ones released) and raises."""
    r = seg.ring
    why, code = ticket.wait(
        lambda slice_ns: r.wait_all(slots, gens, k, slice_ns, client.spin_ns),
        lambda: ticket.engine_lives(seg), deadline)
    if why == ticket.ANSWERED and code == codes.OK:
        return
    abandoned = 0
    for slot, gen in zip(slots.tolist(), gens.tolist()):
        code_k = r.abandon(slot, gen)
        abandoned += code_k == codes.OK
        if code_k == codes.EBUSY:
            r.release_slot(slot, gen)
    if why == ticket.EXPIRED:
        r.add_word(codes.W_TIMEOUTS, abandoned)
        raise ticket.timed_out(timeout, k)
    raise ticket.engine_gone(client.name)
