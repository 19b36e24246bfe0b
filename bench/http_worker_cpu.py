"""CPU time of the HTTP worker per streamed chunk and per one-row JSON infer.

    python bench/http_worker_cpu.py [--tree DIR] [--streams 1,16,64] [--chunks 200]
                                    [--step-ms 2] [--seconds 5] [--infers 4000]
                                    [--concurrency 1,16] [--repeat 3] [--floor]
                                    [--idle-spin-us US] [--grpc]

`shmbatch serve --config` with one HTTP worker and two engines: an iterative
counting model (a request (start, n) answers start, start + 1, ... n chunks,
each step sleeping --step-ms, so the batcher takes no CPU from the worker)
and a one-shot identity engine (float32[16]). This process is the caller, on
raw keep-alive sockets: S streams at once through generate_stream, each
re-sent as soon as it ends, then C connections each sending its next
one-row infer once answered. Every answer is checked against its own
request (0 wrong, or the run fails). The figure is the worker's CPU time
(its threads' run time, /proc/PID/task/*/schedstat; the user/system split
from psutil's 10 ms ticks) over the run, less its idle rate (measured first:
uvicorn's ticks, the client's threads), divided by the chunks or requests;
the median of --repeat runs; an infer row also gives the identity engine's
batcher's CPU a request in that run. How many streams share a wake of the worker
(one per engine step) sets the cost of a chunk: each row says its rate.
--tree: another source tree of shmbatch (its engine/_ringc built), e.g. a
worktree of an earlier commit (without --idle-spin-us, which it may lack).
--idle-spin-us: how long the engines' batchers spin after a batch before
they sleep (their idle_spin_us). --floor: also the same infer rows against
uvicorn (httptools, one worker) running a minimal ASGI app that answers an
infer by echoing its input (json.loads, json.dumps; no engine): the cost of
uvicorn and a JSON round trip alone, measured the same way; and the same
stream rows against it streaming generate_stream's events on its own loop's
timer every --step-ms (asyncio.sleep: no engine, no other process to wake
it): what a chunk costs uvicorn alone, one stream against many; and the
infer rows once more, that app's echo answered by serve's identity engine
(Client.infer_async, nothing of the front): uvicorn, JSON and the engine's
round trip alone; then both infer rows against a server with no ASGI layer
(Direct: an asyncio protocol on httptools alone). --grpc: also
the infer rows as ModelInfer calls (tritonclient.grpc.aio, C callers on one
channel) to the same worker's gRPC server (serve --grpc-port).
"""
import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = pathlib.Path(__file__).resolve().parent.parent
HERE = pathlib.Path(__file__).resolve().parent
IDLE_S = 2.0


class Counting:
    """A step model (the batcher imports it from this file): (start, n) answers
    start, start + 1, ... n chunks; each step sleeps step_ms."""

    def __init__(self, step_ms: float) -> None:
        self.step_s = step_ms / 1000
        self.state: dict = {}

    def join(self, ids, batch, lengths=None) -> None:
        for i, (start, n) in zip(ids.tolist(), batch.tolist()):
            self.state[i] = [start, n]

    def step(self, ids):
        import numpy as np
        if self.step_s:
            time.sleep(self.step_s)
        out, done = np.empty(len(ids), np.int64), np.zeros(len(ids), bool)
        for k, i in enumerate(ids.tolist()):
            s = self.state[i]
            out[k], s[0], s[1] = s[0], s[0] + 1, s[1] - 1
            done[k] = s[1] == 0
        return out, done

    def leave(self, ids) -> None:
        for i in ids.tolist():
            self.state.pop(i, None)


async def request_body(receive) -> bytes:
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    return body


def echoed(x: dict, data: list) -> bytes:
    """The JSON answer to infer input x, its data `data`."""
    return json.dumps({"model_name": "echo", "model_version": "1", "outputs": [
        {"name": "OUTPUT", "datatype": x["datatype"], "shape": x["shape"], "data": data}]},
        separators=(",", ":")).encode()


_CLIENT: list = []  # the --floor servers' Client of FLOOR_ENGINE, attached at its first infer


async def through_engine(x: dict) -> list:
    """Input x's data answered by the engine FLOOR_ENGINE names
    (Client.infer_async), as the worker's route has it answered, with nothing
    of the front (no routing, checks, limits or guard)."""
    import numpy as np
    if not _CLIENT:
        from engine import Client
        _CLIENT.append(Client(os.environ["FLOOR_ENGINE"]))
    got = await _CLIENT[0].infer_async(np.array(x["data"], np.float32).reshape(x["shape"][1:]),
                                       30.0)
    return got.ravel().tolist()


async def echo(scope, receive, send) -> None:
    """The --floor app: an infer answered with its own input, as the engine's
    identity would (through_engine() for those to /v2/models/engine/)."""
    x = json.loads(await request_body(receive))["inputs"][0]
    engine = scope["path"].startswith("/v2/models/engine/")
    out = echoed(x, await through_engine(x) if engine else x["data"])
    await send({"type": "http.response.start", "status": 200, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})


async def ticker(scope, receive, send) -> None:
    """The --floor app for streams: generate_stream's events, one every
    --step-ms on the loop's own timer (no engine, no wake from another process)."""
    start, n = json.loads(await request_body(receive))["INPUT"]
    step_s = float(os.environ.get("FLOOR_STEP_MS", "2")) / 1000
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    for i in range(n):
        await asyncio.sleep(step_s)
        event = {"model_name": "ticker", "model_version": "1", "OUTPUT": start + i}
        if i == n - 1:
            event["finish_reason"] = "stop"
        await send({"type": "http.response.body", "more_body": True,
                    "body": b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"})
    await send({"type": "http.response.body", "body": b""})


async def floor_app(scope, receive, send) -> None:
    """echo() for infers, ticker() for generate_stream."""
    if scope["type"] != "http":
        return
    if scope["path"].endswith("/generate_stream"):
        return await ticker(scope, receive, send)
    return await echo(scope, receive, send)


class Direct(asyncio.Protocol):
    """The --floor's server with no ASGI layer: an asyncio protocol on httptools
    alone answering each infer (keep-alive, one at a time a connection) by
    echoing its input, or through the engine FLOOR_ENGINE names for those to
    /v2/models/engine/ (a task a request): what uvicorn's own per-request work
    adds to a JSON round trip, and what a server of no layers pays for the engine's."""

    def connection_made(self, transport) -> None:
        import httptools
        self.transport, self.parser = transport, httptools.HttpRequestParser(self)
        self.url, self.body = b"", []

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        x = json.loads(b"".join(self.body))["inputs"][0]
        url, self.url, self.body = self.url, b"", []
        if url.startswith(b"/v2/models/engine/"):
            task = asyncio.get_running_loop().create_task(self.answer_through_engine(x))
            _TASKS.add(task)  # held until done: the loop keeps only weak references
            task.add_done_callback(_TASKS.discard)
        else:
            self.answer(echoed(x, x["data"]))

    async def answer_through_engine(self, x: dict) -> None:
        self.answer(echoed(x, await through_engine(x)))

    def answer(self, out: bytes) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%b" % (len(out), out))


_TASKS: set = set()  # Direct's requests through the engine


def serve_direct(port: int) -> None:
    """Runs Direct on 127.0.0.1:port (uvloop, as uvicorn runs) until killed."""
    import uvloop

    async def forever() -> None:
        server = await asyncio.get_running_loop().create_server(Direct, "127.0.0.1", port)
        await server.serve_forever()
    uvloop.install()
    asyncio.run(forever())


def started(command: list, env: dict) -> tuple:
    """(the server process, its port) once it takes connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([*command, str(port)], env=env, cwd="/tmp")
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                server.wait(60)
                raise RuntimeError(f"{command} did not start")
            time.sleep(0.05)


@contextlib.contextmanager
def floor_server(command: list, env: dict, what: str):
    """(the server's process, its idle CPU a second, its port) of a --floor
    server, started and warmed (echo and engine), its rows' heading printed;
    stopped after."""
    server, port = started(command, env)
    try:
        worker = psutil.Process(server.pid)
        asyncio.run(infers(("127.0.0.1", port), "echo", 4, 400))
        asyncio.run(infers(("127.0.0.1", port), "engine", 4, 400))
        idle_per_s = idle_rate(worker.pid)
        print(f"{what}, pid {worker.pid}, idle {idle_per_s * 1e6:,.0f} µs of CPU a second "
              f"(subtracted):")
        yield worker, idle_per_s, port
    finally:
        server.terminate()
        server.wait(60)


def floor_rows(args, env: dict, engine: str) -> None:
    """The stream and infer rows against uvicorn serving floor_app(), the
    infer rows again through the running engine `engine`, then both infer
    rows against Direct."""
    env = {**env, "FLOOR_STEP_MS": str(args.step_ms), "FLOOR_ENGINE": engine}
    with floor_server([sys.executable, "-m", "uvicorn", "http_worker_cpu:floor_app",
                       "--app-dir", str(HERE), "--http", "httptools", "--log-level", "warning",
                       "--no-access-log", "--port"], env,
                      "floor: uvicorn + a minimal JSON echo app and a timer's stream") as (
                          worker, idle_per_s, port):
        for count in (int(c) for c in args.streams.split(",")):
            print(f"  generate_stream, {count:3d} streams at once, {args.chunks} chunks each, step "
                  f"{args.step_ms:g} ms (asyncio.sleep), per chunk: " + rows(
                      worker, idle_per_s, args.repeat, lambda: asyncio.run(streams(
                          ("127.0.0.1", port), "ticker", count, args.chunks,
                          time.monotonic() + args.seconds))))
        infer_rows(args, worker, idle_per_s, port)
    with floor_server([sys.executable, str(pathlib.Path(__file__).resolve()), "--serve-direct"],
                      env, "floor with no ASGI layer: an asyncio protocol on httptools alone") as (
                          worker, idle_per_s, port):
        infer_rows(args, worker, idle_per_s, port)


def infer_rows(args, worker, idle_per_s: float, port: int) -> None:
    """A floor server's infer rows: echoed, then through the engine."""
    for how, name in (("", "echo"), (" through the engine (Client.infer_async),", "engine")):
        for count in (int(c) for c in args.concurrency.split(",")):
            print(f"  infer, one row, {count:3d} connections,{how} per request: " + rows(
                worker, idle_per_s, args.repeat,
                lambda: asyncio.run(infers(("127.0.0.1", port), name, count, args.infers))))


def counting(step_ms: float = 2.0) -> Counting:
    return Counting(step_ms)


def config(gen: str, one: str, step_ms: float, idle_spin_us=None) -> str:
    spin = "" if idle_spin_us is None else f"idle_spin_us = {idle_spin_us}\n"
    return (f'http_workers = 1\n'
            f'[engines."{gen}"]\nbackend = "http_worker_cpu:counting"\n'
            f'backend_args = {{step_ms = {step_ms}}}\niterative = true\nmax_steps = 65536\n'
            f'input_shape = [2]\ninput_dtype = "int64"\noutput_shape = []\n'
            f'output_dtype = "int64"\nmax_batch_size = 64\nqueue_capacity = 256\n{spin}'
            f'[engines."{one}"]\nbackend = "engine.backends:identity"\ninput_shape = [16]\n'
            f'output_shape = [16]\nmax_batch_size = 64\nmax_delay_ms = 0.0\n'
            f'queue_capacity = 256\n{spin}')


async def response(reader):
    """(status, body) of one HTTP/1.1 response (content-length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    if length:
        return status, await reader.readexactly(int(length.group(1)))
    body = bytearray()
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return status, bytes(body)
        body += data[:-2]


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


async def streams(address, name: str, count: int, chunks: int, until: float) -> int:
    """count callers, each re-sending its stream until `until`; the chunks read."""
    async def caller(k: int) -> int:
        reader, writer = await asyncio.open_connection(*address)
        got, i = 0, 0
        try:
            while time.monotonic() < until:
                start = (k * 1_000_003 + i * 7919) % (1 << 40)
                i += 1
                writer.write(post(f"/v2/models/{name}/generate_stream",
                                  json.dumps({"INPUT": [start, chunks]}).encode()))
                status, body = await response(reader)
                events = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e]
                values = [e["OUTPUT"] for e in events]
                if status != 200 or values != list(range(start, start + chunks)) \
                        or events[-1].get("finish_reason") != "stop":
                    raise AssertionError(f"stream ({start}, {chunks}): got {status} {body[:200]!r}")
                got += chunks
        finally:
            writer.close()
        return got

    return sum(await asyncio.gather(*(caller(k) for k in range(count))))


async def infers(address, name: str, count: int, total: int) -> int:
    """count connections sending one-row infers until total are answered."""
    left = [total]

    async def caller(k: int) -> int:
        reader, writer = await asyncio.open_connection(*address)
        done = 0
        try:
            while left[0] > 0:
                left[0] -= 1
                x = [float(k * 100_000 + left[0] % 100_000) + j / 4 for j in range(16)]
                writer.write(post(f"/v2/models/{name}/infer", json.dumps(
                    {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 16],
                                 "data": x}]}).encode()))
                status, body = await response(reader)
                out = json.loads(body)["outputs"][0] if status == 200 else None
                if out is None or out["data"] != x or out["shape"] != [1, 16]:
                    raise AssertionError(f"infer of {x[:2]}...: got {status} {body[:200]!r}")
                done += 1
        finally:
            writer.close()
        return done

    return sum(await asyncio.gather(*(caller(k) for k in range(count))))


async def grpc_infers(target: str, name: str, count: int, total: int) -> int:
    """count callers on one channel sending one-row ModelInfers until total are answered."""
    import numpy as np
    import tritonclient.grpc.aio as grpcclient
    left = [total]
    client = grpcclient.InferenceServerClient(target)

    async def caller(k: int) -> int:
        done = 0
        while left[0] > 0:
            left[0] -= 1
            x = (np.arange(16, dtype=np.float32) / 4 + k * 100_000 + left[0] % 100_000)[None]
            given = grpcclient.InferInput("INPUT", [1, 16], "FP32")
            given.set_data_from_numpy(x)
            out = (await client.infer(name, [given])).as_numpy("OUTPUT")
            if out is None or not np.array_equal(out, x):
                raise AssertionError(f"ModelInfer of {x[0, :2]}...: got {out!r}")
            done += 1
        return done

    try:
        return sum(await asyncio.gather(*(caller(k) for k in range(count))))
    finally:
        await client.close()


def cpu_s(proc: psutil.Process) -> float:
    """The process's CPU time (user + system, its threads' that ended included)."""
    t = proc.cpu_times()
    return t.user + t.system


def threads_cpu_s(pid: int) -> float:
    """Its live threads' CPU time, to the nanosecond (/proc/PID/task/*/schedstat)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass
    return total / 1e9


def idle_rate(pid: int) -> float:
    """CPU seconds a second the process spends with nothing asked of it (over IDLE_S)."""
    began = threads_cpu_s(pid)
    time.sleep(IDLE_S)
    return (threads_cpu_s(pid) - began) / IDLE_S


def measure(worker, idle_per_s: float, run, batcher=None) -> tuple:
    """(µs of the worker's CPU per unit net of idle, of it in user and system
    mode, units, seconds, µs of the batcher's CPU per unit or None) of run()."""
    t0, c0, began = worker.cpu_times(), threads_cpu_s(worker.pid), time.monotonic()
    b0 = threads_cpu_s(batcher) if batcher else 0.0
    units = run()
    spent = time.monotonic() - began
    t1, c1 = worker.cpu_times(), threads_cpu_s(worker.pid)
    user, system = t1.user - t0.user, t1.system - t0.system  # in 10 ms ticks
    per = (c1 - c0 - idle_per_s * spent) / units * 1e6  # to the ns
    theirs = (threads_cpu_s(batcher) - b0) / units * 1e6 if batcher else None
    return per, user / units * 1e6, system / units * 1e6, units, spent, theirs


def rows(worker, idle_per_s: float, repeat: int, run, batcher=None) -> str:
    """The median of `repeat` runs, with the range and the user/system split
    (and the batcher's CPU a unit in that run, given its pid)."""
    got = sorted((measure(worker, idle_per_s, run, batcher) for _ in range(repeat)),
                 key=lambda m: m[0])
    per, user, system, units, spent, theirs = got[len(got) // 2]
    spread = f" (of {repeat}: {got[0][0]:.1f}..{got[-1][0]:.1f})" if repeat > 1 else ""
    also = f"; batcher {theirs:.1f} µs" if theirs is not None else ""
    return (f"{per:6.1f} µs{spread}; user {user:.1f} + system {system:.1f}; "
            f"{units / spent:,.0f}/s{also}")


def main() -> int:
    if sys.argv[1:2] == ["--serve-direct"]:  # the --floor's Direct server, in its own process
        serve_direct(int(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=pathlib.Path, default=ROOT)
    p.add_argument("--streams", default="1,16,64", help="streams at once, per row")
    p.add_argument("--chunks", type=int, default=200, help="chunks per stream")
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=5.0, help="of each stream row")
    p.add_argument("--infers", type=int, default=4000, help="requests per infer row")
    p.add_argument("--concurrency", default="1,16", help="infer connections, per row")
    p.add_argument("--repeat", type=int, default=3, help="runs of each row (the median shown)")
    p.add_argument("--floor", action="store_true", help="also uvicorn with a minimal echo app")
    p.add_argument("--grpc", action="store_true", help="also the infer rows over gRPC "
                   "(tritonclient.grpc.aio), the worker's gRPC server")
    p.add_argument("--idle-spin-us", type=float, help="the engines' idle_spin_us (default: "
                   "theirs)")
    args = p.parse_args()
    tree = args.tree.resolve()
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
    gen, one = f"cpugen{os.getpid()}", f"cpuone{os.getpid()}"
    with tempfile.TemporaryDirectory() as folder:
        path = pathlib.Path(folder) / "models.toml"
        path.write_text(config(gen, one, args.step_ms, args.idle_spin_us))
        grpc = ["--grpc-port", "0"] if args.grpc else []
        serve = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--config", str(path),
                                  "--http-port", "0", *grpc, "--log-level", "WARNING"],
                                 stdout=subprocess.PIPE, text=True, env=env, cwd=folder)
        try:
            code = run(args, tree, serve, gen, one)
            if args.floor:  # beside serve: its identity engine answers the floor's too
                floor_rows(args, env, one)
        finally:
            serve.terminate()
            serve.wait(60)
    return code


def run(args, tree, serve, gen: str, one: str) -> int:
    said = ""
    for line in serve.stdout:
        said += line
        if "ready" in line:
            break
    else:
        raise RuntimeError("serve exited before it was ready")
    host, port = re.search(r"http://(\S+?)(?: and gRPC |$)", line.strip()).group(1).rsplit(":", 1)
    address = (host, int(port))
    worker = next(c for c in psutil.Process(serve.pid).children(recursive=True)
                  if "engine.http.worker" in " ".join(c.cmdline()))
    # warm: both paths once, then the idle rate (uvicorn's ticks, the client's threads)
    asyncio.run(streams(address, gen, 2, 20, time.monotonic() + 0.5))
    asyncio.run(infers(address, one, 4, 400))
    idle_per_s = idle_rate(worker.pid)
    print(f"{tree}: HTTP worker pid {worker.pid}, idle {idle_per_s * 1e6:,.0f} µs of CPU a "
          f"second (subtracted); µs of its CPU per unit, median of {args.repeat}:")
    for count in (int(c) for c in args.streams.split(",")):
        print(f"  generate_stream, {count:3d} streams at once, {args.chunks} chunks each, step "
              f"{args.step_ms:g} ms, per chunk: " + rows(worker, idle_per_s, args.repeat,
                                                         lambda: asyncio.run(streams(
                                                             address, gen, count, args.chunks,
                                                             time.monotonic() + args.seconds))))
    # the one-shot engine's batcher: what the worker's requests cost it too
    named = re.search(rf"'{one}' \(batchers \[(\d+)", said)
    if named is None:
        raise RuntimeError(f"serve's ready line names no batcher of {one!r}: {said!r}")
    batcher = int(named.group(1))
    for count in (int(c) for c in args.concurrency.split(",")):
        print(f"  infer, one row, {count:3d} connections, per request: " + rows(
            worker, idle_per_s, args.repeat,
            lambda: asyncio.run(infers(address, one, count, args.infers)), batcher))
    for count in (int(c) for c in args.concurrency.split(",")) if args.grpc else ():
        at = re.search(r"gRPC (\S+)$", said.strip())
        if at is None:
            raise RuntimeError(f"serve named no gRPC address: {said!r}")
        print(f"  ModelInfer (gRPC), one row, {count:3d} callers, per request: " + rows(
            worker, idle_per_s, args.repeat,
            lambda: asyncio.run(grpc_infers(at.group(1), one, count, args.infers)), batcher))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
