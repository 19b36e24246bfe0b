"""An engine that does not fit /dev/shm is refused before anything is made,
any failure in start() leaves nothing behind, and a leftover segment of any
size is cleaned up without touching its memory.

Each test runs a script in a private mount namespace with a small tmpfs over
/dev/shm (Docker's default is 64 MiB), so the host's /dev/shm is never at
risk; skipped where such a namespace cannot be made (not root)."""
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(not _namespaces_work(),
                                reason="needs `unshare -m` and mount (root) for a private /dev/shm")

PRELUDE = """
import json, os, subprocess, sys, time
import numpy as np, psutil
import engine
from engine import config
from engine import segment
from engine.shm import sizing

def shm_used():
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize

def start_too_large(name):  # 32 slots x 4 MiB (in place) = 128 MiB: over a 64 MiB /dev/shm
    eng = engine.Engine(name, backend="engine.backends:identity", input_shape=(1 << 20,),
                        output_shape=(1 << 20,), queue_capacity=32)
    try:
        eng.start()
        report(error=None)
    except engine.EngineError as e:
        report(error=type(e).__name__, message=str(e), used=shm_used())

def report(**figures):
    figures["shm_entries"] = sorted(os.listdir("/dev/shm"))
    figures["children"] = [p.pid for p in psutil.Process().children(recursive=True)]
    print("RESULT " + json.dumps(figures))
"""


def in_small_shm(script: str, size: str = "64m") -> dict:
    """Runs script under a private tmpfs of `size` at /dev/shm; its RESULT line."""
    body = PRELUDE + textwrap.dedent(script)
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f'mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm && exec "$0" -c "$1"',
         sys.executable, body], env=ENV, capture_output=True, text=True, timeout=180)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"no result (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


def test_an_engine_that_does_not_fit_is_refused_before_anything_is_made():
    got = in_small_shm("""
        start_too_large("toolarge")
    """)
    assert got["error"] == "SegmentTooLarge"
    message = got["message"]
    for needed in ("needs 128.", "queue_capacity 32 x 4.0 MiB (answers overwrite their input) per slot", "/dev/shm has",
                   "free of 64.0 MiB", "--shm-size=", "sizeLimit:", "lower queue_capacity"):
        assert needed in message
    assert "\n" not in message
    assert got["used"] == 0 and got["shm_entries"] == [] and got["children"] == []


def test_serve_of_an_engine_that_does_not_fit_says_so_in_one_line_and_exits_non_zero():
    got = in_small_shm("""
        proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--name", "toolarge",
                               "--backend", "engine.backends:identity", "--input-shape", "1048576",
                               "--output-shape", "1048576", "--queue-capacity", "32"],
                              capture_output=True, text=True, timeout=120)
        report(rc=proc.returncode, stderr=proc.stderr, stdout=proc.stdout)
    """)
    assert got["rc"] != 0 and "ready" not in got["stdout"]
    lines = got["stderr"].strip().splitlines()
    assert len(lines) == 1 and "needs 128." in lines[0] and "--shm-size=" in lines[0]
    assert got["shm_entries"] == [] and got["children"] == []


def test_an_engine_that_fits_a_small_dev_shm_runs_and_leaves_it_empty():
    got = in_small_shm("""
        with engine.Engine("fits", backend="engine.backends:identity", input_shape=(1024,),
                           output_shape=(1024,), queue_capacity=64) as eng:
            with engine.Client("fits") as c:
                x = np.arange(1024, dtype=np.float32)
                right = bool(np.array_equal(c.infer(x, timeout=30), x))
            segment_bytes = eng.stats()["segment_bytes"]
            used = shm_used()
        report(right=right, segment_bytes=segment_bytes, used_while_running=used)
    """)
    assert got["right"] and got["shm_entries"] == [] and got["children"] == []
    assert got["used_while_running"] >= got["segment_bytes"] >= 64 * 4096  # committed up front


def test_a_dev_shm_that_fills_after_the_check_fails_start_and_leaves_nothing():
    got = in_small_shm("""
        sizing.check_fits = lambda config, size: None  # as if another process filled it meanwhile
        start_too_large("raced")
    """)
    assert got["error"] == "SegmentTooLarge" and "could not commit" in got["message"]
    assert got["used"] == 0 and got["shm_entries"] == [] and got["children"] == []


def test_cleanup_removes_a_32_gib_leftover_without_touching_its_memory():
    got = in_small_shm("""
        from engine.cli import commands
        config = config.EngineConfig(name="leftover", input_shape=(16,), output_shape=(16,),
                                     queue_capacity=64)
        # an engine that crashes: its segment stays, its lock goes with the process
        pid = os.fork()
        if pid == 0:
            segment.Segment.create(config)
            os._exit(0)
        os.waitpid(pid, 0)
        path = "/dev/shm/shmbatch-leftover"
        os.truncate(path, 32 << 30)  # grown to 32 GiB, sparse
        apparent, used_before = os.stat(path).st_size, shm_used()
        rss_before = psutil.Process().memory_info().rss
        started = time.monotonic()
        code = commands.main(["cleanup", "leftover"])
        seconds = time.monotonic() - started
        report(code=code, apparent=apparent, used_before=used_before, used_after=shm_used(),
               rss_growth=psutil.Process().memory_info().rss - rss_before, seconds=seconds)
    """)
    print(f"cleanup of a 32 GiB sparse leftover: {got['seconds'] * 1e3:.1f} ms, "
          f"resident growth {got['rss_growth']} B")
    assert got["code"] == 0 and got["apparent"] == 32 << 30 and got["shm_entries"] == []
    assert got["used_after"] <= got["used_before"] < 64 << 20  # nothing of it was committed
    assert got["rss_growth"] < 32 << 20  # its pages were never mapped in
