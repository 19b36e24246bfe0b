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

A stream sees its client as a handle.Handle. Its step-by-step interface
(next_ready, look, take_ready, final, give_up, chunks_read) is what an
AsyncStream (engine.client.async_streams) follows it by: one step of the
iteration, never a wait.
"""
import concurrent.futures
import os
import sys
from typing import Any, Optional

from engine.client import sampled, ticket, tracing
from engine.client.handle import Handle
from engine.client.tracing import TRACE_MODULE
from engine.errors import EngineError
from engine.shm import codes, ring

COUNT_MASK = codes.CHUNKS_COUNT
FINISH_REASONS = ((codes.CHUNKS_STOP, "stop"), (codes.CHUNKS_LIMIT, "length"))
NOT_YET = object()  # next_ready(): no chunk to hand out yet, wait for the next


class Stream:
    """The chunks of one request's answer, in step order, each a new array
    (or a dict of them with named outputs). Iterate it; close() withdraws
    the request if it has not ended."""

    def __init__(self, client: Handle, seg, slot: int, gen: int, deadline: Optional[int],
                 timeout: Optional[float], logprobs: Optional[int] = None,
                 prompt: Optional[tuple] = None) -> None:
        self.client, self.seg, self.slot, self.gen = client, seg, slot, gen
        self.logprobs = logprobs  # a sampling engine's: each chunk's cut (engine.client.sampled)
        self._prompt = prompt  # (k, length) of a request that asked its prompt's logprobs
        # its prompt's logprobs (sampled.prompt_entries), set before its first chunk is handed out
        self.prompt_logprobs: Optional[list] = None
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

    @property
    def chunks_read(self) -> int:
        """How many chunks were handed out."""
        return self._sent

    def __next__(self) -> Any:
        while True:
            item = self.next_ready()
            if item is not NOT_YET:
                return item
            self._await_chunk()

    def close(self) -> None:
        """Withdraws the request unless its answer has ended (idempotent)."""
        if not self._open:
            return
        self._ended(concurrent.futures.CancelledError(), self._stamps())
        ticket.withdraw(self.seg, self.slot, self.gen)  # settled meanwhile: freed

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

    # -- one step of the iteration, without a wait (AsyncStream's interface) ----------
    def next_ready(self, block: bool = True) -> Any:
        """The next chunk if one is written; else NOT_YET, or at the end
        StopIteration (answered) or the request's error. A final count
        whose slot is not settled yet is waited for (its batcher settles it
        after the rest of its step), unless block is False (an event loop's:
        NOT_YET, and the settle wakes the loop)."""
        if not self._open:
            raise StopIteration
        count = self._word & COUNT_MASK
        if self._sent < count:
            if self._prompt is not None:
                self._read_prompt()
            self._sent += 1
            return self._chunk(self._sent - 1)
        if not (self._word & codes.CHUNKS_END or self._settled):
            return NOT_YET
        code = self.seg.ring.wait_slot(self.slot, self.gen, 0, 0)
        if code == codes.ETIMEOUT:  # the count is final, the slot settles soon
            if not block:
                return NOT_YET
            code = self._await_settled()
        self._open = False
        stamps = self._stamps()  # settled: read before the slot is freed
        if code == codes.OK:
            self.seg.ring.release_slot(self.slot, self.gen)
            self._ended(None, stamps)
            raise StopIteration
        raise self._ended(ticket.failed(self.seg, self.slot, self.gen, code), stamps)

    def take_ready(self) -> Any:
        """Every chunk written and not yet handed out, stacked as a whole
        answer is (each output (n, *chunk_shape)); None while none is."""
        count = self._word & COUNT_MASK
        if not self._open or self._sent >= count:
            return None
        if self._prompt is not None:
            self._read_prompt()
        got = self._chunks(self._sent, count)
        self._sent = count
        return got

    def look(self) -> bool:
        """Reads the slot's chunk word without waiting; whether it moved (a
        chunk came, the count became final, or the slot settled). Errors
        (EngineCorrupt and the like) end the stream."""
        if not self._open:
            return False
        code, word = self.seg.ring.wait_chunks(self.slot, self.gen, self._word, 0)
        if code == codes.ETIMEOUT:
            return False
        self._read_word(code, word)
        return True

    @property
    def final(self) -> bool:
        """Whether nothing is still to come: its slot seen settled, or the
        stream closed (a final count alone: its settle is still to come)."""
        return self._settled or not self._open

    def give_up(self, error: EngineError) -> None:
        """Withdraws the request and raises error, unless it was answered that
        instant (then the rest of its chunks are read as usual)."""
        stamps = self._stamps()  # while the slot is still ours
        if ticket.give_up(self.seg, self.slot, self.gen, error) is not None:
            raise self._ended(error, stamps)
        self._settled = True
        code, word = self.seg.ring.wait_chunks(self.slot, self.gen, self._word, 0)
        self._read_word(code, word)

    def _ended(self, error: Optional[BaseException], stamps: Optional[tuple] = None) -> Any:
        """The stream is over (answered, failed, or withdrawn: error), no
        longer open; its span recorded, with the engine's stamps if read.
        Returns error."""
        self._open = False
        if self._began is not None:
            tracing.record(self._began, self.seg.name, stamps, error)
        return error

    def _stamps(self) -> Optional[tuple]:
        """The engine's stamps of the request, for its span (traced only):
        read while the slot is ours, settled or not (ring.slot_times)."""
        return None if self._began is None else self.seg.ring.slot_times(self.slot, self.gen)

    def _read_prompt(self) -> None:
        """The prompt's logprobs, once: the batcher wrote them at join, before
        it published the first chunk, which this stream has seen."""
        if self._prompt is not None:
            self.prompt_logprobs = sampled.prompt_entries(self.seg, self.slot, self._prompt)
        self._prompt = None

    def _chunk(self, k: int) -> Any:
        if self.logprobs == 0:  # a sampling engine's request without logprobs: the token
            return self.seg.out_regions[0][self.slot, k, ...].copy()
        return sampled.cut(self.seg.config.answer(tuple(region[self.slot, k, ...].copy()
                                                        for region in self.seg.out_regions)),
                           self.logprobs)

    def _chunks(self, first: int, end: int) -> Any:
        """Chunks first..end-1, stacked (each output (end - first, *chunk_shape))."""
        regions = self.seg.out_regions
        if len(regions) == 1:
            return self.seg.config.answer((regions[0][self.slot, first:end].copy(),))
        return sampled.cut(self.seg.config.answer(tuple(region[self.slot, first:end].copy()
                                                        for region in regions)), self.logprobs)

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
        raise self._ended(ticket.failed(self.seg, self.slot, self.gen, code))

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

        why, _ = ticket.wait(wait_slice, lambda: ticket.engine_lives(seg), self.deadline)
        if why != ticket.ANSWERED:
            self.give_up(ticket.expired(seg, self.slot, self.gen, self.timeout, self.deadline)
                         if why == ticket.EXPIRED else ticket.engine_gone(client.name))

    def _await_settled(self) -> int:
        r = self.seg.ring
        why, code = ticket.wait(lambda ns: r.wait_slot(self.slot, self.gen, ns, 0),
                                lambda: ticket.engine_lives(self.seg), None)
        return code if why == ticket.ANSWERED else codes.ESTALE


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
