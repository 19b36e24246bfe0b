"""Any bytes written into a live engine's segment: no process dies, none hangs, nothing leaks.

A corrupter writes random words anywhere in the segment while clients send
requests. Requests may fail, with EngineErrors only, and an answer may be wrong
where its row was overwritten in flight (counted, not failed). The engine runs
in a process of its own (a supervisor that dies fails the test, not pytest);
each process's stderr goes to a file, with faulthandler on (batchers inherit
the supervisor's, and PYTHONFAULTHANDLER), so a fatal signal leaves its name
and stack there, even one during stop(), which no log line reports.

The suite runs seeds 1 and 2; SHMBATCH_FUZZ_SEEDS=20 runs seeds 1..20;
SHMBATCH_FUZZ_SEED=N replays seed N (the same writes; their interleaving with
the engine differs run to run); SHMBATCH_FUZZ_S=10 writes for 10 s instead of 2.
"""
import collections
import faulthandler
import logging
import mmap
import multiprocessing
import multiprocessing.connection
import os
import random
import re
import struct
import sys
import threading
import time
import traceback

import numpy as np
import posix_ipc
import psutil
import pytest
from conftest import shm_entries, unique_name
from step_models import chunks, request

import engine
from engine import errors
from engine.shm import codes

DURATION_S = float(os.environ.get("SHMBATCH_FUZZ_S", "2"))
SEEDS = ([int(os.environ["SHMBATCH_FUZZ_SEED"])] if "SHMBATCH_FUZZ_SEED" in os.environ
         else list(range(1, int(os.environ.get("SHMBATCH_FUZZ_SEEDS", "2")) + 1)))
HEADER_BYTES = codes.HEADER_BYTES  # csrc/ring.h; the slot control words, bitmaps and meta follow it
BOUNDARY = (0, 2**31, 2**32 - 1, 2**64 - 1)
STOP_BOUND_S = 30
CLIENTS = 3
KNOBS = dict(backend="engine.backends:synthetic", backend_args={"fixed_ms": 0.2, "per_item_us": 20},
             input_shape=(16,), output_shape=(16,), max_batch_size=8, queue_capacity=256,
             instances=2, priority_levels=2, drain_timeout_s=1)
# an iterative engine: streams whose every chunk names its request (step_models.scripted)
ITERATIVE = dict(KNOBS, backend="step_models:scripted", backend_args={}, iterative=True,
                 max_steps=8, input_shape=(4,), input_dtype="int64", output_shape=(),
                 output_dtype="int64")
KINDS = {"one-shot": KNOBS, "iterative": ITERATIVE}
# after these (EngineCorrupt is one) a client's handle may be useless: it attaches anew
REATTACH = errors.EngineUnavailable
# the supervisor's log lines that say a batcher died of a signal (supervisor._replace), or
# that the engine SIGKILLed one (in stop(), or its batch_timeout_s watchdog, off here)
SIGNAL_LINE = re.compile(r"killed by signal|killing it")


def _supervise(name, knobs, conn):
    """The engine's process: starts it, stops it when told, and sends back what
    it saw: warnings logged, exceptions escaped from its threads, whether stop() returned."""
    os.environ["PYTHONFAULTHANDLER"] = "1"  # in each batcher: a fatal signal prints its stack
    os.environ["SHMBATCH_FUZZ_TAG"] = name  # finds its batchers afterwards, even orphaned ones
    logged, escaped = [], []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("shmbatch").addHandler(handler)
    threading.excepthook = lambda a: escaped.append(
        f"thread {a.thread.name}: " + "".join(traceback.format_exception(a.exc_value)))
    eng = engine.Engine(name, **knobs).start()
    conn.send("started")
    conn.poll(600)  # the test's "stop" (or its end: EOF)
    t0 = time.monotonic()
    stopper = threading.Thread(target=eng.stop, daemon=True)
    stopper.start()
    stopper.join(STOP_BOUND_S)
    conn.send(dict(stopped=not stopper.is_alive(), stop_s=time.monotonic() - t0,
                   logged=logged, escaped=escaped))
    if stopper.is_alive():
        os._exit(1)  # stop() hangs: leave without it


def _ask(c, cid, k, iterative, timeout=0.5) -> bool:
    """One request, its answer checked against its own input: whether it was right."""
    if iterative:  # a stream read to its end, or the chunks stacked (a Future's)
        tag, length = cid * 10_000 + k % 10_000, 1 + k % 8
        if k % 3:
            got = [int(t) for t in c.stream(request(tag, length), timeout=timeout,
                                            priority=k % 2)]
        else:
            got = c.submit(request(tag, length), timeout=timeout).result(timeout=10).tolist()
        return got == chunks(tag, length)
    x = np.full(16, cid * 1_000_000 + k, np.float32)  # 2x + 1 exact in float32
    if k % 3:
        y = c.infer(x, timeout=timeout, priority=k % 2)
    else:  # its future resolves by the deadline; 10 s more is a hang (a TimeoutError)
        y = c.submit(x, timeout=timeout, priority=k % 2).result(timeout=10)
    return np.array_equal(y, x * 2 + 1)


def _client(name, cid, iterative, started, stop, conn):
    """Sends requests until told to stop, each answer checked against its own
    request; sends back counts and the errors that are not EngineErrors."""
    ok = wrong = 0
    errs, foreign = collections.Counter(), {}  # foreign: not EngineErrors, by type and place
    c, k, give_up = None, 0, time.monotonic() + DURATION_S + 120
    while not stop.is_set() and time.monotonic() < give_up:
        k += 1
        try:
            if c is None:
                c = engine.Client(name)
            right = _ask(c, cid, k, iterative)
            ok, wrong = ok + right, wrong + (not right)  # wrong: a row overwritten in flight
            started.set()
            if k % 50 == 0:  # closing and attaching anew are client calls too
                c.close()
                c = None
        except engine.EngineError as e:
            errs[type(e).__name__] += 1
            if isinstance(e, REATTACH):
                c = None  # attach anew, after a short pause
                stop.wait(0.05)
        except Exception as e:
            where = " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                               for f in traceback.extract_tb(e.__traceback__)[:-5:-1])
            foreign.setdefault(f"{type(e).__name__} in {where}", [0, str(e)[:200]])[0] += 1
            c = None
    conn.send(dict(ok=ok, wrong=wrong, errors=dict(errs), foreign=foreign))


def _corrupt(path, seed, conn):
    """Writes random words into the segment for DURATION_S; sends back how many."""
    rng = random.Random(seed)
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        m = mmap.mmap(f.fileno(), size)
    # a third of the hits in the header, a third in the 64 KiB after it (slot
    # control words, READY bitmaps, meta), a third anywhere (messages, lengths, data)
    zones = [(0, HEADER_BYTES), (HEADER_BYTES, min(size, HEADER_BYTES + 65536)), (0, size)]
    burst = (3, 30, 300)[seed % 3]  # seeds differ in density: sparse ones let the engine live on
    writes, end = 0, time.monotonic() + DURATION_S
    while time.monotonic() < end:
        for _ in range(rng.randint(1, burst)):
            lo, hi = rng.choice(zones)
            width, kind = rng.choice((4, 8)), rng.randrange(3)
            value = (rng.getrandbits(64) if kind == 0 else rng.randint(0, 300) if kind == 1
                     else rng.choice(BOUNDARY))
            off = rng.randrange(lo, hi - width + 1) // width * width
            struct.pack_into("<Q" if width == 8 else "<I", m, off, value & ((1 << 8 * width) - 1))
            writes += 1
        time.sleep(0.005)  # pacing: clients and batchers share the cores
    m.close()
    conn.send(writes)


def _child(stderr_path, target, *args):
    """target(*args) with stderr (fd 2, which batchers inherit) to its file, and
    faulthandler on it: a fatal signal leaves its name and stack there."""
    os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # an uncaught exception's too
    faulthandler.enable(2)
    target(*args)


def _started(ctx, tmp_path, what, target, *args):
    """A forked process running target(*args, conn): (what, process, our end of conn)."""
    ours, theirs = ctx.Pipe()
    stderr_path = tmp_path / ("supervisor+batchers" if target is _supervise else what)
    p = ctx.Process(target=_child, args=(str(stderr_path), target, *args, theirs))
    p.start()
    theirs.close()  # closed here: a child that dies leaves EOF, not a silent pipe
    return what, p, ours


def _ended_while(corrupter, procs, bound_s):
    """Waits (bounded) for the corrupter to end: for each process that ended
    meanwhile, how long after the first write it did."""
    t0, ended = time.monotonic(), {}
    while corrupter.pid not in ended and time.monotonic() - t0 < bound_s:
        waiting = {p.sentinel: p for _, p, _ in procs if p.pid not in ended}
        for s in multiprocessing.connection.wait(list(waiting), timeout=bound_s):
            ended[waiting[s].pid] = time.monotonic() - t0
    return ended


def _report(proc, failures, bound_s, ended):
    """The process's report, or None; a hang, or an exit other than 0, added to failures."""
    what, p, conn = proc
    p.join(bound_s)
    if p.is_alive():
        failures.append(f"{what} (pid {p.pid}) hung: still running after {bound_s} s")
        p.kill()
        p.join(10)
    elif p.exitcode != 0:
        how = f"died of signal {-p.exitcode}" if p.exitcode < 0 else f"exited {p.exitcode}"
        when = f", {ended[p.pid]:.2f} s after the first write" if p.pid in ended else ""
        failures.append(f"{what} (pid {p.pid}) {how}{when}")
    return _recv(conn)


def _recv(conn):
    """What conn holds, or None."""
    try:
        return conn.recv() if conn.poll(0) else None
    except EOFError:  # it died before it sent
        return None


def _fatal_signals(tmp_path):
    """Each fatal signal faulthandler wrote to a stderr file: which, and where (the
    innermost frames; two batchers crashing at once may garble them: see the file)."""
    found = []
    for path in sorted(tmp_path.iterdir()):
        for block in path.read_text(errors="replace").split("Fatal Python error: ")[1:]:
            frames = re.findall(r'File "([^"]+)", line (\d+) in (\w+)',
                                block.partition("Current thread")[2].split("\n\n")[0])
            where = " < ".join(f"{os.path.basename(f)}:{n} {fn}" for f, n, fn in frames[:3])
            found.append(f"stderr of {path.name}: {block.partition(chr(10))[0]} in {where}")
    return found


def _tagged(name):
    """Live processes started under the engine (its batchers), wherever they are now."""
    def tag(p):
        try:
            return p.environ().get("SHMBATCH_FUZZ_TAG")
        except (psutil.Error, OSError):
            return None
    return [p for p in psutil.process_iter() if tag(p) == name]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_words_in_a_live_segment_kill_no_process_and_leak_nothing(seed, kind, tmp_path):
    """Words written anywhere in the segment while 3 clients send requests: every
    process lives, every client-side error is an EngineError, stop() returns
    and leaves /dev/shm empty, and the same name then serves right answers."""
    ctx = multiprocessing.get_context("fork")
    name, knobs, iterative = unique_name(f"fuzz{seed}"), KINDS[kind], kind == "iterative"
    replay = f"{kind} seed {seed} (replay: SHMBATCH_FUZZ_SEED={seed} pytest {__file__})"
    failures, procs, t0 = [], [], time.monotonic()
    try:
        procs.append(_started(ctx, tmp_path, "supervisor", _supervise, name, knobs))
        sup_conn = procs[0][2]
        assert sup_conn.poll(60) and _recv(sup_conn) == "started", \
            f"{replay}: the engine did not start (see {tmp_path})"
        stop, started = ctx.Event(), [ctx.Event() for _ in range(CLIENTS)]
        clients = [_started(ctx, tmp_path, f"client {i}", _client, name, i, iterative,
                            started[i], stop)
                   for i in range(CLIENTS)]
        procs += clients
        for i, e in enumerate(started):  # load flows before the first write
            assert e.wait(30), f"{replay}: client {i} got no answer before the corruption"
        procs.append(_started(ctx, tmp_path, "corrupter", _corrupt,
                              f"/dev/shm/shmbatch-{name}", seed))
        ended = _ended_while(procs[-1][1], procs, DURATION_S + 30)
        writes = _report(procs[-1], failures, 10, ended)
        stop.set()
        reports = [_report(c, failures, 30, ended) for c in clients]
        failures += [f"client {i} saw {n} x {where}, not an EngineError (first: {first})"
                     for i, r in enumerate(reports) if r
                     for where, (n, first) in r["foreign"].items()]
        if procs[0][1].is_alive():
            sup_conn.send("stop")
        seen = _report(procs[0], failures, STOP_BOUND_S + 30, ended)
        if seen is not None:
            if not seen["stopped"]:
                failures.append(f"stop() did not return within {STOP_BOUND_S} s")
            failures += [f"supervisor log: {line}" for line in seen["logged"]
                         if SIGNAL_LINE.search(line)]
            failures += [f"escaped the supervisor: {e}" for e in seen["escaped"]]
        failures += _fatal_signals(tmp_path)
        if f"shmbatch-{name}" in shm_entries():
            failures.append(f"/dev/shm/shmbatch-{name} left after stop()")
        failures += [f"batcher pid {p.pid} still running after stop()" for p in _tagged(name)]
        failures += [f"child pid {p.pid} left" for p in psutil.Process().children(recursive=True)]
        try:  # the same name serves again, right answers only
            with engine.Engine(name, **knobs), engine.Client(name) as c:
                for k in range(50):
                    if not _ask(c, 99, k, iterative, timeout=10):
                        failures.append(f"after the fuzz, request {k} got a wrong answer")
        except Exception as e:
            failures.append(f"after the fuzz, {name!r} did not serve: {type(e).__name__}: {e}")
        summary = (f"{writes} writes in {DURATION_S} s; clients (ok, wrong, errors): "
                   + "; ".join(f"{r['ok']}, {r['wrong']}, {r['errors']}" if r else "no report"
                               for r in reports)
                   + (f"; stop() took {seen['stop_s']:.2f} s" if seen else "")
                   + f"; {time.monotonic() - t0:.1f} s in all")
        print(f"{replay}: {summary}")
        assert not failures, (f"{replay}:\n  " + "\n  ".join(failures)
                              + f"\n{summary}\nthe processes' stderr: {tmp_path}")
    finally:  # whatever failed: no process and no segment of this test outlives it
        for _, p, _ in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        for p in _tagged(name):
            p.kill()
        try:
            posix_ipc.unlink_shared_memory(f"/shmbatch-{name}")
        except posix_ipc.ExistentialError:
            pass
