"""What a Python user would write instead of shmbatch, for `shmbatch bench --compare`,
and the floor of any cross-process request (a raw futex ping-pong).

Both run the backend in one server process fed by a multiprocessing.Queue,
and answer each client through a queue of its own (inputs and outputs are
pickled both ways, as multiprocessing does):

- "mpq-per-request": one backend call per request;
- "mpq-batcher": the same flush rule as shmbatch (flush at max_batch_size,
  or when the OLDEST queued request has waited max_delay), written with
  Queue.get(timeout=...).
"""
import mmap
import os
import queue
import threading

import numpy as np

from engine import spec
from engine.shm import ring

STOP = None


def serve(backend, backend_args, requests_q, reply_qs, max_batch: int, max_delay_ms: float) -> None:
    """The server process: requests are (client, k, x, arrival_ns)."""
    fn = spec.resolve(backend)(**(backend_args or {}))
    max_delay_ns = int(max_delay_ms * 1e6)
    parent = os.getppid()
    stopping = False
    while not stopping:
        try:
            item = requests_q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the bench died without stopping us
                return
            continue
        if item is STOP:
            return
        batch = [item]
        deadline_ns = item[3] + max_delay_ns  # from the oldest's arrival, not from now
        while len(batch) < max_batch:
            left_s = (deadline_ns - ring.now_ns()) / 1e9
            try:
                nxt = requests_q.get(timeout=left_s) if left_s > 0 else requests_q.get_nowait()
            except queue.Empty:
                break
            if nxt is STOP:
                stopping = True
                break
            batch.append(nxt)
        ys = fn(np.stack([b[2] for b in batch]))
        for b, y in zip(batch, ys):
            reply_qs[b[0]].put((b[1], np.asarray(y)))


class Server:
    """A baseline server process and its queues (forked, so nothing is pickled up front)."""

    def __init__(self, backend, backend_args, clients: int, max_batch: int, max_delay_ms: float):
        import multiprocessing
        ctx = multiprocessing.get_context("fork")
        self.requests = ctx.Queue()
        self.replies = [ctx.Queue() for _ in range(clients)]
        self.proc = ctx.Process(target=serve, daemon=True,
                                args=(backend, backend_args, self.requests, self.replies,
                                      max_batch, max_delay_ms))
        self.proc.start()

    def stop(self) -> None:
        self.requests.put(STOP)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


class Caller:
    """One client's side of a baseline server: send, and a thread that receives."""

    def __init__(self, server: Server, cid: int, on_answer):
        self.requests, self.replies, self.cid = server.requests, server.replies[cid], cid
        self.on_answer = on_answer
        self.receiver = None

    def send(self, k: int, x: np.ndarray) -> None:
        # Queue.put pickles later, in a feeder thread: the array must not change after
        self.requests.put((self.cid, k, x.copy(), ring.now_ns()))

    def call(self, x: np.ndarray, timeout_s: float) -> np.ndarray:
        """Blocking round trip."""
        self.requests.put((self.cid, 0, x, ring.now_ns()))
        return self.replies.get(timeout=timeout_s)[1]

    def receive_in_background(self, n: int, timeout_s: float) -> None:
        def run():
            for _ in range(n):
                try:
                    k, y = self.replies.get(timeout=timeout_s)
                except queue.Empty:
                    return
                self.on_answer(k, y)
        self.receiver = threading.Thread(target=run, daemon=True)
        self.receiver.start()

    def wait_received(self, timeout_s: float) -> None:
        self.receiver.join(timeout_s)


def pingpong_floor_ns(rounds: int = 5000, spin_ns: int = 0) -> np.ndarray:
    """Round trips of a raw futex ping-pong between this process and a forked
    child on one shared word: the floor of any cross-process request. With
    spin_ns, each side spins that long before it sleeps (as the ring does)."""
    shared = mmap.mmap(-1, 64)
    out = np.zeros(rounds, dtype=np.uint64)
    pid = os.fork()
    if pid == 0:
        ring.pingpong(shared, 1, rounds, spin_ns)
        os._exit(0)
    done = ring.pingpong(shared, 0, rounds, spin_ns, out)
    os.waitpid(pid, 0)
    return out[:done]
