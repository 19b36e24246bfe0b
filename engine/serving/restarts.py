"""The restart policy: why a batcher died, what becomes of its batch, and
when its successor starts.

The supervisor's monitor thread applies it: a batch that ran longer than
batch_timeout_s is a hung model (hung()), whose batcher it kills; a dead
batcher's batch is kept for its successor to retry each request alone, or
failed (reap_terms()); a successor that cannot start is tried again after a
doubling back-off (back_off()); while no batcher serves, the segment says
until when a successor is expected to (Unserved). Every text a failed request carries about
its batcher's death, and the log's words for a death and for the successor's
readiness, are written here.
"""
import dataclasses
import multiprocessing.connection
import signal
from typing import TYPE_CHECKING, Optional

from engine.serving import processes
from engine.shm import codes, ring

if TYPE_CHECKING:
    from engine.serving.processes import BatcherProcess

RESTART_BACKOFF_MAX_S = 10.0
READY_EXPECTED_MIN_S = 1.0  # a successor's start is never expected sooner (Unserved)


@dataclasses.dataclass
class Instance:
    """One of the engine's instances: its batcher number in the ring `index`
    (position + instances * bank, the bank flipping on each reload), its
    `position` (which cpus/gpus entry it takes), its batcher process (None
    between a death and the restart) and its restart state."""
    index: int
    position: int
    proc: Optional["BatcherProcess"] = None
    restart_at_ns: int = 0  # no restart before this (backoff after failed starts)
    backoff_s: float = 0.0
    hung: bool = False  # killed by the watchdog (batch_timeout_s), not crashed
    # a dead batcher's batch kept for its successor, and the engine's retry
    # count then: a successor that dies before it retries anything has not helped
    kept: int = 0
    retried_at_keep: int = 0
    futile_restarts: int = 0
    # the batcher's pipe, open while it serves: an exception that ends its loop
    # is reported there before it dies (processes.reported)
    reports: Optional[multiprocessing.connection.Connection] = None
    died_ns: int = 0  # when its last batcher was found dead (0: none since it started)
    failed_starts: int = 0  # successors that failed to start since then

    def drop_reports(self) -> None:
        if self.reports is not None:
            self.reports.close()
            self.reports = None


def reap_terms(b: Instance, pid: int, why: str, retried_total: int, isolate: bool):
    """(message, retry) for reaping b's dead batcher (ring.reap_batcher).
    With isolate (isolate_failures, on an engine whose answers do not
    overwrite its inputs) its batch is kept for the successor to retry, each
    request alone (one then being retried alone fails, as poison), unless the
    last two successors died before they retried anything (retried_total,
    the engine's count, did not move: a batcher that dies on start); then the
    batch fails."""
    futile = b.kept and retried_total == b.retried_at_keep
    b.futile_restarts = b.futile_restarts + 1 if futile else 0
    head = f"batcher {b.index} (pid {pid}) died ({why})"
    if not isolate:
        return f"{head} while serving this request".encode(), False
    if b.futile_restarts >= 2:
        return (f"{head}; its batch was kept for a retry, but {b.futile_restarts} successors "
                f"died before retrying it: failed").encode(), False
    return (f"{head} while retrying this request alone, after its batch had lost a "
            f"batcher: failed as poison").encode(), True


def begun_stream(b: Instance, pid: int, why: str) -> bytes:
    """The failure of a stream that had chunks when b's batcher died: not
    retried, as its client already holds part of the answer."""
    return (f"batcher {b.index} (pid {pid}) died ({why}) while streaming this request: "
            f"not retried, its client had chunks").encode()


def hung(started_ns: int, now_ns: int, engine_started_ns: int, timeout_s: float) -> bool:
    """Whether a batch that started at started_ns (the batcher's stamp in the
    segment; 0: idle) has run over timeout_s. A stamp from before the engine
    started, or from the future, is no batch's: a stray write, not a hang."""
    if not engine_started_ns <= started_ns <= now_ns:
        return False
    return now_ns - started_ns > timeout_s * 1e9


def exit_text(exitcode: Optional[int]) -> str:
    """A process's end in words: "exit code 3", or "killed by signal 9 (SIGKILL)"."""
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:  # a real-time signal has no name
        return f"killed by signal {-exitcode}"
    return f"killed by signal {-exitcode} ({name})"


def why_died(b: Instance, exitcode: Optional[int], batch_timeout_s: Optional[float]) -> str:
    """How b's batcher ended, in words: hung (its mark cleared), the exception
    it reported, or its exit code or signal. Its pipe is read and closed."""
    reported = processes.reported(b.reports)
    b.drop_reports()
    if b.hung:
        b.hung = False
        return f"hung: its batch ran over batch_timeout_s={batch_timeout_s:g}"
    if reported is not None:
        return f"{reported}; {exit_text(exitcode)}"
    return exit_text(exitcode)


def ready_again(b: Instance, now_ns: int) -> str:
    """The log's words for b's successor, ready now (b.died_ns is cleared)."""
    took_s, b.died_ns = (now_ns - b.died_ns) / 1e9, 0
    tries = f", {b.failed_starts} failed start(s) before it" if b.failed_starts else ""
    retries = (f"; it retries the {b.kept} request(s) its predecessor held, each alone"
               if b.kept else "")
    return (f"batcher {b.index} ready again after {took_s:.2f} s (pid {b.proc.pid}{tries})"
            f"{retries}")


def no_successor(b: Instance, error: Exception) -> bytes:
    """The failure of what b's dead batcher kept, when no successor starts."""
    return (f"batcher {b.index} died while serving this request, and no batcher could "
            f"restart to retry it ({error})").encode()


class Unserved:
    """The segment's word that says, while no batcher serves, until when a
    successor is expected to: after twice the longest start the engine has
    seen (at least READY_EXPECTED_MIN_S). A start that goes on past it is
    expected again as long from then as it has taken so far (a slow start
    on a loaded machine is late, not lost), and a failed one at its next
    try's expected end; never past start_timeout_s of that try, its bound.
    Clients refuse at once a request whose deadline comes before it; what is
    queued keeps its chance. 0 while a batcher serves."""

    def __init__(self, seg, start_timeout_s: float):
        self._seg, self._bound_ns = seg, int(start_timeout_s * 1e9)
        self._longest_start_ns = 0  # a batcher's, spawn to serving
        self._since_ns = self._until_ns = 0  # the start marked unserved; 0: none

    def _expected_ns(self) -> int:
        return min(max(2 * self._longest_start_ns, int(READY_EXPECTED_MIN_S * 1e9)),
                   self._bound_ns)

    def _mark(self, since_ns: int, until_ns: int) -> None:
        self._since_ns, self._until_ns = since_ns, until_ns
        self._seg.own_word(codes.W_UNSERVED_UNTIL_NS, until_ns)

    def starting(self, instances) -> int:
        """Before a batcher's start: marks the engine unserved if no other
        batcher lives. Returns the start's time, for served()."""
        now_ns = ring.now_ns()
        if not any(i.proc is not None and i.proc.is_alive() for i in instances):
            self._mark(now_ns, now_ns + self._expected_ns())
        return now_ns

    def waiting_s(self) -> float:
        """While a start goes on: the seconds until the word's time, moved on
        first if the start has already taken longer than expected."""
        if not self._until_ns:
            return 3600.0  # another batcher serves: nothing to move on
        now_ns = ring.now_ns()
        if now_ns >= self._until_ns:
            taken_ns = now_ns - self._since_ns
            self._mark(self._since_ns, self._since_ns + min(2 * taken_ns, self._bound_ns))
        return max(0.01, (self._until_ns - now_ns) / 1e9)

    def failed(self, retry_at_ns: int) -> None:
        """A start failed and the next is at retry_at_ns: expected by then plus
        a start (if no batcher serves meanwhile)."""
        if self._until_ns:
            self._mark(retry_at_ns, retry_at_ns + self._expected_ns())

    def served(self, began_ns: int) -> None:
        """A batcher started at began_ns serves now."""
        self._longest_start_ns = max(self._longest_start_ns, ring.now_ns() - began_ns)
        self._mark(0, 0)


def back_off(b: Instance) -> float:
    """The wait before b's next start, after one failed: doubling from 0.5 s
    to RESTART_BACKOFF_MAX_S."""
    b.failed_starts += 1
    b.backoff_s = min(RESTART_BACKOFF_MAX_S, 2 * b.backoff_s or 0.5)
    return b.backoff_s
