"""Streamed answers: one request's chunks as its batcher writes them.

An iterative engine's batcher writes one chunk of every output per step
into the request's own slot (row k of its outputs is chunk k) and then
publishes how many it has written in the slot's chunk word, which the
client follows: it sleeps on that word (one wake per step at most, none
while it spins) and copies each chunk out once. When the request ends --
done, at its max_steps, failed or expired -- the batcher marks the count
final and settles the slot; the stream then ends, or raises the request's
error after the chunks that came before it.

Leaving a stream before its end (break, close(), or dropping it) withdraws
the request: its batcher sees the slot abandoned at its next step, calls
the model's leave and frees the slot.

A stream sees its client as a handle.Handle; an AsyncStream is, to the
client's completion thread, a handle.Item of kind CHUNKS.
"""
import asyncio
import concurrent.futures
import os
import sys
from typing import Any, Callable, Optional

from engine.client import loops, tracing, waiting
from engine.client.handle import CHUNKS, Handle
from engine.client.tracing import TRACE_MODULE
from engine.errors import EngineError
from engine.shm import codes, ring

COUNT_MASK = codes.CHUNKS_COUNT
FINISH_REASONS = ((codes.CHUNKS_STOP, "stop"), (codes.CHUNKS_LIMIT, "length"))
_NOT_YET = object()  # no chunk to hand out yet: wait for the next


class Stream:
    """The chunks of one request's answer, in step order, each a new array
    (or a dict of them with named outputs). Iterate it; close() withdraws
    the request if it has not ended."""

    def __init__(self, client: Handle, seg, slot: int, gen: int, deadline: Optional[int],
                 timeout: Optional[float]) -> None:
        self.client, self.seg, self.slot, self.gen = client, seg, slot, gen
        self.deadline, self.timeout = deadline, timeout
        self._word = 0        # the slot's chunk word as last read
        self._sent = 0        # chunks handed out
        self._settled = False  # the slot is answered or failed: its count is final
        self._open = True     # the slot is still this stream's to release
        self._pid = os.getpid()
        # the caller's context, for the request's span (engine.client.tracing)
        self._began = tracing.begin() if TRACE_MODULE in sys.modules else None

    def __iter__(self) -> "Stream":
        return self

    @property
    def finish_reason(self) -> Optional[str]:
        """Once the last chunk of a completed answer is handed out: "stop" (its
        model said done) or "length" (it reached its max_steps); else None. Its
        batcher publishes the last count with the reason, so this is known as
        the last chunk is read, not after."""
        word = self._word
        if not word & codes.CHUNKS_END or self._sent != word & COUNT_MASK:
            return None
        return next((reason for bit, reason in FINISH_REASONS if word & bit), None)

    def __next__(self) -> Any:
        while True:
            item = self._next_ready()
            if item is not _NOT_YET:
                return item
            self._await_chunk()

    def close(self) -> None:
        """Withdraws the request unless its answer has ended (idempotent)."""
        if not self._open:
            return
        self._ended(concurrent.futures.CancelledError())
        waiting.withdraw(self.seg, self.slot, self.gen)  # settled meanwhile: freed

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self):
        # only in the process that sent it: a forked child's copy is not the owner
        try:
            if self._open and os.getpid() == self._pid and not self.seg.closed:
                self.close()
        except Exception:  # at interpreter exit, modules may be gone already
            pass

    # -- one step of the iteration, shared with AsyncStream ---------------------------
    def _next_ready(self) -> Any:
        """The next chunk if one is written; else _NOT_YET, or at the end
        StopIteration (answered) or the request's error."""
        if not self._open:
            raise StopIteration
        count = self._word & COUNT_MASK
        if self._sent < count:
            self._sent += 1
            return self._chunk(self._sent - 1)
        if not (self._word & codes.CHUNKS_END or self._settled):
            return _NOT_YET
        code = self.seg.ring.wait_slot(self.slot, self.gen, 0, 0)
        if code == codes.ETIMEOUT:  # the count is final, the slot settles an instant later
            code = self._await_settled()
        self._open = False
        if code == codes.OK:
            self.seg.ring.release_slot(self.slot, self.gen)
            self._ended(None)
            raise StopIteration
        raise self._ended(waiting.failed(self.seg, self.slot, self.gen, code))

    def _ended(self, error: Optional[BaseException]) -> Any:
        """The stream is over (answered, failed, or withdrawn: error), no
        longer open; its span recorded. Returns error."""
        self._open = False
        if self._began is not None:
            tracing.record(self._began, self.seg.name, None, error)
        return error

    def _chunk(self, k: int) -> Any:
        return self.seg.config.answer(tuple(region[self.slot, k, ...].copy()
                                            for region in self.seg.out_regions))

    def _chunks(self, first: int, end: int) -> Any:
        """Chunks first..end-1, stacked (each output (end - first, *chunk_shape))."""
        regions = self.seg.out_regions
        if len(regions) == 1:
            return self.seg.config.answer((regions[0][self.slot, first:end].copy(),))
        return self.seg.config.answer(tuple(region[self.slot, first:end].copy()
                                            for region in regions))

    def _read_word(self, code: int, word: int) -> None:
        """A wait_chunks outcome: the new word, or the slot settled (the word
        unchanged); EngineCorrupt and the like end the stream."""
        if code == codes.OK:
            if word == self._word or (word & COUNT_MASK) < (self._word & COUNT_MASK):
                self._settled = True  # no new chunk (a count never shrinks): settled
            if (word & COUNT_MASK) >= (self._word & COUNT_MASK):
                self._word = word
            return
        self._open = False
        raise self._ended(waiting.failed(self.seg, self.slot, self.gen, code))

    def _give_up(self, error) -> None:
        """Withdraws the request and raises error, unless it was answered that
        instant (then the rest of its chunks are read as usual)."""
        if waiting.give_up(self.seg, self.slot, self.gen, error) is not None:
            raise self._ended(error)
        self._settled = True
        code, word = self.seg.ring.wait_chunks(self.slot, self.gen, self._word, 0)
        self._read_word(code, word)

    # -- blocking waits ------------------------------------------------------------
    def _await_chunk(self) -> None:
        client, seg = self.client, self.seg
        r = seg.ring

        def wait_slice(slice_ns: int) -> int:
            started_ns = ring.now_ns()
            code, word = r.wait_chunks(self.slot, self.gen, self._word, slice_ns,
                                       client.spin_ns)
            # spin next time only if this chunk came within the spin (as Client._wait_slice)
            client.spin_ns = ring.SPIN_NS if ring.now_ns() - started_ns <= ring.SPIN_NS else 0
            if code != codes.ETIMEOUT:
                self._read_word(code, word)
            return code

        why, _ = waiting.wait(wait_slice, lambda: waiting.engine_lives(seg), self.deadline)
        if why != waiting.ANSWERED:
            self._give_up(waiting.ticket_timed_out(seg, self.slot, self.gen, self.timeout,
                                                   self.deadline) if why == waiting.EXPIRED
                          else waiting.engine_gone(client.name))

    def _await_settled(self) -> int:
        r = self.seg.ring
        why, code = waiting.wait(lambda ns: r.wait_slot(self.slot, self.gen, ns, 0),
                                 lambda: waiting.engine_lives(self.seg), None)
        return code if why == waiting.ANSWERED else codes.ESTALE


class _Waits:
    """One future per wait, set by wake() (on the loop's thread)."""

    loop: asyncio.AbstractEventLoop
    _waiter: Optional[asyncio.Future] = None
    _moved = False  # woken while no wait was pending
    # called at each wake instead, while set (on the loop's thread): a writer
    # that takes the chunks in the wake itself, with no coroutine resumed
    on_wake: Optional[Callable[[], None]] = None

    async def wait(self) -> None:
        """Until the stream may have moved (a wake since the last wait counts;
        a stream whose end is known never waits: nothing would wake it)."""
        if self._moved or self._final():
            self._moved = False
            return
        self._waiter = waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter, self._moved = None, False

    def wake(self) -> None:
        """Ends the pending wait() (or the next one) at once; on the loop's thread."""
        if self.on_wake is not None:
            return self.on_wake()
        self._moved = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _final(self) -> bool:
        raise NotImplementedError


class AsyncStream(_Waits):
    """A Stream for asyncio: ``async for chunk in client.stream_async(x)``.

    The client's completion thread, woken by every step's end, posts a wake
    to the stream's event loop when its chunk word moved (one wake of the
    loop per step for all its streams: engine.client.loops), and fails it at
    its deadline or when the engine dies; the loop is never blocked, and
    waits on one future per wake, with no task or timer. Besides iteration,
    a writer that sends what came at once takes the chunks in blocks:

        while True:
            got = chunks.ready()    # every chunk come since, stacked (None:
            if got is not None: ... # none); at the end StopAsyncIteration,
            else: await chunks.wait()   # or the request's error

    and wake() ends a wait early (its caller went away, say)."""
    kind = CHUNKS  # to the completion thread

    def __init__(self, stream: Stream, loop: asyncio.AbstractEventLoop) -> None:
        self.stream, self.loop = stream, loop
        self.seg, self.slot, self.gen = stream.seg, stream.slot, stream.gen  # its ticket
        self.deadline, self.timeout = stream.deadline, stream.timeout
        self.inbox = loops.inbox(loop)
        self.seen = 0  # the chunk word as the completion thread last saw it (its own)
        self.over = False  # read by the completion thread: drop this ticket
        self.failed = None  # the completion thread's error for it (a timeout, say)

    def __aiter__(self) -> "AsyncStream":
        return self

    @property
    def finish_reason(self) -> Optional[str]:
        return self.stream.finish_reason

    @property
    def chunks_read(self) -> int:
        """How many chunks were handed out."""
        return self.stream._sent

    def _next_ready(self) -> Any:
        """The stream's next chunk, or _NOT_YET; the stream is over once this
        ends it (StopAsyncIteration) or raises its error."""
        try:
            return self.stream._next_ready()
        except StopIteration:
            self.over = True
            raise StopAsyncIteration from None
        except BaseException:
            self.over = True
            raise

    async def __anext__(self) -> Any:
        while True:
            item = self._next_ready()
            if item is not _NOT_YET:
                return item
            if not self._look():
                await self.wait()

    def ready(self) -> Any:
        """Every chunk written since the last call, without waiting, stacked
        as a whole answer is (each output (n, *chunk_shape)); None while none
        came. StopAsyncIteration once the answer ended and was handed out;
        the request's error after its chunks."""
        s = self.stream
        while True:
            if s._open:
                code, word = s.seg.ring.wait_chunks(s.slot, s.gen, s._word, 0)
                if code != codes.ETIMEOUT:
                    self._read(code, word)
            count = s._word & COUNT_MASK
            if s._sent < count and s._open:
                got = s._chunks(s._sent, count)
                s._sent = count
                return got
            self._next_ready()  # no chunk left: _NOT_YET, or the end
            if self.failed is None:
                return None
            self._look()  # the error: raised, unless answered that instant

    def _final(self) -> bool:
        s = self.stream
        return bool(s._word & codes.CHUNKS_END) or s._settled or not s._open

    def _look(self) -> bool:
        """Whether the stream moved since the last read (then read): an error
        from the completion thread is raised, unless the answer came that
        instant."""
        if self.failed is not None:
            error, self.failed = self.failed, None
            self._end(error)
            return True
        s = self.stream
        code, word = s.seg.ring.wait_chunks(s.slot, s.gen, s._word, 0)
        if code == codes.ETIMEOUT:
            return False
        self._read(code, word)
        return True

    def _read(self, code: int, word: int) -> None:
        try:
            self.stream._read_word(code, word)
        except BaseException:
            self.over = True
            raise

    def _end(self, error) -> None:
        try:
            self.stream._give_up(error)
        except BaseException:
            self.over = True
            raise

    async def aclose(self) -> None:
        self.over = True
        self.stream.close()

    def __del__(self):
        self.over = True

    # -- the completion thread's side (futures.Completer) --------------------------
    def try_settle(self, error: Optional[EngineError] = None) -> bool:
        """Wakes the loop when the chunk word moved, or with error (its deadline,
        the engine gone, its client closed: the loop's side withdraws the
        request and raises it); True once the stream is over for the
        completer, which then forgets it."""
        if self.over:
            return True
        if error is not None:
            self.failed = error
            if not self.inbox.post(AsyncStream.wake, self):  # its loop is closed
                self.stream.close()
            return True
        code, word = self.seg.ring.wait_chunks(self.slot, self.gen, self.seen, 0)
        if code == codes.ETIMEOUT:
            return False
        # the word final, or the slot settled (the same word), or no longer ours
        final = code != codes.OK or word == self.seen or bool(word & codes.CHUNKS_END)
        self.seen = word
        if not self.inbox.post(AsyncStream.wake, self):  # nobody reads this stream any more
            self.over = True
            self.stream.close()
            return True
        return final


class Answered:
    """stream() of a one-shot engine: its one answer, once."""

    def __init__(self, future):
        self.future = future
        self.done = False

    def __iter__(self) -> "Answered":
        return self

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        self.done = True
        return self.future.result()

    def close(self) -> None:
        if not self.done:
            self.done = True
            self.future.cancel()

    def __enter__(self) -> "Answered":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncAnswered(_Waits):
    """open_stream_async() of a one-shot engine: its one answer, once, as
    AsyncStream hands out chunks (iterated, or ready() and wait())."""

    def __init__(self, answer) -> None:
        self.answer = answer  # the infer_async() coroutine, not yet started
        self.loop = asyncio.get_running_loop()
        self.finish_reason: Optional[str] = None
        self._task: Optional[asyncio.Future] = None
        self._over = False

    def __aiter__(self) -> "AsyncAnswered":
        return self

    async def __anext__(self) -> Any:
        if self.answer is not None:  # as ready() would, without a task
            answer, self.answer, self._over = self.answer, None, True
            value = await answer
            self.finish_reason = "stop"
            return value
        while True:  # ready() began: its task holds the answer
            got = self.ready()
            if got is not None:
                return {k: v[0] for k, v in got.items()} if isinstance(got, dict) else got[0]
            await self.wait()

    def _final(self) -> bool:
        return self._over or (self._task is not None and self._task.done())

    def ready(self) -> Any:
        """The answer once it came, stacked as AsyncStream.ready() stacks
        chunks (each output (1, *shape)); None before."""
        if self._over:
            raise StopAsyncIteration
        if self._task is None:
            self._task = asyncio.ensure_future(self.answer)
            self.answer = None
            self._task.add_done_callback(lambda _: self.wake())
        if not self._task.done():
            return None
        self._over = True
        value = self._task.result()  # or its error
        self.finish_reason = "stop"
        return {k: v[None] for k, v in value.items()} if isinstance(value, dict) else value[None]

    async def aclose(self) -> None:
        self._over = True
        if self.answer is not None:
            self.answer.close()  # never started: nothing was enqueued
            self.answer = None
        elif self._task is not None:
            if not self._task.done():
                self._task.cancel()  # withdraws its request
            elif not self._task.cancelled():
                self._task.exception()  # seen: not logged as never retrieved
