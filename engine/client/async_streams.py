"""Streamed answers for asyncio: a Stream followed by an event loop.

An AsyncStream holds a Stream (engine.client.streams) and moves it only
through its step-by-step interface (next_ready, look, take_ready, final,
give_up, chunks_read, close): the loop never blocks on a wait. The client's
completion thread (engine.client.completion), woken by every step's end,
posts a wake to the stream's loop when its chunk word moved (one wake of a
loop per step for all its streams: engine.client.loops), and fails it at its
deadline or when its engine dies; to that thread an AsyncStream is a
handle.Item of kind CHUNKS. AsyncAnswered is open_stream_async() of a
one-shot engine, its one answer handed out the same way.
"""
import asyncio
from typing import Any, Callable, Optional

from engine.client import loops
from engine.client.handle import CHUNKS
from engine.client.streams import NOT_YET, Stream
from engine.errors import EngineError
from engine.shm import codes


class Waits:
    """One future per wait, set by wake() (on the loop's thread). A subclass
    says when nothing more will wake it (final)."""

    loop: asyncio.AbstractEventLoop
    _waiter: Optional[asyncio.Future] = None
    _moved = False  # woken while no wait was pending (or after it was ended)
    # called at each wake instead, while set (on the loop's thread): a writer
    # that takes the chunks in the wake itself, with no coroutine resumed
    on_wake: Optional[Callable[[], None]] = None

    async def wait(self) -> None:
        """Until the stream may have moved: a wake since the last wait counts,
        even one that came after the wait was ended but before it resumed (two
        wakes of one pass: a chunk, then its deadline's error); a stream that
        is final never waits, as nothing would wake it."""
        if self._moved or self.final:
            self._moved = False
            return
        self._waiter = waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        """Ends the pending wait() (or the next one) at once; on the loop's thread."""
        if self.on_wake is not None:
            return self.on_wake()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        else:
            self._moved = True

    @property
    def final(self) -> bool:
        raise NotImplementedError


class AsyncStream(Waits):
    """A Stream for asyncio: ``async for chunk in client.stream_async(x)``.

    It waits on one future per wake, with no task or timer. Besides
    iteration, a writer that sends what came at once takes the chunks in
    blocks:

        while True:
            got = chunks.ready()    # every chunk come since, stacked (None:
            if got is not None: ... # none); at the end StopAsyncIteration,
            else: await chunks.wait()   # or the request's error

    and wake() ends a wait early (its caller went away, say)."""
    kind = CHUNKS  # to the completion thread

    def __init__(self, stream: Stream, loop: asyncio.AbstractEventLoop, inbox: Any = None) -> None:
        self.stream, self.loop = stream, loop
        self.seg, self.slot, self.gen = stream.seg, stream.slot, stream.gen  # its ticket
        self.deadline, self.timeout = stream.deadline, stream.timeout
        # how a wake reaches the loop: its Inbox from the completion thread, or
        # wakes.DIRECT from the loop's own Waker
        self.inbox = inbox or loops.inbox(loop)
        self.seen = 0  # the chunk word as the completion thread last saw it (its own)
        self.over = False  # read by the completion thread: drop this ticket
        self.failed: Optional[EngineError] = None  # the completion thread's error for it

    def __aiter__(self) -> "AsyncStream":
        return self

    @property
    def finish_reason(self) -> Optional[str]:
        return self.stream.finish_reason

    @property
    def chunks_read(self) -> int:
        """How many chunks were handed out."""
        return self.stream.chunks_read

    @property
    def prompt_logprobs(self) -> Optional[list]:
        """The prompt's logprobs (Stream.prompt_logprobs), before the first chunk."""
        return self.stream.prompt_logprobs

    async def __anext__(self) -> Any:
        while True:
            item = self._step(self.stream.next_ready, False)
            if item is not NOT_YET:
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
            self._step(s.look)
            got = s.take_ready()
            if got is not None:
                return got
            self._step(s.next_ready, False)  # no chunk left: NOT_YET, or the end
            if self.failed is None:
                return None
            self._look()  # the error: raised, unless answered that instant

    @property
    def final(self) -> bool:
        """Whether nothing more will wake the stream: its slot settled, it was
        closed, or the completion thread failed it (its error, after the
        chunks that came before it, is what ready() hands out next)."""
        return self.failed is not None or self.stream.final

    def _look(self) -> bool:
        """Whether the stream moved since the last read (then read): an error
        from the completion thread is raised, unless the answer came that
        instant."""
        if self.failed is not None:
            error, self.failed = self.failed, None
            self._step(self.stream.give_up, error)
            return True
        return self._step(self.stream.look)

    def _step(self, step: Callable[..., Any], *args: Any) -> Any:
        """step(*args) of the stream; the stream is over for the completion
        thread once a step ends it (StopAsyncIteration) or raises its error."""
        try:
            return step(*args)
        except StopIteration:
            self.over = True
            raise StopAsyncIteration from None
        except BaseException:
            self.over = True
            raise

    def close(self) -> None:
        """Withdraws the request unless its answer has ended: aclose(), from
        code that cannot await (a wake's callback)."""
        self.over = True
        self.stream.close()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.over = True

    # -- the completion thread's side (completion.Completer) ------------------------
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
        # the slot settled (the same word) or no longer ours; a final count alone
        # is not the end: its loop then waits for the settle, which this wakes
        final = code != codes.OK or word == self.seen
        self.seen = word
        if not self.inbox.post(AsyncStream.wake, self):  # nobody reads this stream any more
            self.over = True
            self.stream.close()
            return True
        return final


class AsyncAnswered(Waits):
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

    @property
    def final(self) -> bool:
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
