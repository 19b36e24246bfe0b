"""The batcher process: gathers ready requests, calls the backend once, scatters.

Flush rule (policy.FlushRule): with nothing queued, sleep on the
ring's work word with no flush timer (after a batch or a wake on that word,
spin up to the rule's idle_spin_ns first: under steady load, or after a
client's expect_work, the next request comes within it);
once something is queued its deadline is the OLDEST request's arrival
+ max_delay; flush when max_batch_size are ready or the deadline passes,
whichever comes first. The C claim applies the rule's thresholds in its one
pass over the ready slots.
Requests that arrive during a backend call keep their arrival times, so under
load the next batch leaves at once.

The batch is a view of the input region itself when its slots are one
contiguous run (most batches: slots are handed out in order); otherwise it is
gathered once into a buffer allocated at start. Results go back by position
into each request's own output row (its input row, when the engine answers in
place: then a backend that returns its contiguous batch needs no copy back).

Several batchers may serve one ring: each claims slots by CAS, so no request
is taken twice. A batcher holds no state that outlives a batch: when one is
killed the supervisor starts another under its number, which first retries
the dead one's batch, each request alone (isolate_failures; else the
supervisor fails that batch).
"""
import os
import signal
from typing import Optional

import numpy as np

from engine import launch, spec
from engine.batching import admission, aimd, iterative, policy, sampled_steps, threads, warmup
from engine.batching.loop import RETIRED, STOPPED, await_epoch, await_work, error_text, tell_death
from engine.batching.model_call import ModelCall
from engine.segment import Segment
from engine.shm import codes, liveness, ring


class Batcher:
    """The loop of one batcher process: claim by the flush rule, serve, repeat."""

    def __init__(self, segment: Segment, instance: int, fn, epoch: int = 0):
        cfg = segment.config
        self.seg = segment
        self.ring = segment.ring
        self.instance = instance
        self.epoch = epoch  # serves while the engine's epoch is this one (see run)
        self.fn = fn
        self.rule = policy.FlushRule.of(cfg)
        self.max_batch = cfg.max_batch_size
        self.allowed = cfg.allowed_batch_sizes
        self.limit = segment.batch_limit() or cfg.max_batch_size  # AIMD's, with slo_ms
        # what a claim may take under the limit: padded up to an allowed size,
        # a batch stays within it (changes only with the limit)
        self.claim_limit = policy.fit_allowed(self.limit, self.allowed)
        # the header's words the loop reads (epoch, state) and stamps (the
        # watchdog's batch start) each batch, without a call (Segment.epoch(),
        # engine_state() and mark_batch() are these loads and stores)
        self.words = segment.words
        self.batch_start_word = codes.W_BATCH_START + instance
        self.slo_ns = None if cfg.slo_ms is None else int(cfg.slo_ms * 1e6)
        self.isolate = cfg.isolate_failures
        # admission's figures, fed by finish_batch in C each batch but the
        # first of each shape (it warms the model up: not a measure)
        self.fit = admission.ServiceFit()
        self.expire_lead_ns = 0  # the fit's fixed cost: less time than that left is too little
        self.in_place = segment.in_place
        # every tensor in spec order: the single-array form is one each way
        self.in_regions, self.out_regions = segment.in_regions, segment.out_regions
        self.call = ModelCall(cfg, cfg.max_batch_size)  # allowed sizes are at most it
        self.call_backend = self.call.bind(fn)
        # (tensor, its variable axis, its bound) of each input with a variable dim
        self.var_inputs = [(t, s.var_axis, s.max_shape[s.var_axis])
                           for t, s in enumerate(cfg.input_specs) if s.var_axis is not None]
        # the batch shapes a compiled model wants (None: any size, the longest length)
        top = max((bound for _, _, bound in self.var_inputs), default=None)
        self.var_top = top or 0  # the largest variable bound (0: none)
        self.shapes = policy.BatchShapes.of(cfg.max_batch_size, cfg.allowed_batch_sizes,
                                            cfg.length_buckets, cfg.max_batch_tokens, top)
        # preallocated once: the claim buffers and the gather buffers
        self.claimed = ring.ClaimBuffers(segment.capacity, cfg.max_batch_size)
        if self.shapes is not None:
            self.claimed.set_shape(self.shapes.bounds, self.shapes.most,
                                   self.shapes.take(cfg.max_batch_size))
        self.gather_buffers = [np.zeros((cfg.max_batch_size, *s.max_shape), s.dtype)
                               for s in cfg.input_specs]

    def run(self) -> str:
        """Serves until the engine is STOPPED and nothing is left to serve, or
        until a reload retires it (returns STOPPED or RETIRED). A one-shot
        engine's epochs hand the ring over without overlap: a batcher serves
        while the engine's epoch is its own, waits while it is older (started
        by a reload, not yet let in) and exits, between batches, once it is
        newer (retired)."""
        self.retry_inherited()  # a dead predecessor's batch first
        # with one request a batch, each turn's Python is a round trip's: what
        # the loop uses every turn is bound to locals once (self.claim_limit and
        # self.expire_lead_ns change with each batch: read each turn)
        r, words, rule, claimed = self.ring, self.words, self.rule, self.claimed
        instance, serve, now = self.instance, self.serve, ring.now_ns
        work_seq, claim, thresholds = r.work_seq, r.claim, rule.thresholds
        own_epoch, spin_ns = self.epoch, 0
        while True:
            seen = work_seq()  # before the claim's scan: a publish after it wakes us
            epoch = words[codes.W_EPOCH]
            if epoch != own_epoch:
                if epoch > own_epoch:
                    return RETIRED
                await_epoch(r)
                continue
            state = words[codes.W_ENGINE_STATE]
            now_ns = now()
            # the flush rule's thresholds, applied by the C claim in its one pass; a
            # request that cannot finish even alone in a batch starting now is
            # failed unstarted (expired): computing it helps nobody
            max_n, flush_n, cutoff_ns = thresholds(now_ns, state != codes.ENGINE_RUNNING,
                                                   self.claim_limit)
            n, claim_ns, ready, oldest_ns, _ = claim(instance, max_n, flush_n, cutoff_ns, claimed,
                                                     now_ns + self.expire_lead_ns)
            if n:
                serve(n, claim_ns)
                spin_ns = rule.idle_spin_ns
            else:
                if ready == 0 and state == codes.ENGINE_STOPPED:
                    return STOPPED
                spin_ns = await_work(r, rule, seen, ready, oldest_ns, cutoff_ns, now_ns, spin_ns)

    def retry_inherited(self) -> None:
        """The batch a dead predecessor left under this batcher number (kept
        by the supervisor with isolate_failures), each request retried alone:
        one that kills this batcher too then fails alone, as poison, and the
        others are answered. Those past their deadline fail unstarted."""
        r, claimed = self.ring, self.claimed
        for slot, gen, length in zip(*r.inherit(self.instance, ring.now_ns(),
                                                 self.seg.capacity)):
            claimed.slots[0], claimed.gens[0], claimed.lengths[0] = slot, gen, length
            claimed.bucket = self.shapes.bucket_of(int(length)) if self.shapes else 0
            if r.retry_alone(self.instance, int(slot), int(gen)) == codes.OK:
                self.serve(1, ring.now_ns())
            else:  # withdrawn by its client meanwhile: completing it frees it
                r.complete(self.instance, claimed, 1)

    def serve(self, n: int, claim_ns: int) -> None:
        """Runs one claimed batch, claimed.slots[:n] (ascending): gather, call,
        check, scatter, complete. A backend's fault fails this batch only,
        or, with isolate_failures, only the requests that fail alone."""
        words, r, claimed = self.words, self.ring, self.claimed
        words[self.batch_start_word] = claim_ns  # for the supervisor's watchdog (0: idle)
        slots = claimed.slots[:n]
        try:  # the real lengths only where a variable dim needs them
            contiguous = self.compute(slots, claimed.lengths[:n] if self.var_top else None,
                                      claimed.bucket)
        except Exception as e:
            contiguous = False
            if self.isolate and n > 1:
                self.isolate_failures(np.arange(n), error_text(e))
            else:
                r.complete(self.instance, claimed, n, codes.STATUS_BACKEND, error_text(e))
        else:
            r.complete(self.instance, claimed, n, codes.STATUS_OK, b"")
        done_ns = ring.now_ns()
        if r.finish_batch(claimed, n, claim_ns, done_ns, contiguous,
                          self.fit.measuring((claimed.bucket, n))):
            # the fit was solved anew: less time left than its fixed cost is too little
            self.expire_lead_ns = self.fit.estimate()[0]
        words[self.batch_start_word] = 0
        if self.slo_ns is not None:
            self.adapt(done_ns - claim_ns)

    def compute(self, slots: np.ndarray, lengths: Optional[np.ndarray], bucket: int) -> bool:
        """Gather, call, check and scatter for these slots (a batch or part of
        one), lengths their real lengths (None: no variable dim); returns
        whether the batch was a view of the rows (zero copy)."""
        n = len(slots)
        rows = policy.pad_size(n, self.allowed) if self.allowed else n
        batch, contiguous = self.gather(slots, rows)
        results = (self.call_cut(batch, slots, rows, bucket) if self.var_inputs
                   else self.call_backend(batch, None))
        outputs = self.call.check(results, rows)
        self.scatter(slots, batch, outputs, contiguous)
        if lengths is not None:  # padding waste, of answered requests only (each counted once)
            lengths = np.minimum(lengths, self.var_top)  # written by clients: bounded
            self.ring.add_word(codes.W_TOKENS, int(lengths.sum()))
            self.ring.add_word(codes.W_PADDED_TOKENS,
                               rows * self._cut(bucket, int(lengths.max()), self.var_top))
        return contiguous

    def adapt(self, service_ns: int) -> None:
        """With slo_ms, the batch limit after a batch (a request waits for at
        most one batch in service and then its own: each must take at most
        half the objective)."""
        self.limit = aimd.next_limit(self.limit, service_ns, self.slo_ns // 2, self.max_batch)
        self.claim_limit = policy.fit_allowed(self.limit, self.allowed)
        self.seg.set_batch_limit(self.limit)

    def isolate_failures(self, failed: np.ndarray, message: bytes) -> None:
        """The requests at claimed positions `failed` failed together: retried in
        halves until each failing one is alone, so the others get their answers
        (each from exactly one successful call; about 2 log2(n) extra calls for
        one failing request). A failing request alone fails with its own error."""
        if len(failed) == 1:
            self._complete_part(failed, codes.STATUS_BACKEND, message)
            self.ring.add_word(codes.W_ISOLATED)
            return
        for half in np.array_split(failed, 2):
            self.ring.add_word(codes.W_RETRY_CALLS)
            try:
                self.compute(self.claimed.slots[half],
                             self.claimed.lengths[half] if self.var_top else None,
                             self.claimed.bucket)
            except Exception as e:
                self.isolate_failures(half, error_text(e))
                continue
            self._complete_part(half, codes.STATUS_OK, b"")

    def _complete_part(self, positions: np.ndarray, status: int, message: bytes) -> None:
        self.ring.complete_some(self.instance, self.claimed.slots[positions],
                                self.claimed.gens[positions], status, message)

    # -- one batch, tensor by tensor --------------------------------------------------
    def gather(self, slots: np.ndarray, rows: int):
        """(each input's batch, contiguous): views of the input rows when the
        slots are one contiguous run, else copies of them into the gather
        buffers (then, with allowed batch sizes, zero rows up to `rows`)."""
        first, n = int(slots[0]), len(slots)
        if int(slots[-1]) - first == n - 1 and rows == n:  # one run: the fast path
            run = slice(first, first + n)
            views = []  # (a loop, not a comprehension: no frame made per batch)
            for region in self.in_regions:
                views.append(region[run])
            return views, True
        return [_rows(region, buffer, slots, rows)
                for region, buffer in zip(self.in_regions, self.gather_buffers)], False

    def call_cut(self, batch: list, slots: np.ndarray, rows: int, bucket: int):
        """The backend on a batch with variable dims: each such tensor cut to
        the bucket's bound or its longest request, its real lengths (0 for
        padding rows) passed too."""
        lengths = []
        per_slot = self.seg.lengths[slots]  # (n, inputs): copied, the rows may be reused
        for t, axis, bound in self.var_inputs:
            real = _padded_lengths(per_slot[:, t], rows, bound)
            batch[t] = self._cut_batch(batch[t], axis, real, bucket, bound)
            lengths.append(real)
        return self.call_backend(batch, lengths)

    def _cut(self, bucket: int, longest: int, bound: int) -> int:
        if self.shapes is None:
            return longest
        return min(bound, self.shapes.padded_length(bucket, longest))

    def _cut_batch(self, batch: np.ndarray, var_axis: int, real: np.ndarray, bucket: int,
                   bound: int) -> np.ndarray:
        """batch cut along a request's variable dim (var_axis) to the bucket's
        bound, or the longest real length (never beyond bound)."""
        index = [slice(None)] * batch.ndim
        index[var_axis + 1] = slice(0, self._cut(bucket, int(real.max()), bound))
        return batch[tuple(index)]

    def scatter(self, slots: np.ndarray, batch: list, outputs, contiguous: bool) -> None:
        """Each answer into its request's output rows, by position (padding
        rows dropped)."""
        n = len(slots)
        if contiguous and self.in_place and outputs[0] is batch[0]:
            return  # answered in place: the rows already hold the answers
        for region, out in zip(self.out_regions, outputs):
            if len(out) > n:
                out = out[:n]
            if contiguous:
                first = int(slots[0])
                region[first:first + n] = out
            else:
                region[slots] = out


def _rows(region: np.ndarray, buffer: np.ndarray, slots: np.ndarray, rows: int) -> np.ndarray:
    """One tensor's batch copied into buffer, zero rows up to `rows`."""
    n = len(slots)
    # mode="clip": the slots are in range, and "raise" would buffer the copy (~4x slower)
    np.take(region, slots, axis=0, out=buffer[:n], mode="clip")
    buffer[n:rows] = 0
    return buffer[:rows]


def _padded_lengths(lengths: np.ndarray, rows: int, bound: int) -> np.ndarray:
    """The real lengths as int64, 0 for the padding rows up to `rows`; none
    beyond bound (each comes from the segment: a backend may index by it)."""
    real = np.zeros(rows, np.int64)
    np.minimum(lengths, bound, out=real[:len(lengths)])
    return real


def main(name: str, instance: int, backend, backend_args: dict, cpus, gpu, conn,
         epoch: int = 0) -> None:
    """Runs batcher `instance` of engine `name`; reports its readiness or its
    failure to start on conn once (engine.launch), then serves; an exception
    that ends its loop is reported on conn too, before it dies."""
    try:
        liveness.die_with_parent(launch.parent_pid())
        if gpu is not None:  # before the factory runs, as a CUDA runtime reads it once
            os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        if cpus:
            import psutil
            psutil.Process().cpu_affinity(list(cpus))
        segment = Segment.attach(name)
        fn = spec.resolve(backend)(**(backend_args or {}))
        cfg = segment.config
        if callable(getattr(fn, "check_tensors", None)):
            # the backend says, before anything is served, whether the tensors fit it
            # (the single-array form's one tensor is named "")
            fn.check_tensors({t.name: (t.dtype, t.shape) for t in cfg.input_specs},
                             {t.name: (t.dtype, t.shape) for t in cfg.output_specs})
        if cfg.iterative:
            missing = [m for m in ("join", "step", "leave") if not callable(getattr(fn, m, None))]
            if missing:
                raise TypeError(f"an iterative engine's factory returns a step model with join, "
                                f"step and leave; got {type(fn).__name__} without {missing}")
            kind = sampled_steps.SampledStepper if cfg.sampling else iterative.Stepper
            batcher = kind(segment, instance, fn, epoch)
        else:
            batcher = Batcher(segment, instance, fn, epoch)
        # before ready: a reload's switch and the engine's start wait for it
        warm_ms = (warmup.warm_steps if cfg.iterative else warmup.warm_batches)(batcher) \
            if cfg.warmup else None
        pid = os.getpid()
        segment.ring.set_word(codes.W_BATCHER_START + instance, liveness.start_ticks(pid) or 0)
        segment.ring.set_word(codes.W_BATCHER_PID + instance, pid)
        pools = threads.report(fn, pinned=bool(cpus))  # for `shmbatch status`
        if warm_ms is not None:
            pools["warmup_ms"] = warm_ms  # stats()["warmup_ms"]
    except BaseException as e:
        launch.tell_failed(conn, e)
        conn.close()
        raise SystemExit(1)
    launch.tell_ready(conn, pools)
    try:
        outcome = batcher.run()
    except BaseException as e:
        tell_death(conn, e)  # the supervisor's log names it as the cause of death
        raise
    finally:
        conn.close()
    if outcome == RETIRED:
        # nothing is left to flush or release (the supervisor reaps the pid
        # words), and the new batchers start serving once this process is
        # gone: skip the interpreter's teardown (tens of ms)
        os._exit(0)


def _entry() -> None:
    """A batcher process's start (engine.launch): main() with the supervisor's
    arguments. SIGINT is the supervisor's to act on (it drains first): a
    batcher ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    kwargs, conn = launch.child_args()
    main(conn=conn, **kwargs)
