"""Fixtures and waits shared by the suite, and the rule every test follows.

A test asserts only what holds on any machine, at any load, on 1 to 64
cores: answers (each checked against its own request), counts, states,
errors, and the orders the design guarantees. It never asserts speed, CPU
use, latency or the batch sizes that happen to form under load: those are
measured by `shmbatch bench` and the scripts in bench/. Where a test needs
batches to form, it makes them form: a gated backend (helpers.gated) holds
its first batch until the test has queued the rest and opens the Gate.
Every wait is on a condition and has a bound; a sleep only paces a load or
is itself the interval measured.
"""
import contextlib
import gc
import itertools
import multiprocessing
import os
import pathlib
import select
import signal
import subprocess
import time
import weakref

import posix_ipc
import psutil
import pytest

import engine
from engine.config import EngineConfig
from engine.segment import Segment
from engine.shm import codes
from engine.shm import ring

# A process forked by a test must not collect the objects it inherited: the
# parent's garbage may hold an ONNX Runtime session, whose destructor waits
# on the parent's threads, which do not exist in the child (it would hang).
# They are frozen before the fork, so that not even the child's first steps
# (threading's own after-fork hook allocates) can collect them.
os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)

# Ray's nodes in the tests (tests/test_ray_*.py) take 127.0.0.1 for the host's address, as
# Ray does on macOS and Windows: then every process of theirs listens on loopback only, and
# a driver can reach them. Ray reads this once, when first imported: here, before any test.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

_names = itertools.count()


def unique_name(tag: str) -> str:
    return f"t{os.getpid()}-{tag}-{next(_names)}"


def shm_entries():
    return sorted(p.name for p in pathlib.Path("/dev/shm").glob("*shmbatch-*"))


@pytest.fixture(scope="session", autouse=True)
def nothing_leaks():
    """After the whole suite: no /dev/shm entry and no child process left."""
    before = set(shm_entries())
    yield
    mine = [n for n in set(shm_entries()) - before if f"shmbatch-t{os.getpid()}-" in n]
    children = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not mine, f"left in /dev/shm: {mine}"
    assert not alive, f"child processes left: {[p.pid for p in alive]}"


@pytest.fixture
def make_engine():
    """Starts engines with unique names; stops them after the test."""
    engines = []

    def make(tag="e", **kwargs):
        kwargs.setdefault("backend", "helpers:affine")
        eng = engine.Engine(unique_name(tag), **kwargs).start()
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.stop()


@pytest.fixture
def fork_ctx():
    return multiprocessing.get_context("fork")


def wait_until_no_slot_in_use(eng, timeout_s=10.0) -> bool:
    """Waits (bounded) for every slot to be FREE; wakes on each finished batch."""
    deadline = ring.now_ns() + int(timeout_s * 1e9)
    r = eng._seg.ring
    while ring.now_ns() < deadline:
        seen = r.done_seq()
        if eng.stats()["slots_in_use"] == 0:
            return True
        r.wait_done_seq(seen, 100_000_000)  # the reaper frees slots without a batch
    return False


# What wait_for_line read of a stream past the last line it returned: it reads
# the pipe's fd itself (select, then a buffered readline, would leave lines that
# came in one chunk in the stream's buffer, where select cannot see them).
_unread = weakref.WeakKeyDictionary()


def wait_for_line(stream, needle: str, timeout_s: float = 60.0, count: int = 1) -> list:
    """Reads lines (bounded in time) until `count` of them contain needle. The
    stream is this function's alone to read."""
    fd, seen, lines = stream.fileno(), 0, []
    pending = _unread.pop(stream, b"")
    deadline = time.monotonic() + timeout_s
    while True:
        while b"\n" in pending and seen < count:
            line, pending = pending.split(b"\n", 1)
            lines.append(line.decode("utf-8", "replace") + "\n")
            seen += needle in lines[-1]
        if seen >= count:
            _unread[stream] = pending
            return lines
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise TimeoutError(f"no {needle!r} within {timeout_s} s; got {lines}")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError(f"stream closed before {needle!r}; got {lines}")
        pending += chunk


def reap(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    """Ends proc if it still runs (sig: a serve drains and removes its segment;
    SIGKILL if it has not exited within 60 s), closes its pipes; its exit code."""
    try:
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(10)
    finally:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def wait_for(predicate, what: str, timeout_s: float = 60.0, every_s: float = 0.001) -> None:
    """Polls predicate (every every_s, bounded) until it holds; TimeoutError if it
    never does. A predicate that asks a server process polls at a gentler pace."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what}")
        time.sleep(every_s)


class Gate:
    """A named semaphore (owner-only, under /dev/shm like the engine's names)
    that helpers.gated's first batch waits on until the test opens it."""

    def __init__(self):
        self.name = f"/shmbatch-{unique_name('gate')}"
        self._sem = posix_ipc.Semaphore(self.name, posix_ipc.O_CREX, mode=0o600, initial_value=0)

    def open(self) -> None:
        self._sem.release()

    def close(self) -> None:
        self._sem.unlink()
        self._sem.close()


@pytest.fixture
def log(tmp_path):
    """The file a scripted step model (tests/step_models.py) logs its calls to."""
    return str(tmp_path / "calls.log")


@pytest.fixture
def gate():
    g = Gate()
    yield g
    g.close()


@contextlib.contextmanager
def raw_segment(tag: str, **config):
    """A segment of float32[4] requests with no engine: the C ring alone."""
    seg = Segment.create(EngineConfig(name=unique_name(tag), input_shape=(4,), output_shape=(4,),
                                      **config))
    try:
        yield seg
    finally:
        seg.unlink()
        seg.close()


def engine_word(name: str, word: int) -> int:
    """One word of a running engine's header (engine.shm.codes' W_*), read from its segment."""
    seg = Segment.attach(name, header_only=True)
    try:
        return seg.ring.word(word)
    finally:
        seg.close()


def requests_total(name: str) -> int:
    """Requests the engine has taken in."""
    return engine_word(name, codes.W_REQUESTS)


def import_proto_client(module: str):
    """`module` imported, else the test file skipped: missing, or it registers its own
    copy of the Open Inference Protocol's proto (tritonclient.grpc and kserve each do)
    where the other's is already loaded, which protobuf refuses in one process; then
    run the two files apart."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{module}: {e}", allow_module_level=True)
    except TypeError as e:
        if "duplicate symbol" not in str(e):
            raise
        pytest.skip(f"{module}: another copy of its proto is loaded in this process; run "
                    f"this file in a process of its own", allow_module_level=True)
