"""`shmbatch serve --log-format json`: every line any of its processes writes
to stderr is one JSON object (ts, level, engine, event, fields), the lines
about an engine name it; the default text format is unchanged."""
import datetime
import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
from conftest import reap, unique_name, wait_for_line
from test_serve_ops import serve, shmbatch_stats

import engine

X = np.arange(16, dtype=np.float32)
KEYS = ("ts", "level", "engine", "event")


def parsed(lines) -> list:
    """Each stderr line as JSON; AssertionError naming the first that is not."""
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
    return records


def test_every_line_of_serve_its_batchers_and_http_workers_is_json_naming_its_engine():
    name = unique_name("jsonlog")
    proc = serve(name, "--log-format", "json", "--http-port", "0",
                 backend="logging_backends:chatty")
    try:
        ready = wait_for_line(proc.stdout, "ready")[-1]
        assert ready.startswith(f"shmbatch serve: engine {name!r} ready")  # stdout as before
        first = shmbatch_stats(name)["batcher_pids"][0]
        os.kill(first, signal.SIGKILL)
        lines = wait_for_line(proc.stderr, "ready again", count=1)
        with engine.Client(name) as c:
            assert np.array_equal(c.infer(X, timeout=10), X * 2 + 1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        lines += proc.stderr.read().splitlines()
    finally:
        reap(proc)
    records = parsed(lines)
    assert all(set(KEYS) <= set(r) for r in records), records
    for r in records:
        stamp = datetime.datetime.fromisoformat(r["ts"].replace("Z", "+00:00"))
        assert stamp.utcoffset() == datetime.timedelta(0) and re.search(r"\.\d{6}Z$", r["ts"])
    about = [r for r in records if f"engine {name}" in r["event"]]
    assert {r["engine"] for r in about} == {name}
    died = [r for r in about if "died" in r["event"]]
    assert len(died) == 1 and died[0]["level"] == "WARNING" and "SIGKILL" in died[0]["event"]
    assert any(r["event"].endswith("signal received; draining") for r in about)
    # the batcher's own lines (its backend's logger, its warning, an exception),
    # once per batcher: the first and the one started in its place
    loads = [r for r in records if r["event"] == "loading weights"]
    assert len(loads) == 2 and {r["pid"] for r in loads} >= {first}
    assert all(r["engine"] == name and r["weights"] == "w.bin" and r["scale"] == 2.0
               for r in loads)
    falls = [r for r in records if r["event"] == "falling back to the CPU"]
    assert len(falls) == 2 and all("OSError: no GPU found" in r["exc"] for r in falls)
    assert sum("an old weights format" in r["event"] for r in records) == 2
    # an HTTP worker serves every engine: its lines name none
    drains = [r for r in records if r["event"].startswith("HTTP worker pid")]
    assert drains and all(r["engine"] is None and r["pid"] != proc.pid for r in drains)


def test_a_bad_log_format_exits_non_zero_with_one_line():
    proc = serve(unique_name("badlog"), "--log-format", "xml")
    try:
        assert proc.wait(60) != 0
        err = proc.stderr.read()
        assert proc.stdout.read() == ""
    finally:
        reap(proc)
    assert err.count("\n") == 1 and "--log-format" in err and "xml" in err, err


def test_the_default_log_is_text_as_before():
    name = unique_name("textlog")
    proc = serve(name)
    try:
        wait_for_line(proc.stdout, "ready")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        err = proc.stderr.read().splitlines()
    finally:
        reap(proc)
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    assert re.fullmatch(rf"{stamp} INFO shmbatch: engine {name} started: .*", err[0]), err
    assert all(re.match(rf"{stamp} [A-Z]+ ", line) for line in err), err


def test_json_lines_carry_a_records_fields_and_its_exception():
    code = ("import logging, sys; from engine import logfmt; logfmt.configure('info', 'json'); "
            "log = logging.getLogger('shmbatch'); "
            "log.info('batch of %d', 3, extra={'engine': 'e1', 'batch_size': 3})\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n    log.exception('failed')\n"
            "log.warning('engine %s: stopped', 'e2')\nraise KeyError('uncaught')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    first, second, third, fourth = parsed(out.stderr.splitlines())
    assert (first["event"], first["engine"], first["batch_size"]) == ("batch of 3", "e1", 3)
    assert second["engine"] is None and second["level"] == "ERROR"
    assert "ZeroDivisionError" in second["exc"]
    assert (third["engine"], third["event"]) == ("e2", "engine e2: stopped")
    assert fourth["level"] == "CRITICAL" and "KeyError: 'uncaught'" in fourth["exc"]
    assert out.returncode == 1
