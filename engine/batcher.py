"""The batcher process: gathers ready requests, calls the backend once, scatters.

Flush rule (the seed's): with nothing queued, sleep on the ring's work word
with no flush timer (after a batch, spin up to SPIN_NS first); once something
is queued its deadline is the OLDEST request's arrival + max_delay; flush when
max_batch_size are ready or the deadline passes, whichever comes first. The C
claim applies the rule's two thresholds in its one pass over the slots.
Requests that arrive during a backend call keep their arrival times, so under
load the next batch leaves at once.

The batch is a view of the input region itself when its slots are one
contiguous run (most batches: slots are handed out in order); otherwise it is
gathered once into a buffer allocated at start. Results go back by position
into each request's own output row (its input row, when the engine answers in
place: then a backend that returns its contiguous batch needs no copy back).

Several batchers may serve one ring: each claims slots by CAS, so no request
is taken twice. A batcher holds no state that outlives a batch: when one is
killed the supervisor fails its claimed slots and starts another.
"""
import os
import pickle
import sys
import traceback
from multiprocessing.connection import Connection

import numpy as np

from engine import backends, liveness, ring
from engine.layout import Segment, describe, shape_text

# The idle wait has no flush timer; this bound only lets a batcher notice a
# lost parent even if the kernel's parent-death signal did not fire.
IDLE_CHECK_NS = 1_000_000_000

# After a batch, a batcher that finds nothing queued spins up to ring.SPIN_NS
# before it sleeps: under steady load the next request comes within it. One
# spin per batch at most: an idle batcher sleeps.
SPIN_NS = ring.SPIN_NS  # read at import, before any pinning


class BadResult(Exception):
    """The backend returned something that is not n outputs of the right spec."""


class Batcher:
    def __init__(self, segment: Segment, instance: int, fn):
        cfg = segment.config
        self.seg = segment
        self.ring = segment.ring
        self.instance = instance
        self.fn = fn
        self.max_batch = cfg.max_batch_size
        self.max_delay_ns = int(cfg.max_delay_ms * 1e6)
        self.var_axis = cfg.var_axis
        self.out_shape = tuple(cfg.output_shape)
        self.out_dtype = np.dtype(cfg.output_dtype)
        # preallocated once: the claim buffers and the gather buffer
        self.batch = ring.Batch(segment.capacity, self.max_batch)
        self.gather = np.zeros((self.max_batch, *cfg.padded_shape), dtype=cfg.input_dtype)

    def run(self) -> None:
        """Serves until the engine is STOPPED and nothing is left to serve."""
        r, spin_ns = self.ring, 0
        while True:
            seen = r.work_seq()  # before the claim's scan: a publish after it wakes us
            state = self.seg.engine_state()
            if state == ring.ENGINE_RUNNING:  # the flush rule: full, or the oldest is due
                flush_n, cutoff_ns = self.max_batch, ring.now_ns() - self.max_delay_ns
            else:  # stopping: drain what is left without waiting
                flush_n, cutoff_ns = 1, ring.MAX_NS
            n, claim_ns, ready, oldest_ns = r.claim(self.instance, self.max_batch, flush_n,
                                                    cutoff_ns, self.batch)
            if n:
                self.serve(n, claim_ns)
                spin_ns = SPIN_NS
            elif ready == 0:
                if state == ring.ENGINE_STOPPED:
                    return
                r.wait_work(seen, IDLE_CHECK_NS, spin_ns)
                spin_ns = 0
            elif oldest_ns > cutoff_ns:  # not due yet: sleep until it is (else: raced, retry)
                r.wait_work(seen, oldest_ns - cutoff_ns)

    def serve(self, n: int, claim_ns: int) -> None:
        """Runs one claimed batch: slots[:n] in ascending slot order."""
        self.seg.mark_batch(self.instance, claim_ns)
        slots = self.batch.slots[:n]
        first = int(slots[0])
        contiguous = int(slots[-1]) - first == n - 1
        if contiguous:
            batch = self.seg.inputs[first:first + n]
        else:
            # mode="clip": the slots are in range, and "raise" would buffer the copy (~4x slower)
            batch = np.take(self.seg.inputs, slots, axis=0, out=self.gather[:n], mode="clip")
        try:
            if self.var_axis is None:
                result = self.fn(batch)
            else:
                lengths = self.batch.lengths[:n].astype(np.int64)
                index = [slice(None)] * batch.ndim
                index[self.var_axis + 1] = slice(0, int(lengths.max()))
                result = self.fn(batch[tuple(index)], lengths)
            out = self.check_result(result, n)
            if contiguous and self.seg.in_place and out is batch:
                pass  # answered in place: the rows already hold the answers
            elif contiguous:
                self.seg.outputs[first:first + n] = out
            else:
                self.seg.outputs[slots] = out
            status, message = ring.STATUS_OK, b""
        except Exception as e:  # the backend's fault fails this batch only
            status = ring.STATUS_BACKEND
            message = f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:ring.ERRMSG_BYTES]
        self.ring.complete(self.instance, self.batch, n, status, message)
        self.ring.finish_batch(self.batch, n, claim_ns, ring.now_ns(), contiguous)
        self.seg.mark_batch(self.instance, 0)

    def check_result(self, result, n: int) -> np.ndarray:
        if (type(result) is np.ndarray and result.dtype == self.out_dtype
                and result.shape == (n, *self.out_shape)):
            return result  # the common case, checked cheaply
        try:
            out = np.asarray(result)
        except Exception as e:
            raise BadResult(f"backend result is not an array ({type(e).__name__}: {e})") from None
        want = (n, *self.out_shape)
        if out.shape != want:
            raise BadResult(f"expected {self.out_dtype}{shape_text(want)} (one row per "
                            f"request), got {describe(out)}")
        if not np.can_cast(out.dtype, self.out_dtype, casting="same_kind"):
            raise BadResult(f"expected {self.out_dtype}{shape_text(want)}, got {describe(out)}")
        return out


def main(name: str, instance: int, backend, backend_args: dict, cpus, gpu, conn) -> None:
    """Runs batcher `instance` of engine `name`; reports ("ready", pid) or
    ("error", type, message, traceback) on conn once, then serves."""
    try:
        liveness.die_with_parent()
        if gpu is not None:  # before the factory runs, as a CUDA runtime reads it once
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        if cpus:
            import psutil
            psutil.Process().cpu_affinity(list(cpus))
        segment = Segment.attach(name)
        fn = backends.resolve(backend)(**(backend_args or {}))
        batcher = Batcher(segment, instance, fn)
        pid = os.getpid()
        segment.ring.set_word(ring.W_BATCHER_START + instance, liveness.start_ticks(pid) or 0)
        segment.ring.set_word(ring.W_BATCHER_PID + instance, pid)
    except BaseException as e:
        conn.send(("error", type(e).__name__, str(e), traceback.format_exc()))
        conn.close()
        raise SystemExit(1)
    conn.send(("ready", pid))
    conn.close()
    batcher.run()


def _entry() -> None:
    """A batcher process's start: the supervisor pipes in sys.path, then the
    arguments of main() (pickled), and passes the readiness pipe's fd. A fresh
    interpreter, so the user's __main__ is never re-run."""
    sys.path[:] = pickle.load(sys.stdin.buffer)
    kwargs = pickle.load(sys.stdin.buffer)
    kwargs["conn"] = Connection(kwargs.pop("ready_fd"), readable=False)
    main(**kwargs)
