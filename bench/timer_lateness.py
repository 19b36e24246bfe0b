"""How late a sleeping process wakes for its scheduled send: the machine's own
floor for an open-loop load generator (no engine involved).

    python bench/timer_lateness.py

Four processes pinned to one core (as `shmbatch bench` pins its clients) each
sleep until their own Poisson arrivals, 1500/s in all, with a 1 ns timer
slack, and record how late they woke. Whatever this shows is part of every
latency that `shmbatch bench` measures from the scheduled arrival.
"""
import ctypes
import os
import time

import numpy as np

RATE_HZ, PROCESSES, ARRIVALS = 1500.0, 4, 1500


def sender(cid: int, start_ns: int, write_fd: int) -> None:
    ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK: 1 ns
    os.sched_setaffinity(0, [0])
    gaps_s = np.random.default_rng(cid).exponential(PROCESSES / RATE_HZ, ARRIVALS)
    late_ns = []
    for at_ns in start_ns + np.cumsum(gaps_s * 1e9).astype(np.int64):
        delay_ns = at_ns - time.monotonic_ns()
        if delay_ns > 0:
            time.sleep(delay_ns / 1e9)
        late_ns.append(time.monotonic_ns() - at_ns)
    os.write(write_fd, np.array(late_ns, np.int64).tobytes())


def main() -> None:
    start_ns = time.monotonic_ns() + 100_000_000
    pipes = []
    for cid in range(PROCESSES):
        read_fd, write_fd = os.pipe()
        if os.fork() == 0:
            os.close(read_fd)
            sender(cid, start_ns, write_fd)
            os._exit(0)
        os.close(write_fd)
        pipes.append(read_fd)
    late_ns = []
    for read_fd in pipes:
        blob = b""
        while chunk := os.read(read_fd, 1 << 16):
            blob += chunk
        late_ns.append(np.frombuffer(blob, np.int64))
        os.close(read_fd)
    for _ in pipes:
        os.wait()
    late_ms = np.concatenate(late_ns) / 1e6
    print(f"{PROCESSES} sleeping senders on one core, {RATE_HZ:.0f}/s in all: wake-up lateness "
          f"p50 {np.percentile(late_ms, 50):.3f} ms, p99 {np.percentile(late_ms, 99):.3f} ms, "
          f"max {late_ms.max():.3f} ms")


if __name__ == "__main__":
    main()
