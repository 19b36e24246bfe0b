"""The decoder bench's rows over HTTP (`shmbatch bench --model decoder --http --baseline`).

The same seeded open-loop arrivals as the bench's other rows, on the same
iterative decoder engine, sent by a third-party client (aiohttp) that reads
the answers as server-sent events, one event a token:

- generate_stream: the engine served by a real `shmbatch serve --http-port`
  process and its HTTP worker(s), through Triton's
  POST /v2/models/NAME/generate_stream;
- openai: the same, through POST /v1/completions with "stream": true (the
  prompt as token ids, max_tokens as max_steps); tokenizer() writes each
  token id as " ID", so the text gives back every token. The row is skipped,
  with a note, when the route is not there (404) or serve does not start
  with the engine's openai table;
- fastapi: bench/fastapi_stream_baseline.py, a FastAPI + StreamingResponse
  server doing the same model work in its own process, on the
  generate_stream body, with continuous batching of its own;
- fastapi_b1: the same server calling the model for one request at a time
  (its --max-batch-size 1), as a server without batching does.

A row returns each request's answer for the caller to check against the model
decoding that request alone, the engine's figures, and the CPU time the
serving processes spent per chunk (psutil: their CPU time across the row): the
HTTP workers' for serve, the whole process's for the baseline (its model
included). With `pin`, the model runs on the last CPU and the rest on the
others: serve's batcher is pinned there (its engine's `cpus`), its
supervisor and HTTP workers run beside the clients, as a web app's workers
run beside a batcher pinned to its core (and as the `Client` row's callers
do); the baseline's one process, its model inside, runs on the last CPU.
"""
import asyncio
import dataclasses
import json
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import List, Optional

import numpy as np
import psutil

from engine.shm import ring
from engine.tools import load as loads

GENERATE, OPENAI, FASTAPI, FASTAPI_B1 = "generate_stream", "openai", "fastapi", "fastapi_b1"
ROWS = (GENERATE, OPENAI, FASTAPI, FASTAPI_B1)
BASELINES = {FASTAPI: None, FASTAPI_B1: 1}  # row: its --max-batch-size (None: the engine's)
ROOT = pathlib.Path(__file__).resolve().parents[2]
BASELINE = ROOT / "bench" / "fastapi_stream_baseline.py"
START_S = 120.0
STOP_S = 60.0


class Tokens:
    """The decoder's tokenizer for the OpenAI route: token id 17 is the text " 17"."""

    eos_token_id = None

    def encode(self, text: str) -> List[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return "".join(f" {int(i)}" for i in ids)


def tokenizer() -> Tokens:
    """The factory an engine's [engines.NAME.openai] table names."""
    return Tokens()


def check(rows) -> None:
    """RuntimeError before anything runs if a row asked for cannot run here."""
    if not rows:
        return
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise RuntimeError("the HTTP rows read their streams with aiohttp: pip install aiohttp"
                           ) from None
    if set(BASELINES) & set(rows) and not BASELINE.exists():
        raise RuntimeError(f"the fastapi rows run {BASELINE}, which is not there (it lives in "
                           f"the repository, not the package)")


# -- where processes run --------------------------------------------------------------

def server_cpus(pin: bool) -> Optional[List[int]]:
    """The serving side's CPUs: the last one, when pinning and there are two or more."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[-1]] if pin and len(cpus) > 1 else None


def client_cpus(pin: bool) -> Optional[List[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[:-1] if pin and len(cpus) > 1 else None


# -- the servers ----------------------------------------------------------------------

def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return '"none"'  # a variable dim
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"


def serve_config(settings: dict, http_workers: int, timeout_s: float, openai: bool) -> str:
    """serve's config of one engine (Engine's keyword arguments), its HTTP
    front, and with `openai` the engine's openai table."""
    name = settings["name"]
    text = f"http_workers = {http_workers}\nhttp_timeout_s = {float(timeout_s)!r}\n"
    text += f"[engines.{json.dumps(name)}]\n" + "".join(
        f"{k} = {_toml(v)}\n" for k, v in settings.items() if k != "name")
    if openai:
        text += (f"[engines.{json.dumps(name)}.openai]\n"
                 f"tokenizer = \"engine.tools.decoder_http:tokenizer\"\nmodel = {json.dumps(name)}\n")
    return text


class Server:
    """A serving process started from `command`, until stop(): `url` once it
    said it is ready, `pids` the processes whose CPU a row counts."""

    def __init__(self, command: list, cpus: Optional[List[int]], folder: str) -> None:
        self.out_path = os.path.join(folder, "server.out")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
        with open(self.out_path, "w") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        try:
            self.url = self._await_ready()
        except BaseException:
            self.stop()
            raise
        self.pids: List[int] = [self.proc.pid]

    def _await_ready(self) -> str:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            with open(self.out_path) as f:
                for line in f:
                    if "ready" in line and "http://" in line:
                        return "http://" + line.split("http://", 1)[1].split()[0].rstrip("/")
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.proc.args[1:4]} exited ({self.proc.returncode}) "
                                   f"before it was ready: {self.output()[-2000:]}")
            time.sleep(0.05)  # a poll of its output file
        raise RuntimeError(f"not ready within {START_S:g} s: {self.output()[-2000:]}")

    def output(self) -> str:
        with open(self.out_path) as f:
            return f.read()

    def cpu_s(self) -> float:
        total = 0.0
        for pid in self.pids:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(STOP_S)


def start_serve(settings: dict, setup, openai: bool, folder: str) -> Server:
    path = os.path.join(folder, "models.toml")
    with open(path, "w") as f:
        f.write(serve_config(settings, setup.http_workers, setup.timeout_s, openai))
    # settings' cpus (decoder_bench) pin the batcher; serve, its HTTP workers
    # with it, runs beside the clients
    server = Server([sys.executable, "-m", "engine", "serve", "--config", path,
                     "--http-port", "0"], client_cpus(setup.pin), folder)
    workers = [c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)
               if "engine.http.worker" in " ".join(_cmdline(c))]
    if len(workers) != setup.http_workers:
        server.stop()
        raise RuntimeError(f"expected {setup.http_workers} HTTP worker(s) under serve, found "
                           f"{len(workers)}")
    server.pids = workers
    return server


def start_baseline(settings: dict, setup, folder: str, max_batch_size: Optional[int]) -> Server:
    return Server([sys.executable, str(BASELINE), "--port", "0", "--name", settings["name"],
                   "--model", json.dumps(settings["backend_args"]),
                   "--max-batch-size", str(max_batch_size or settings["max_batch_size"]),
                   "--max-steps", str(settings["max_steps"]),
                   "--max-prompt", str(settings["max_input_shape"][0])],
                  server_cpus(setup.pin), folder)


def _cmdline(proc) -> list:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _post(url: str, body: dict, timeout_s: float = 30.0):
    """(status, the answer's text) of one POST."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def openai_absent(url: str, model: str) -> Optional[str]:
    """Why the /v1/completions route cannot carry the row (None: it answers)."""
    status, text = _post(f"{url}/v1/completions", {"model": model, "prompt": [1], "max_tokens": 1})
    return None if status == 200 else f"POST /v1/completions answered {status}: {text[:200]}"


def _engine_stats(name: str) -> dict:
    from engine.segment import Segment
    from engine.serving import metrics
    seg = Segment.attach(name)
    try:
        return metrics.read_stats(seg)
    finally:
        seg.close()


# -- a client process -----------------------------------------------------------------

class StreamFailed(Exception):
    """An answer that did not come whole: an error status, an error event, a cut stream."""


def request_of(kind: str, model: str, prompt: np.ndarray, steps: int, timeout_s: float):
    """(path, JSON body) of one request."""
    if kind == OPENAI:
        return "/v1/completions", {"model": model, "prompt": prompt.tolist(), "max_tokens": steps,
                                   "stream": True}
    return f"/v2/models/{model}/generate_stream", {
        "INPUT": prompt.tolist(),
        "parameters": {"max_steps": steps, "timeout": int(timeout_s * 1e6)}}


async def read_events(kind: str, lines, times: list, tokens: list) -> str:
    """Reads a stream's events (an async iterator of lines) into times and
    tokens; its finish_reason, or StreamFailed if it did not end whole."""
    finish, done = None, False
    async for line in lines:
        if not line.startswith(b"data: "):
            continue
        now = ring.now_ns()
        data = line[6:].strip()
        if data == b"[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            raise StreamFailed(json.dumps(event["error"])[:300])
        if kind == OPENAI:
            choice = event["choices"][0]
            ids = [int(t) for t in choice["text"].split()]
            finish = choice.get("finish_reason") or finish
        else:
            ids = [int(event["OUTPUT"])]
            finish = event.get("finish_reason") or finish
        tokens.extend(ids)
        times.extend([now] * len(ids))
    if finish is None or (kind == OPENAI and not done):
        raise StreamFailed(f"the stream ended without {'[DONE]' if finish else 'a finish_reason'}"
                           f" after {len(tokens)} token(s)")
    return finish


def _client(url: str, kind: str, model: str, requests: list, timeout_s: float,
            cpus: Optional[List[int]], conn) -> None:
    """Sends its requests at their scheduled times (open loop, asyncio, one
    aiohttp session) and reports, per request, what decoder_bench's clients do:
    index, scheduled, first chunk, end (ns), gaps between chunks, tokens (or the error)."""
    import aiohttp
    loads.fine_timer_slack()
    if cpus:
        os.sched_setaffinity(0, cpus)
    conn.send("ready")
    start_ns = conn.recv()

    async def one(session, index, offset_ns, prompt, steps):
        scheduled = start_ns + offset_ns
        delay = (scheduled - ring.now_ns()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)
        path, body = request_of(kind, model, prompt, steps, timeout_s)
        times: list = []
        tokens: list = []
        try:
            async with session.post(url + path, json=body) as answer:
                if answer.status != 200:
                    raise StreamFailed(f"HTTP {answer.status}: {(await answer.text())[:300]}")
                await read_events(kind, answer.content, times, tokens)
            if not tokens:
                raise StreamFailed("no token came")
        except Exception as e:
            return (index, scheduled, 0, ring.now_ns(), [], f"{type(e).__name__}: {e}")
        return (index, scheduled, times[0], times[-1], np.diff(times).tolist(), tokens)

    async def main():
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=timeout_s + 30)) as session:
            return await asyncio.gather(*(one(session, *r) for r in requests))

    conn.send(asyncio.run(main()))


# -- a row ----------------------------------------------------------------------------

@dataclasses.dataclass
class Row:
    results: list
    stats: dict
    server_cpu_s: float
    chunks: int

    @property
    def cpu_us_per_chunk(self) -> float:
        return self.server_cpu_s / max(1, self.chunks) * 1e6


def run_row(kind: str, setup, settings: dict, rate: float, offered: list, row: int):
    """One row of `kind` (an iterative engine's `settings`, these requests at
    `rate`): a Row, or a string saying why the row was skipped."""
    offsets = loads.poisson_offsets_ns(rate, len(offered), setup.seed + row)
    with tempfile.TemporaryDirectory(prefix="shmbatch-bench-http-") as folder:
        if kind in BASELINES:
            server = start_baseline(settings, setup, folder, BASELINES[kind])
        else:
            try:
                server = start_serve(settings, setup, kind == OPENAI, folder)
            except RuntimeError as e:
                if kind != OPENAI:
                    raise
                return f"serve did not start with the engine's openai table: {str(e)[-300:]}"
        try:
            why = openai_absent(server.url, settings["name"]) if kind == OPENAI else None
            if why is not None:
                return why
            results, cpu_s = _drive(server, kind, settings["name"], setup, offered, offsets)
            stats = _engine_stats(settings["name"]) if kind not in BASELINES else json.loads(
                urllib.request.urlopen(f"{server.url}/stats", timeout=30).read())
        finally:
            server.stop()
    chunks = sum(len(r[5]) for r in results if not isinstance(r[5], str))
    return Row(results, stats, cpu_s, chunks)


def _drive(server: Server, kind: str, model: str, setup, offered: list, offsets) -> tuple:
    """(every request's result, the serving processes' CPU seconds over the row)."""
    ctx = multiprocessing.get_context("fork")
    parts: List[list] = [[] for _ in range(setup.clients)]
    for k, (prompt, steps) in enumerate(offered):
        parts[k % setup.clients].append((k, int(offsets[k]), prompt, steps))
    pipes, procs = [], []
    route = GENERATE if kind in BASELINES else kind
    for part in parts:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_client, args=(server.url, route, model, part, setup.timeout_s,
                                              client_cpus(setup.pin), child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    try:
        for conn in pipes:
            conn.recv()
        cpu_before = server.cpu_s()
        start_ns = ring.now_ns() + 200_000_000
        for conn in pipes:
            conn.send(start_ns)
        results = [r for conn in pipes for r in conn.recv()]
        cpu_s = server.cpu_s() - cpu_before
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(30)
    return results, cpu_s
