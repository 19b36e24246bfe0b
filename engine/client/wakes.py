"""One wake per answer for asyncio: the engine wakes the awaiting event loop itself.

Each event loop of a process that awaits requests binds a datagram socket at
the abstract address "\\0shmbatch-wake-%08x" of its wake id (the pid, and the
loop's number in the process above bit 22) and watches it with add_reader.
An awaited ticket's slot carries (generation, id) (ring.await_slot); whoever
settles the slot or puts a stream's chunks sends one byte there, once a call
and id, never blocking (csrc/wait.c). On a byte the loop drains the socket
and settles its own pending requests, and wakes its streams that moved: no
thread is on the path. A timer, while any is pending, fails what passed its
deadline, and every ticket.LIVENESS_SLICE_NS what an engine that died left.

Items are the completion thread's (handle.Item: ticket.Awaited and
async_streams.AsyncStream), with DIRECT as their inbox: on the loop already,
an answer is handed over at once.

Where the engine cannot reach the loop -- another network namespace (the
engine's W_NETNS word is not ours), the name taken, more than MAX_LOOPS loops
-- the completion thread serves it as before (for_loop() returns None). A
forked child makes its own sockets: its pid is its own.
"""
import asyncio
import collections
import logging
import os
import socket
from typing import Any, Dict, Optional

import numpy as np

from engine.client import async_streams, looks, ticket
from engine.client.handle import CHUNKS, Handle, Item, deadline_of, overdue
from engine.errors import EngineError, EngineUnavailable
from engine.shm import codes, liveness, ring

log = logging.getLogger("shmbatch")

PID_BITS = 22  # a pid is below 2^22 (pid_max's limit): the loop's number above it
MAX_LOOPS = 1 << (32 - PID_BITS)
DRAIN_MAX = 64  # datagrams read a wake at most: the rest wake it again


def address(waker_id: int) -> str:
    return "\0shmbatch-wake-%08x" % waker_id


class _Direct:
    """An inbox for items settled on their own loop: post runs at once."""

    @staticmethod
    def post(fn, arg) -> bool:
        fn(arg)
        return True


DIRECT = _Direct()


class Waker:
    """One event loop's socket and pending items (a handle.Completion)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, waker_id: int, sock: socket.socket):
        self.loop, self.id, self.sock = loop, waker_id, sock
        self.pending: Dict[int, Item] = {}
        self.owners: Dict[int, Handle] = {}  # key -> the client that sent it
        self.next_key = 0
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_ns = 0  # when the timer fires (ring.now_ns() clock)
        self._checked_ns = ring.now_ns()
        self._lives: Dict[int, bool] = {}  # this pass's probes: id(segment) -> lives
        self.answered_ns = 0  # when answer_of last handed out an answer (ring.now_ns())
        loop.add_reader(sock.fileno(), self._readable)

    def add(self, item: Item, owner: Handle) -> None:
        """Watches item, owner's; settles it at once if it moved before its
        slot said which loop awaits it."""
        key, self.next_key = self.next_key, self.next_key + 1
        self.pending[key] = item
        self.owners[key] = owner
        code = item.seg.ring.await_slot(item.slot, item.gen, self.id)
        if code != codes.ETIMEOUT or item.kind == CHUNKS:
            self._settled(key, item, code if item.kind != CHUNKS else None, ring.now_ns())
        deadline = deadline_of(item)
        due = ring.now_ns() + ticket.LIVENESS_SLICE_NS
        if deadline is not None and deadline < due:
            due = deadline
        if self._timer is None or due < self._timer_ns:
            self._arm(due)

    def close(self) -> None:
        """Fails what is pending (its loop is gone) and closes the socket."""
        gone = EngineUnavailable("the event loop awaiting the request was closed")
        for item in list(self.pending.values()):
            try:
                item.try_settle(gone)
            except Exception:  # a closed loop's futures refuse their outcome
                ticket.withdraw(item.seg, item.slot, item.gen)
        self.pending.clear()
        self.owners.clear()
        self.sock.close()

    def fail_client(self, client: Handle) -> None:
        """Fails what client sent (it was closed); on the loop."""
        gone = ticket.client_closed(client.name)
        for key in [k for k, owner in self.owners.items() if owner is client]:
            self._settled(key, self.pending[key], None, ring.now_ns(), gone)

    # -- on the loop ------------------------------------------------------------------
    def _readable(self) -> None:
        for _ in range(DRAIN_MAX):
            try:
                self.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                break
        self._pass()

    def _tick(self) -> None:
        self._timer = None
        self._pass()
        if self.pending:
            due = ring.now_ns() + ticket.LIVENESS_SLICE_NS
            for item in self.pending.values():
                deadline = deadline_of(item)
                if deadline is not None and deadline < due:
                    due = deadline
            self._arm(due)

    def _arm(self, due_ns: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_ns = due_ns
        self._timer = self.loop.call_later(max(0, due_ns - ring.now_ns()) / 1e9, self._tick)

    def _pass(self) -> None:
        """Settles every pending request that is over, wakes the streams that
        moved, fails what passed its deadline or lost its engine."""
        if not self.pending:
            return
        now = ring.now_ns()
        self._lives = {}
        if now - self._checked_ns >= ticket.LIVENESS_SLICE_NS:
            self._checked_ns = now
            self._lives = {id(t.seg): ticket.engine_lives(t.seg) for t in self.pending.values()}
        answers: Dict[int, list] = collections.defaultdict(list)
        streams: Dict[int, list] = collections.defaultdict(list)
        for key, t in list(self.pending.items()):
            (streams if t.kind == CHUNKS else answers)[id(t.seg)].append((key, t))
        for group in streams.values():
            self._streams_pass(group, now)
        for group in answers.values():
            r = group[0][1].seg.ring
            slots = np.fromiter((t.slot for _, t in group), np.uint32, len(group))
            gens = np.fromiter((t.gen for _, t in group), np.uint32, len(group))
            outcomes = np.empty(len(group), np.int32)
            r.poll(slots, gens, outcomes)
            for (key, t), code in zip(group, outcomes.tolist()):
                self._settled(key, t, code, now)

    def _streams_pass(self, group: list, now: int) -> None:
        """The (key, stream) of one engine: those whose chunk word moved (one
        C pass over all, as a batch's streams wait beside the queued ones),
        ended, or are due are settled; the rest are left as they are."""
        seg = group[0][1].seg
        n = len(group)
        slots = np.fromiter((t.slot for _, t in group), np.uint32, n)
        gens = np.fromiter((t.gen for _, t in group), np.uint32, n)
        seen = np.fromiter((t.seen for _, t in group), np.uint32, n)
        moved = np.empty(n, np.uint8)
        seg.ring.poll_chunks(slots, gens, seen, moved)
        lives = self._lives.get(id(seg), True)
        for (key, t), m in zip(group, moved.tolist()):
            if m or t.over or not lives or overdue(t, now):
                self._settled(key, t, None, now)

    def _settled(self, key: int, t: Item, code: Optional[int], now: int,
                 error: Optional[EngineError] = None) -> None:
        """Settles t if it is over (forgotten then), or with error. code:
        its slot's (an answer), None for a stream (it looks itself)."""
        try:
            if error is not None:
                over = t.try_settle(error)
            elif code is None:
                over = t.try_settle() or self._expired(t, now)
            elif code != codes.EBUSY and code != codes.ETIMEOUT:
                over = t.try_settle()  # answered, failed, or no longer its own
            else:
                over = self._expired(t, now)
        except Exception as e:  # this request's fault: the others are still settled
            log.error("a request's completion raised %s: %s; dropped", type(e).__name__, e)
            ticket.give_up(t.seg, t.slot, t.gen, EngineError(f"{type(e).__name__}: {e}"))
            over = True
        if over:
            self.pending.pop(key, None)
            self.owners.pop(key, None)

    def _expired(self, t: Item, now: int) -> bool:
        if overdue(t, now):
            return t.try_settle(ticket.expired(t.seg, t.slot, t.gen, t.timeout, t.deadline))
        lives = self._lives.get(id(t.seg), True)
        return not lives and t.try_settle(ticket.engine_gone(t.seg.name))


# a Waker holds its loop: a closed loop leaves here when for_loop next runs
_wakers: Dict[Any, Waker] = {}
_next_number = 0  # where the search for a free loop number starts
_netns: Optional[int] = None  # None: not read yet; 0: unknown (no wakes then)


def for_loop(seg) -> Optional[Waker]:
    """The running loop's Waker for requests to seg (made at its first use),
    or None where seg's engine cannot reach it: the completion thread's then."""
    global _netns, _next_number
    if _netns is None:
        _netns = liveness.netns()
    if not _netns or seg.ring.word(codes.W_NETNS) != _netns:
        return None
    loop = asyncio.get_running_loop()
    waker = _wakers.get(loop)
    if waker is not None:
        return waker
    for old_loop, old in list(_wakers.items()):  # a closed loop's requests go back now
        if old_loop.is_closed():
            del _wakers[old_loop]
            old.close()
    for tried in range(MAX_LOOPS):  # the numbers of closed loops are free again
        number = (_next_number + tried) % MAX_LOOPS
        waker_id = os.getpid() | number << PID_BITS
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(address(waker_id))
        except OSError:  # taken (another pid namespace): the next number
            sock.close()
            continue
        sock.setblocking(False)
        _next_number = number + 1
        waker = _wakers[loop] = Waker(loop, waker_id, sock)
        return waker
    return None


class _Sender:
    """A Waker as ticket.answer_of's completer, for one client's request."""
    __slots__ = ("waker", "client")

    def __init__(self, waker: Waker, client: Handle) -> None:
        self.waker, self.client = waker, client

    def add(self, item: Item) -> None:
        self.waker.add(item, self.client)


def close_client(client: Handle) -> None:
    """Fails, on their loops, the requests and streams client has pending."""
    for loop, waker in list(_wakers.items()):
        if waker.owners and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(waker.fail_client, client)
            except RuntimeError:  # closed meanwhile
                pass


async def answer_of(client: Handle, seg, slot: int, gen: int, deadline: Optional[int],
                    timeout: Optional[float]) -> Any:
    """ticket.answer_of through the loop's Waker (or the completion thread),
    after looks.answered's look. It spins no longer than that look (a lone
    caller's, looks.ASYNC_LONE_SPIN_NS), as infer() may: the loop's other
    work (its connections) may be ready, and on a busy machine a spinner
    takes the core its batcher needs (bench/RESULTS.md, async_wake.py)."""
    # the common case, while answers come soon, on a loop that has its Waker
    # (its first request made it, and handed closed loops' requests back): the
    # answer there at a look
    waker = _wakers.get(asyncio.get_running_loop())
    if waker is not None and seg.fused_out:
        lone = looks.alone(client, seg, bool(waker.pending), waker.answered_ns)
        if lone or client.async_spin_ns:
            answer = looks.answered(client, seg, slot, gen, lone)
            if answer is not looks.NOT_YET:
                waker.answered_ns = ring.now_ns()
                return answer
    missed_ns = ring.now_ns()
    waker = for_loop(seg)
    if waker is None:
        answer = await ticket.answer_of(client.completer(), seg, slot, gen, deadline, timeout)
    else:
        answer = await ticket.answer_of(_Sender(waker, client), seg, slot, gen, deadline,
                                        timeout, DIRECT)
    now_ns = ring.now_ns()
    if now_ns - missed_ns <= looks.ASYNC_SOON_NS:  # a longer look would have had it
        client.async_spin_ns = looks.ASYNC_SPIN_NS
    if waker is not None:
        waker.answered_ns = now_ns
    return answer


def follow(client: Handle, stream) -> "async_streams.AsyncStream":
    """An AsyncStream of stream, watched by the loop's Waker (or the
    completion thread)."""
    loop = asyncio.get_running_loop()
    waker = for_loop(stream.seg)
    if waker is None:
        chunks = async_streams.AsyncStream(stream, loop)
        client.completer().add(chunks)
        return chunks
    chunks = async_streams.AsyncStream(stream, loop, DIRECT)
    waker.add(chunks, client)
    return chunks


def _after_fork_in_child() -> None:
    # the parent's loops and sockets are its own; the child binds under its pid
    global _next_number, _netns
    _wakers.clear()
    _next_number, _netns = 0, None


os.register_at_fork(after_in_child=_after_fork_in_child)
