"""The HTTP front of `shmbatch serve --http-port` against careless and hostile callers:
connections that stall are timed out, those beyond the cap refused at once, a drain refuses
new ones at once, the workers' logs stay bounded when descriptors run short, /metrics stays
on loopback, a worker that cannot start is retried later and later while serve goes on, and
the workers are the kernel's first choice when memory runs out. Real serve processes,
plain sockets and http.client; every wait is bounded, and a time is only ever a lower bound
(a timer never fires early) or a generous upper one."""
import datetime
import http.client
import json
import os
import re
import resource
import select
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

pytest.importorskip("uvicorn")
from conftest import reap, requests_total, shm_entries, unique_name, wait_for, wait_for_line  # noqa: E402
from engine.segment import segment_name  # noqa: E402
from test_sidecar import ENV, free_port  # noqa: E402


X = np.arange(16, dtype=np.float32)
READ_TIMEOUT_S = 1.0
CLOSED_WITHIN_S = 20.0  # a timer of READ_TIMEOUT_S fires by then on any machine


def infer_body(x=X) -> bytes:
    return json.dumps({"inputs": [{"name": "INPUT", "shape": [1, 16], "datatype": "FP32",
                                   "data": x.tolist()}]}).encode()


class Serve:
    """`shmbatch serve` of one engine (helpers:affine unless told) with --http-port 0,
    under an open-file limit if given (soft, hard)."""

    def __init__(self, folder, *flags, nofile=None, backend=("--backend", "helpers:affine")):
        self.name = unique_name("conn")
        self.errors = folder / "serve.err"
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile)) if nofile else None
        with open(self.errors, "w") as errors:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "engine", "serve", "--name", self.name, *backend,
                 "--input-shape", "16", "--output-shape", "16", "--http-port", "0", *flags],
                env=ENV, stdout=subprocess.PIPE, stderr=errors, text=True, preexec_fn=limit)
        try:
            line = wait_for_line(self.proc.stdout, "ready")[-1]
        except (EOFError, TimeoutError) as e:
            self.stop(signal.SIGKILL)
            raise AssertionError(f"{e}; stderr: {self.stderr()}") from None
        self.port = int(re.search(r"http://127\.0\.0\.1:(\d+)$", line.strip()).group(1))
        self.batchers = [int(p) for p in re.search(r"batchers \[([\d, ]+)\]", line)
                         .group(1).split(",")]

    def stderr(self) -> str:
        return self.errors.read_text()

    def workers(self) -> list:
        return [p for p in psutil.Process(self.proc.pid).children()
                if "engine.http.worker" in " ".join(p.cmdline())]

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=CLOSED_WITHIN_S)

    def get(self, path="/v2/health/live", method="GET", body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def infer(self, x=X):
        status, answer = self.get(f"/v2/models/{self.name}/infer", "POST", infer_body(x))
        assert status == 200, answer
        return np.array(answer["outputs"][0]["data"], dtype=np.float32)

    def stop(self, sig=signal.SIGTERM) -> int:
        return reap(self.proc, sig)

    def close(self) -> None:
        rc = self.stop()
        assert rc == 0, self.stderr()
        assert "Traceback" not in self.stderr(), self.stderr()
        assert not [e for e in shm_entries() if self.name in e]


def until_closed(sock: socket.socket, timeout_s: float = CLOSED_WITHIN_S) -> bytes:
    """What the server writes until it closes the connection (AssertionError if it
    does not within timeout_s)."""
    data, deadline = b"", time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([sock], [], [], left)[0]:
            raise AssertionError(f"the connection is still open after {timeout_s:g} s; "
                                 f"got {data!r}")
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def response(data: bytes):
    """(status, headers in lower case, the JSON body) of one whole HTTP/1.1 response."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, json.loads(body)


def lower_soft_limit():
    """An open-file limit whose soft part is below its hard one."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return min(1024, hard // 2), hard


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    """One serve with a 1 s read timeout and /metrics on its default address,
    started with a soft open-file limit below the hard one."""
    s = Serve(tmp_path_factory.mktemp("front"), "--http-read-timeout-s", str(READ_TIMEOUT_S),
              "--metrics-port", str(free_port()), nofile=lower_soft_limit())
    yield s
    s.close()


def test_a_silent_connection_is_closed_after_the_read_timeout(front):
    with front.connect() as sock:
        opened = time.monotonic()
        assert until_closed(sock) == b""  # closed quietly: not a byte of a request came
        assert time.monotonic() - opened >= READ_TIMEOUT_S * 0.9  # by the timer, not at once
    assert front.infer().tolist() == (X * 2 + 1).tolist()


def test_a_half_sent_head_is_answered_408_and_closed(front):
    with front.connect() as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # no blank line: no end
        status, headers, answer = response(until_closed(sock))
    assert (status, headers["connection"], list(answer)) == (408, "close", ["error"])
    assert f"within {READ_TIMEOUT_S:g} s" in answer["error"], answer


def test_a_half_sent_body_is_answered_408_and_closed(front):
    before = requests_total(front.name)
    with front.connect() as sock:
        sock.sendall(f"POST /v2/models/{front.name}/infer HTTP/1.1\r\nHost: x\r\n"
                     f"Content-Length: 1000\r\n\r\n".encode() + infer_body()[:10])
        status, headers, answer = response(until_closed(sock))
    assert (status, headers["connection"]) == (408, "close")
    assert "10 bytes of its body" in answer["error"], answer
    assert requests_total(front.name) == before  # nothing reached the engine
    assert front.infer().tolist() == (X * 2 + 1).tolist()



def test_metrics_listen_on_loopback_by_default(front):
    listening = [c.laddr for c in psutil.Process(front.proc.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port != front.port]
    assert [a.ip for a in listening] == ["127.0.0.1"], listening


def test_http_workers_are_what_the_oom_killer_takes_first(front):
    def score(pid):
        with open(f"/proc/{pid}/oom_score_adj") as f:
            return int(f.read())
    (worker,) = front.workers()
    assert score(worker.pid) > max(score(p) for p in [*front.batchers, front.proc.pid])


def test_a_worker_raises_its_open_file_limit_to_the_hard_limit(front):
    (worker,) = front.workers()
    with open(f"/proc/{worker.pid}/limits") as f:
        line = next(line for line in f if line.startswith("Max open files"))
    soft, hard = line.split()[3:5]
    assert soft == hard == str(lower_soft_limit()[1]), line


def test_connections_beyond_the_cap_are_refused_503_at_once_while_earlier_ones_work(tmp_path):
    s = Serve(tmp_path, "--http-max-connections", "4", "--http-read-timeout-s", "600")
    held = [http.client.HTTPConnection("127.0.0.1", s.port, timeout=60) for _ in range(4)]
    try:
        for conn in held:
            conn.connect()
        with s.connect() as sock:  # the fifth: answered without a byte of a request
            status, headers, answer = response(until_closed(sock))
        assert (status, headers["connection"]) == (503, "close")
        assert "at most 4 open connections" in answer["error"], answer
        for conn in held:  # each earlier one still serves, and stays open
            conn.request("GET", "/v2/health/live")
            reply = conn.getresponse()
            assert (reply.status, json.loads(reply.read())) == (200, {"live": True})
        held.pop().close()  # one closes: a new one is served (once the worker has seen it go)
        wait_for(lambda: answered(s), "a new connection served after one of 4 closed", 60,
                 every_s=0.05)
    finally:
        for conn in held:
            conn.close()
        s.close()


def answered(s: Serve) -> bool:
    with s.connect() as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return response(until_closed(sock))[0] == 200


def test_descriptors_run_short_without_a_log_flood_and_the_front_goes_on(tmp_path):
    s = Serve(tmp_path, "--http-read-timeout-s", "600", nofile=(256, 256))
    socks = []
    try:
        for _ in range(300):  # more idle connections than the worker has descriptors
            socks.append(s.connect())
        replies = [until_closed(sock) for sock in socks[-60:]]  # beyond the default cap
        assert {response(r)[0] for r in replies} == {503}
        sock = socks[0]  # the first ones are open, and serve
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in socks:
            sock.close()
        s.close()
    lines = s.stderr().splitlines()
    assert len(lines) < 30, lines[:40]  # at most a line per kind per 10 s


def test_a_request_during_a_drain_is_refused_503_at_once(tmp_path, gate):
    s = Serve(tmp_path, backend=("--backend", "helpers:gated", "--backend-arg",
                                 f"gate={gate.name}"))
    held = s.connect()
    try:
        body = infer_body()
        held.sendall(f"POST /v2/models/{s.name}/infer HTTP/1.1\r\nHost: x\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: requests_total(s.name) == 1, "the held request queued", 60, every_s=0.05)
        s.proc.send_signal(signal.SIGTERM)  # the drain waits for the held request
        wait_for(lambda: "signal received; draining" in s.stderr(), "serve draining", 60,
                 every_s=0.05)
        deadline = time.monotonic() + CLOSED_WITHIN_S
        while True:  # until the worker has begun its drain (a request before it is served)
            with s.connect() as sock:
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers, answer = response(
                    until_closed(sock, max(0.1, deadline - time.monotonic())))
            if status != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert (status, headers["connection"]) == (503, "close"), answer
        assert "shutting down" in answer["error"], answer
        assert not select.select([held], [], [], 0)[0]  # the drain goes on meanwhile
        gate.open()
        status, _, answer = response(until_closed(held, 60))
        assert status == 200 and answer["outputs"][0]["data"] == (X * 2 + 1).tolist()
        assert s.proc.wait(60) == 0, s.stderr()
    finally:
        gate.open()
        held.close()
        s.close()


def logged_at(line: str) -> float:
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def test_a_worker_that_cannot_start_is_retried_later_and_later_while_serve_answers(tmp_path):
    s = Serve(tmp_path, "--http-workers", "2")
    path = f"/dev/shm{segment_name(s.name)}"
    away = f"{path}.away"
    failed = re.compile(r"HTTP worker \d did not start: ")
    retry = re.compile(r"HTTP worker \d .*(?:starting another|trying again) in ([\d.]+) s$")
    try:
        first, second = s.workers()
        os.rename(path, away)  # a new worker cannot attach to the engine
        try:
            first.kill()
            wait_for(lambda: len(failed.findall(s.stderr())) >= 2, "2 failed starts", 120,
                     every_s=0.05)
            assert second.is_running()
            assert s.infer().tolist() == (X * 2 + 1).tolist()  # the other worker serves
        finally:
            os.rename(away, path)
        tries = [line for line in s.stderr().splitlines() if retry.search(line)]
        delays = [float(retry.search(line).group(1)) for line in tries]
        # each delay twice the one before (the first one 1 s, unless the killed worker
        # had served for long: then its replacement started at once)
        assert len(delays) >= 2 and delays[0] in (1, 2), tries
        assert all(b == min(10, 2 * a) for a, b in zip(delays, delays[1:])), tries
        for (line, delay), later in zip(zip(tries, delays), tries[1:]):
            assert logged_at(later) - logged_at(line) >= delay - 0.01, tries
        wait_for(lambda: "started again" in s.stderr(), "the worker replaced", 120, every_s=0.05)
        assert len(s.workers()) == 2 and second.is_running()
        for k in range(8):  # either worker answers
            assert s.infer(X + k).tolist() == ((X + k) * 2 + 1).tolist()
    finally:
        s.close()
