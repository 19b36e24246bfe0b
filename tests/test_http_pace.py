"""The HTTP worker at the engine's pace: many streams at once each get their own
chunks, in order, through the writer that takes every chunk come in one wake of the
loop; a protocol's event writer (engine.http.events.EventStream) under any ASGI server writes
them through send and may end an answer early, which withdraws its request; an async
request whose awaiter is cancelled is withdrawn; and a keep-alive connection's later
request has a read timeout of its own, from its first byte; a followed stream whose
caller left hands out nothing more, and several runs followed as one are final once any is."""
import asyncio
import http.client
import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("uvicorn")
from conftest import unique_name, wait_for  # noqa: E402
from test_http_connections import CLOSED_WITHIN_S, READ_TIMEOUT_S, Serve  # noqa: E402
from test_http_connections import response, until_closed  # noqa: E402
from iterative_helpers import bits, scripted, wait_held, wait_left  # noqa: E402
from step_models import HOLD, chunks, request  # noqa: E402
from test_multi_engine import Served, table, top  # noqa: E402

import engine  # noqa: E402
from engine.http.events import EventStream, Finished, Follower, event  # noqa: E402
from engine.http.openai.several import Runs  # noqa: E402

STEPS = dict(input_shape=[2], input_dtype="int64", output_shape=[], output_dtype="int64")
X = np.arange(16, dtype=np.float32)


def events(url: str, path: str, body: dict) -> list:
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=json.dumps(body).encode())
        got = conn.getresponse()
        assert got.status == 200, got.read()
        return [json.loads(e[len("data: "):]) for e in got.read().decode().split("\n\n") if e]
    finally:
        conn.close()


def test_streams_at_once_each_get_their_own_chunks_in_order(tmp_path):
    name = unique_name("pace")
    served = Served(tmp_path, top(http_workers=1) + table(
        name, backend="serve_backends:counting", backend_args={"step_ms": 1.0},
        iterative=True, max_steps=256, max_batch_size=32, **STEPS), "--http-port", "0")
    try:
        asked = {k: (1000 * k, 20 + 7 * k) for k in range(24)}  # (start, chunks) each its own
        got: dict = {}

        def read(k):
            got[k] = events(served.url, f"/v2/models/{name}/generate_stream",
                            {"INPUT": list(asked[k])})

        threads = [threading.Thread(target=read, args=(k,)) for k in asked]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for k, (start, n) in asked.items():
            assert [e["OUTPUT"] for e in got[k]] == list(range(start, start + n)), k
            assert [e.get("finish_reason") for e in got[k]] == [None] * (n - 1) + ["stop"], k
    finally:
        served.stop()


class Numbers(EventStream):
    """Each chunk as `data: N`; the answer ends at `last`, however long it runs."""

    def __init__(self, chunks, last, *args) -> None:
        super().__init__(chunks, *args)
        self.last = last

    def events(self, block, finish_reason) -> bytes:
        body = b""
        for value in block.tolist():
            body += event(str(value).encode())
            if value == self.last:
                raise Finished(body, "stop")
        return body

    def end(self, finish_reason: str) -> bytes:
        return event(f"[{finish_reason}]".encode())


def test_an_event_writer_through_send_may_end_an_answer_early_which_withdraws_it(
        make_engine, log):
    eng = scripted(make_engine, "writer", log, max_steps=256, model={"step_ms": 2.0})
    sent: list = []

    async def main(c):
        forever = asyncio.Event()

        async def receive():  # the caller stays until the answer ends
            await forever.wait()

        async def send(message):
            sent.append(message)

        stream = c.open_stream_async(request(3, 200), timeout=60)
        last = chunks(3, 10)[-1]
        await Numbers(stream, last, {"type": "http"}, receive, send, 60.0).run()

    with engine.Client(eng.name) as c:
        asyncio.run(main(c))
    assert sent[0]["status"] == 200 and not sent[-1].get("more_body")
    text = b"".join(m["body"] for m in sent[1:]).decode()
    assert text == "".join(f"data: {v}\n\n" for v in chunks(3, 10)) + "data: [stop]\n\n"
    wait_for(lambda: eng.stats()["withdrawn_total"] == 1, "the rest of the answer withdrawn")


def test_a_cancelled_async_request_is_withdrawn(make_engine, gate):
    eng = make_engine("cancelled", backend="helpers:gated", backend_args={"gate": gate.name},
                      max_batch_size=1)

    async def main(c):
        held = asyncio.ensure_future(c.infer_async(X, timeout=60))  # its batch waits at the gate
        await asyncio.sleep(0)  # enqueued
        wait_for(lambda: eng.stats()["queue_depth"] == 0, "the first request claimed")
        queued = asyncio.ensure_future(c.infer_async(X + 1, timeout=60))
        await asyncio.sleep(0)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        wait_for(lambda: eng.stats()["withdrawn_total"] == 1, "the withdrawal counted")
        gate.open()
        return await held

    with engine.Client(eng.name) as c:
        assert np.array_equal(asyncio.run(main(c)), X * 2 + 1)
        assert np.array_equal(c.infer(X + 2, timeout=60), (X + 2) * 2 + 1)
    stats = eng.stats()
    assert (stats["answered_total"], stats["withdrawn_total"], stats["requests_total"]) == (2, 1, 3)


def test_a_followed_stream_whose_caller_left_hands_out_nothing_more(make_engine, log, gate):
    # chunks came unread when the caller left: the follower reads them no more (an
    # answer whose chunks came on at every wake would otherwise run to its end)
    eng = scripted(make_engine, "follow-gone", log, gate=gate)
    left_now = asyncio.Event()

    async def receive():
        await left_now.wait()
        return {"type": "http.disconnect"}

    async def main(c):
        follower = Follower(c.open_stream_async(request(1, 10, HOLD, bits(2)), timeout=60),
                            receive)
        try:
            wait_held(log, 1, 2)  # chunks 0 and 1 are out, unread
            left_now.set()
            await asyncio.wait_for(asyncio.shield(follower.gone), 30)
            return await asyncio.wait_for(follower.next(), 30)
        finally:
            await follower.close()

    with engine.Client(eng.name) as c:
        assert asyncio.run(main(c)) is None
        wait_for(lambda: eng.stats()["withdrawn_total"] == 1, "the request withdrawn")
    gate.open()
    assert wait_left(log, 1) == [3]


def test_a_later_request_on_a_kept_connection_has_its_own_read_timeout(tmp_path):
    s = Serve(tmp_path, "--http-read-timeout-s", str(READ_TIMEOUT_S))
    try:
        with s.connect() as sock:
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head or not head.endswith(b"}"):
                head += sock.recv(1 << 16)
            assert head.startswith(b"HTTP/1.1 200"), head
            time.sleep(READ_TIMEOUT_S * 0.6)  # idle on the kept connection, under its timeout
            sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")  # never ends
            began = time.monotonic()
            status, headers, answer = response(until_closed(sock, CLOSED_WITHIN_S))
            assert time.monotonic() - began >= READ_TIMEOUT_S * 0.9  # from its own first byte
        assert (status, headers["connection"]) == (408, "close")
        assert "part of its head" in answer["error"], answer
        assert s.infer().tolist() == (X * 2 + 1).tolist()
    finally:
        s.close()


class _Run:
    """A run's stream as several.Runs follows it: final once failed or ended."""

    def __init__(self) -> None:
        self.final, self.on_wake, self.prompt_logprobs = False, None, None


@pytest.mark.parametrize("failed", [0, 1])
def test_several_runs_are_final_once_any_run_is_so_a_wait_never_outlasts_its_error(failed):
    # a run failed by its completer wakes the runs once; the wait after the
    # chunks read on that wake must return at once, or nothing would wake it
    async def main():
        runs = [_Run(), _Run()]
        followed = Runs(runs)
        assert not followed.final
        runs[failed].final = True
        assert followed.final
        await asyncio.wait_for(followed.wait(), 5)  # returns at once
    asyncio.run(main())
