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
import os
from typing import Any, Optional

from engine.client import waiting
from engine.client.handle import CHUNKS, Handle
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
        self._open = False
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
            raise StopIteration
        raise waiting.failed(self.seg, self.slot, self.gen, code)

    def _chunk(self, k: int) -> Any:
        return self.seg.config.answer(tuple(region[self.slot, k, ...].copy()
                                            for region in self.seg.out_regions))

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
        raise waiting.failed(self.seg, self.slot, self.gen, code)

    def _poll(self) -> bool:
        """Whether the stream has moved on since the last look (no wait)."""
        code, word = self.seg.ring.wait_chunks(self.slot, self.gen, self._word, 0)
        return code != codes.ETIMEOUT

    def _give_up(self, error) -> None:
        """Withdraws the request and raises error, unless it was answered that
        instant (then the rest of its chunks are read as usual)."""
        if waiting.give_up(self.seg, self.slot, self.gen, error) is not None:
            self._open = False
            raise error
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


class AsyncStream:
    """A Stream for asyncio: ``async for chunk in client.stream_async(x)``.
    The client's completion thread, woken by every step's end, tells it
    when its chunk word moves; the loop is never blocked, and minds the
    deadline and the engine itself."""
    kind = CHUNKS  # to the completion thread

    def __init__(self, stream: Stream, loop: asyncio.AbstractEventLoop) -> None:
        self.stream, self.loop = stream, loop
        self.seg, self.slot, self.gen = stream.seg, stream.slot, stream.gen  # its ticket
        self.moved = asyncio.Event()
        self.over = False  # read by the completion thread: drop this ticket
        self.failed = None  # the completion thread's error for it (its client closed)

    def __aiter__(self) -> "AsyncStream":
        return self

    @property
    def finish_reason(self) -> Optional[str]:
        return self.stream.finish_reason

    async def __anext__(self) -> Any:
        s = self.stream
        while True:
            try:
                item = s._next_ready()
            except StopIteration:
                self.over = True
                raise StopAsyncIteration from None
            except BaseException:
                self.over = True
                raise
            if item is not _NOT_YET:
                return item
            if self.failed is not None:
                error, self.failed = self.failed, None
                self._end(error)  # raises, unless its answer came that instant
                continue
            self.moved.clear()
            code, word = s.seg.ring.wait_chunks(s.slot, s.gen, s._word, 0)
            if code != codes.ETIMEOUT:  # moved before the clear: read it
                self._read(code, word)
                continue
            wait_ns = waiting.LIVENESS_SLICE_NS
            if s.deadline is not None:
                wait_ns = min(wait_ns, s.deadline - ring.now_ns())
            try:
                await asyncio.wait_for(self.moved.wait(), max(0, wait_ns) / 1e9)
            except asyncio.TimeoutError:
                if s.deadline is not None and ring.now_ns() >= s.deadline:
                    self._end(waiting.ticket_timed_out(s.seg, s.slot, s.gen, s.timeout,
                                                       s.deadline))
                elif not waiting.engine_lives(s.seg):
                    self._end(waiting.engine_gone(s.client.name))

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
        """Wakes the loop when the chunk word moved, or with error (its client
        closed: the loop's side withdraws the request and raises it); True once
        the stream is over for the completer, which then forgets it."""
        if self.over:
            return True
        if error is not None:
            self.failed = error
            try:
                self.loop.call_soon_threadsafe(self.moved.set)
            except RuntimeError:  # its loop is closed
                self.stream.close()
            return True
        if self.stream._poll():
            try:
                self.loop.call_soon_threadsafe(self.moved.set)
            except RuntimeError:  # its loop is closed: nobody reads this stream any more
                self.over = True
                self.stream.close()
                return True
        return False


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


class AsyncAnswered:
    """open_stream_async() of a one-shot engine: its one answer, once."""

    def __init__(self, answer) -> None:
        self.answer = answer  # the infer_async() coroutine, not yet started
        self.finish_reason: Optional[str] = None

    def __aiter__(self) -> "AsyncAnswered":
        return self

    async def __anext__(self) -> Any:
        if self.finish_reason is not None or self.answer is None:
            raise StopAsyncIteration
        answer, self.answer = self.answer, None
        value = await answer
        self.finish_reason = "stop"
        return value

    async def aclose(self) -> None:
        if self.answer is not None:
            self.answer.close()  # never started: nothing was enqueued
            self.answer = None
