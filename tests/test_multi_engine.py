"""Several engines in one `shmbatch serve`: [engines.NAME] tables, all start or none,
each engine answering, reloaded and reported by its name, one /metrics for all."""
import json
import re
import signal
import socket
import subprocess
import sys
import urllib.request

import numpy as np
import psutil
import pytest
from conftest import reap, shm_entries, unique_name, wait_for_line
from test_sidecar import ENV, free_port, shmbatch

import engine

X = np.arange(16, dtype=np.float32)
AFFINE = dict(backend="helpers:affine", input_shape=[16], output_shape=[16])


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f'"{k}" = {toml_value(v)}' for k, v in value.items()) + "}"


def table(engine_name: str, **keys) -> str:
    """One [engines.NAME] table of Engine(...)'s keys."""
    return f'[engines."{engine_name}"]\n' + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items())


def top(**keys) -> str:
    """serve's own keys, before the tables."""
    return "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items())


class Served:
    """`shmbatch serve --config FILE` (its text given) until stop(): ready when it
    says so; `url` is the HTTP address its ready line names, if any."""

    def __init__(self, folder, config: str, *flags):
        path = folder / "models.toml"
        path.write_text(config)
        self.errors = folder / "serve.err"
        with open(self.errors, "w") as errors:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine", "serve", "--config", str(path), *flags],
                env=ENV, stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            self.ready_line = wait_for_line(self.proc.stdout, "ready")[-1]
        except (EOFError, TimeoutError) as e:
            self.stop(signal.SIGKILL)
            raise AssertionError(f"{e}; stderr: {self.stderr()}") from None
        found = re.search(r"http://(\S+)$", self.ready_line.strip())
        self.url = found.group(1) if found else None

    def stderr(self) -> str:
        return self.errors.read_text()

    def stop(self, sig=signal.SIGTERM) -> int:
        return reap(self.proc, sig)


def failed_serve(folder, config: str, *flags):
    """serve run on a config that must not start: (exit code, the stderr lines
    that are not log lines)."""
    path = folder / "models.toml"
    path.write_text(config)
    out = subprocess.run([sys.executable, "-m", "engine", "serve", "--config", str(path), *flags],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert "ready" not in out.stdout
    return out.returncode, [line for line in out.stderr.splitlines()
                            if not re.match(r"\d{4}-\d\d-\d\d ", line)]


def test_two_engines_from_one_config_answer_and_are_reported_and_reloaded_by_name(tmp_path):
    a, b = unique_name("multi-a"), unique_name("multi-b")
    port = free_port()
    s = Served(tmp_path, top(metrics_port=port, metrics_host="127.0.0.1")
               + table(a, **AFFINE, max_batch_size=4)
               + table(b, backend="helpers:row_sum", input_shape=[8], output_shape=[],
                       instances=2))
    try:
        assert a in s.ready_line and b in s.ready_line
        with engine.Client(a) as ca, engine.Client(b) as cb:
            assert np.array_equal(ca.infer(X, timeout=10), X * 2 + 1)
            assert float(cb.infer(X[:8], timeout=10)) == X[:8].sum()
            figures = {n: json.loads(shmbatch("status", n, "--json").stdout) for n in (a, b)}
            assert (figures[a]["max_batch_size"], figures[a]["instances_alive"]) == (4, 1)
            assert (figures[b]["requests_total"], figures[b]["instances_alive"]) == (1, 2)
            reloaded = shmbatch("reload", a, "--backend", "engine.backends:identity")
            assert reloaded.returncode == 0, reloaded.stderr
            assert np.array_equal(ca.infer(X, timeout=10), X)  # a reloaded, b untouched
            assert float(cb.infer(X[:8], timeout=10)) == X[:8].sum()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        for name in (a, b):
            assert f'shmbatch_requests_total{{engine="{name}",outcome="ok"}}' in text
        # one family per name, holding both engines' samples
        assert text.count("# TYPE shmbatch_batches_total counter") == 1
        assert text.count("# TYPE shmbatch_batch_size histogram") == 1
        refused = shmbatch("cleanup", b)
        assert refused.returncode != 0 and "already running" in refused.stderr
    finally:
        rc = s.stop()
    assert rc == 0, s.stderr()
    assert not [e for e in shm_entries() if a in e or b in e]


def test_sigterm_drains_every_engine(tmp_path):
    a, b = unique_name("drain-a"), unique_name("drain-b")
    slow = dict(backend="helpers:slow_affine", backend_args={"fixed_ms": 20.0}, max_batch_size=2,
                input_shape=[16], output_shape=[16])
    s = Served(tmp_path, table(a, **slow) + table(b, **slow))
    try:
        with engine.Client(a) as ca, engine.Client(b) as cb:
            futures = [(c.submit(X + k, timeout=30), k) for k in range(8) for c in (ca, cb)]
            s.proc.send_signal(signal.SIGTERM)
            for f, k in futures:
                assert np.array_equal(f.result(timeout=30), (X + k) * 2 + 1)
    finally:
        rc = s.stop()
    assert rc == 0, s.stderr()
    assert not [e for e in shm_entries() if a in e or b in e]


@pytest.mark.parametrize("case", ["a backend that does not start", "a segment that does not fit",
                                  "an unknown key", "a name that is not the table's"])
def test_a_table_that_fails_starts_nothing_and_names_its_engine(tmp_path, case):
    a, b = unique_name("good"), unique_name("bad")
    pid_path = tmp_path / "a.pid"
    good = table(a, backend="serve_backends:pid_file", backend_args={"path": str(pid_path)},
                 input_shape=[16], output_shape=[16])
    bad = table(b, **{**AFFINE, **{
        "a backend that does not start": {"backend": "helpers:no_such"},
        "a segment that does not fit": {"input_shape": [1 << 26]},
        "an unknown key": {"max_batch": 4},
        "a name that is not the table's": {"name": "other"}}[case]})
    rc, lines = failed_serve(tmp_path, good + bad)
    assert rc != 0
    assert len(lines) == 1 and f"engine {b!r}" in lines[0], lines
    assert not [e for e in shm_entries() if a in e or b in e]
    if pid_path.exists():  # a started before b failed: its batcher is gone too
        _, alive = psutil.wait_procs([psutil.Process(int(pid_path.read_text()))]
                                     if psutil.pid_exists(int(pid_path.read_text())) else [],
                                     timeout=10)
        assert not alive


@pytest.mark.parametrize("case, reason", [
    ("an engine flag beside tables", "--max-batch-size"),
    ("an engine key at the top level", "top-level key(s) max_batch_size"),
    ("no table at all", "expected [engines.NAME] tables"),
    ("an HTTP flag without a port", "--http-workers without --http-port"),
    ("a dtype HTTP has no datatype for", "has no datatype for complex64"),
])
def test_a_config_of_tables_refuses_what_it_cannot_place(tmp_path, case, reason):
    name = unique_name("place")
    config, flags = {
        "an engine flag beside tables": (table(name, **AFFINE), ["--isolate-failures", "false",
                                                                 "--max-batch-size", "4"]),
        "an engine key at the top level": (top(max_batch_size=4) + table(name, **AFFINE), []),
        "no table at all": ("[engines]\n", []),
        "an HTTP flag without a port": (table(name, **AFFINE), ["--http-workers", "2"]),
        "a dtype HTTP has no datatype for": (
            top(http_port=0) + table(name, **AFFINE, output_dtype="complex64"), []),
    }[case]
    rc, lines = failed_serve(tmp_path, config, *flags)
    assert rc != 0 and len(lines) == 1 and reason in lines[0], lines
    assert not [e for e in shm_entries() if name in e]


def test_an_http_port_in_use_fails_the_start_before_any_engine_starts(tmp_path):
    pytest.importorskip("uvicorn")
    name = unique_name("busy")
    pid_path = tmp_path / "a.pid"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, lines = failed_serve(tmp_path, top(http_port=port) + table(
            name, backend="serve_backends:pid_file", backend_args={"path": str(pid_path)},
            input_shape=[16], output_shape=[16]))
    assert rc != 0 and len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], lines
    assert not pid_path.exists() and not [e for e in shm_entries() if name in e]


def test_tune_measures_the_engine_a_config_of_tables_names(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(table("a", **AFFINE) + table("b", backend="engine.backends:identity",
                                                 input_shape=[4], output_shape=[4]))
    unnamed = shmbatch("tune", "--config", str(path), "--slo-ms", "50")
    assert unnamed.returncode != 0 and "expected --engine NAME, one of ['a', 'b']" in unnamed.stderr
    named = shmbatch("tune", "--config", str(path), "--engine", "b", "--slo-ms", "50",
                     "--max-batch", "2")
    assert named.returncode == 0 and "recommend" in named.stdout, named.stderr
