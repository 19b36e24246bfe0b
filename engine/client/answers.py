"""A ticket's answer, read out of its slot, and then the slot freed.

An engine of one output takes an answer in one C call (sb_take: copy the
row out, stamp the request's times, free the slot); one of several outputs
waits for the answer, copies each output's row, then frees the slot. Inside
the engine an answer is its outputs in spec order; the caller gets the
engine's form (config.answer): one array, or a dict of named arrays.
"""
import sys
from typing import Optional

import numpy as np

from engine.client import tracing, waiting
from engine.client.tracing import TRACE_MODULE
from engine.errors import EngineCorrupt, EngineError
from engine.shm import codes


def take(seg, slot: int, gen: int, outs: Optional[tuple]):
    """(code, stamps, outputs) of one take that does not wait: answered, its
    outputs (into outs' arrays, or new ones) and, with one output, the
    request's (arrival_ns, claim_ns, done_ns); else the code (ETIMEOUT: not
    yet; EFAILED: the slot is left to waiting.failed)."""
    if seg.fused_out:
        into = outs[0] if outs is not None else np.empty(seg.out_shape, seg.out_dtype)
        code, stamps = seg.ring.take_timed(slot, gen, into)
        return code, stamps, (into,)
    code = seg.ring.wait_slot(slot, gen, 0, 0)
    return code, None, read(seg, slot, gen, outs) if code == codes.OK else None


def read(seg, slot: int, gen: int, outs: Optional[tuple]) -> tuple:
    """An answered ticket's outputs, copied into outs' arrays (or new ones);
    the slot freed."""
    if seg.iterative:  # an iterative engine's: the chunks its batcher wrote
        steps = chunk_count(seg, slot, gen)
        outs = tuple(region[slot, :steps].copy() for region in seg.out_regions)
    elif outs is None:
        outs = tuple(region[slot].copy() for region in seg.out_regions)
    else:
        for out, region in zip(outs, seg.out_regions):
            np.copyto(out, region[slot])
    seg.ring.release_slot(slot, gen)
    return outs


def chunk_count(seg, slot: int, gen: int) -> int:
    """How many chunks a settled iterative request's batcher wrote (checked
    in C against the engine's max_steps; EngineCorrupt beyond it)."""
    code, word = seg.ring.wait_chunks(slot, gen, codes.CHUNKS_COUNT, 0)
    if code != codes.OK:
        seg.ring.release_slot(slot, gen)  # settled (the caller saw it): ours to free
        raise EngineCorrupt(f"engine {seg.name!r}: expected the request's chunk count within "
                            f"max_steps {seg.steps}, got one beyond it (code {code})")
    return word & codes.CHUNKS_COUNT


def settle_now(seg, slot: int, gen: int, outs: Optional[tuple],
               error: Optional[EngineError] = None):
    """settle(), by a caller that settles its own request in the context it
    made it in (infer_async()'s answer that came at once): a settled one's
    span is recorded here (engine.client.tracing)."""
    settled, value, failure, stamps = settle(seg, slot, gen, outs, error)
    if settled and TRACE_MODULE in sys.modules:
        began = tracing.begin()
        if began is not None:
            tracing.record(began, seg.name, stamps, failure)
    return settled, value, failure, stamps


def settle(seg, slot: int, gen: int, outs: Optional[tuple],
           error: Optional[EngineError] = None):
    """A ticket's outcome without waiting: (settled, answer, error, stamps).
    Answered: its answer, in the caller's form, with the request's stamps
    (None with several outputs). Not answered: with error, the request
    abandoned and error returned (unless it was answered that instant);
    without, (False, None, None, None)."""
    code, stamps, outputs = take(seg, slot, gen, outs)
    if code == codes.ETIMEOUT:
        if error is None:
            return False, None, None, None
        if waiting.give_up(seg, slot, gen, error) is not None:
            return True, None, error, None
        code, stamps, outputs = take(seg, slot, gen, outs)
    if code == codes.OK:
        return True, seg.config.answer(outputs), None, stamps
    return True, None, waiting.failed(seg, slot, gen, code), None
