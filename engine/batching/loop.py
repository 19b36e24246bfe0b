"""What both batcher loops share: their constants, the wait for work, a
failure's text, and the report of a death.

A batcher with nothing due sleeps on the ring's work word, which every
publish bumps: there is no flush timer while idle. With requests queued but
not yet due (max_delay_ms), it sleeps until the oldest one's arrival +
max_delay, or until the next publish.
"""
import traceback

from engine import launch
from engine.shm import codes

# The idle wait has no flush timer; this bound only lets a batcher notice a
# lost parent even if the kernel's parent-death signal did not fire.
IDLE_CHECK_NS = 1_000_000_000

# A batcher started by a reload waits for its epoch; it notices within this.
ACTIVATION_CHECK_NS = 2_000_000

# Why a loop's run() returned.
STOPPED, RETIRED = "stopped", "retired"


# A death's report is bounded (its pickle stays well within a pipe's buffer):
# the dying batcher's send never waits for the supervisor to read.
REPORT_CHARS = 2000


def error_text(e: BaseException) -> bytes:
    """A model's exception as a failed request's error text."""
    return f"{type(e).__name__}: {e}".encode("utf-8", "replace")[:codes.ERRMSG_BYTES]


def tell_death(conn, e: BaseException) -> None:
    """Reports the exception that ends a batcher's loop on its readiness pipe,
    which the supervisor reads once it finds the batcher dead (engine.serving.
    processes.reported): its log then says what the batcher died of."""
    launch.tell_failed(conn, launch.ChildFailed(type(e).__name__, str(e)[:REPORT_CHARS],
                                                traceback.format_exc()[-REPORT_CHARS:]))


def await_epoch(r) -> None:
    """A reload's batcher, not let in yet: look again at each finished batch,
    or within ACTIVATION_CHECK_NS; never asleep on the work word, whose wake
    (one sleeper's) is meant for a batcher that serves."""
    r.wait_done_seq(r.done_seq(), ACTIVATION_CHECK_NS)


def await_work(r, rule, seen: int, ready: int, oldest_ns: int, cutoff_ns: int, now_ns: int,
               spin_ns: int) -> int:
    """After a claim that took nothing: with nothing READY, sleep until a
    publish (spinning spin_ns first); with the oldest not due yet, until it
    is due or a publish. (Otherwise a publish raced the claim: no wait.)
    Returns the spin before the next sleep: the rule's idle spin once woken
    by the work word (a client's expect_work says a request is coming, or a
    publish another batcher claimed), else none."""
    if ready == 0:
        code = r.wait_work(seen, IDLE_CHECK_NS, spin_ns)
    elif oldest_ns > cutoff_ns:
        code = r.wait_work(seen, rule.wait_ns(oldest_ns, now_ns))
    else:
        return 0
    return rule.idle_spin_ns if code == codes.OK else 0
