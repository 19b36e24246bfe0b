"""The engine files one HTTP infer enters, and how many times each.

    python bench/http_infer_path.py [--functions] [--repeat K] [--app MODULE:ATTR]

An engine (identity backend, float32[16]) runs under `shmbatch serve` in a
process of its own. This process builds the HTTP front's ASGI app, as an HTTP
worker does, and calls it directly (no socket, no uvicorn): the lifespan's
startup, one warm-up, then one measured `POST /v2/models/NAME/infer` with a
JSON body, then the lifespan's shutdown. Every wait is bounded. While the
measured request runs, a profile hook on every thread of this process (the
event loop's, and the client's completion thread, started after the hook was
set) counts the 'call' events whose code lies in the engine package: a call,
or a coroutine or generator resumed, is one entry. The answer is checked
against the request. --functions: each file's functions too. --repeat K:
K measured requests, each counted alone, a column each. Timing picks one of
two paths: the answer is there at the app's first look, or the loop waits for
the completion thread to settle it (and the completion thread's passes vary);
the row of the app's __call__ entries, 1 or 2, says which. --app: the front's ASGI
application class, where front_app() finds none. The engine's segment and
processes are checked gone at the end.
"""
import argparse
import asyncio
import collections
import glob
import importlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import engine

PACKAGE = os.path.dirname(os.path.abspath(engine.__file__))
TIMEOUT_S = 30.0  # every wait: the engine's start and stop, a request, the lifespan
# the front's ASGI application, newest layout first
APPS = [("engine.http.front", "Front"), ("engine.http.front", "App"),
        ("engine.http.openinference", "App")]
VALUES = [0.5 * i - 3.0 for i in range(16)]  # exact in float32

entries = collections.Counter()  # (file, function, thread id) -> entries
counting = False
thread_names = {}  # ident -> name, of the threads alive at the measured requests' end


def hook(frame, event, arg):
    if counting and event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
        entries[frame.f_code.co_filename, frame.f_code.co_qualname, threading.get_ident()] += 1


def front_app(configs, named=None):
    """(the front's ASGI app for configs, its dotted name): `named` (MODULE:ATTR), else
    the first of APPS that the tree has, built as an HTTP worker builds it."""
    candidates = [tuple(named.split(":"))] if named else APPS
    for module, attr in candidates:
        try:
            cls = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            if e.name != module:  # the module is there, and broken
                raise
            continue
        except AttributeError:
            continue
        return cls(configs, TIMEOUT_S), f"{module}.{attr}"
    raise SystemExit(f"no ASGI app found at {candidates}: name it with --app MODULE:ATTR")


async def lifespan(app):
    """Starts app's lifespan; returns a coroutine function that ends it."""
    inbox, outbox = asyncio.Queue(), asyncio.Queue()
    task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}},
                                     inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    said = await asyncio.wait_for(outbox.get(), TIMEOUT_S)
    if said["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the app did not start: {said}")

    async def end():
        await inbox.put({"type": "lifespan.shutdown"})
        said = await asyncio.wait_for(outbox.get(), TIMEOUT_S)
        await asyncio.wait_for(task, TIMEOUT_S)
        if said["type"] != "lifespan.shutdown.complete":
            raise RuntimeError(f"the app did not stop: {said}")
    return end


async def infer(app, name):
    """One POST .../infer through app, as a server hands it: the body, then nothing
    until the answer is sent (then a disconnect). Returns (status, body)."""
    body = json.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 16],
                                   "data": VALUES}]}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": f"/v2/models/{name}/infer",
             "raw_path": f"/v2/models/{name}/infer".encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000),
             "headers": [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    sent, answered, given = [], asyncio.Event(), False

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()
    await asyncio.wait_for(app(scope, receive, send), TIMEOUT_S)
    if not answered.is_set() or sent[0]["type"] != "http.response.start":
        raise RuntimeError(f"no whole answer: {sent}")
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def check(status, body):
    if status != 200:
        raise RuntimeError(f"expected 200, got {status}: {body[:500]!r}")
    out = json.loads(body)["outputs"]
    if len(out) != 1 or out[0]["shape"] != [1, 16] or out[0]["data"] != VALUES:
        raise RuntimeError(f"the answer is not the request's input: {body[:500]!r}")


async def measure(app, name, repeat):
    """[entries of each measured request] after one warm-up, each answer checked."""
    global counting
    end = await lifespan(app)
    try:
        check(*await infer(app, name))  # the warm-up: attaches, starts the client's threads
        counts = []
        for _ in range(repeat):
            entries.clear()
            counting = True
            try:
                answer = await infer(app, name)
            finally:
                counting = False
            check(*answer)
            counts.append(collections.Counter(entries))
        thread_names.update({t.ident: t.name for t in threading.enumerate()})
    finally:
        await end()
    return counts


def start_engine(name):
    """The engine's `shmbatch serve` process, once ready; and its batchers' pids."""
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--name", name,
                             "--backend", "engine.backends:identity", "--input-shape", "16",
                             "--output-shape", "16", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, text=True, cwd="/tmp",
                            env={**os.environ, "PYTHONPATH": os.path.dirname(PACKAGE)})
    line = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(TIMEOUT_S)
    if not line or "ready" not in line[0]:
        stop_engine(proc, name, [])
        raise RuntimeError(f"the engine did not start within {TIMEOUT_S:g} s: {line}")
    batchers = re.search(r"batchers \[([\d, ]*)\]", line[0])
    return proc, [int(p) for p in batchers.group(1).split(",") if p.strip()] if batchers else []


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stop_engine(proc, name, batchers):
    """Stops the engine (SIGTERM: it drains and removes its segment); returns what is
    left behind: segments and live processes (killed and removed, then named)."""
    proc.terminate()
    try:
        proc.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + TIMEOUT_S
    while any(alive(p) for p in batchers) and time.monotonic() < deadline:
        time.sleep(0.05)  # polled: another process's exit has no event to wait on
    left = [f"pid {p}" for p in batchers if alive(p)]
    for p in batchers:
        if alive(p):
            os.kill(p, 9)
    for path in glob.glob(f"/dev/shm/*shmbatch-{name}*"):
        os.unlink(path)
        left.append(path)
    return left


def table(counts, functions, app):
    """Entries by file (by function too, with its thread where not the loop's): one column
    per measured request."""
    def short(path):
        return os.path.relpath(path, os.path.dirname(PACKAGE))

    def thread(ident):
        name = thread_names.get(ident, f"thread {ident}")
        return "" if name == "MainThread" else f"  [{name}]"
    files = [collections.Counter() for _ in counts]
    funcs = [collections.Counter() for _ in counts]
    for k, c in enumerate(counts):
        for (path, func, ident), n in c.items():
            files[k][short(path)] += n
            funcs[k][short(path), func + thread(ident)] += n

    def row(counters, key):
        return "".join(f"{c[key]:>6}" for c in counters)
    for path in sorted(set().union(*files)):
        print(f"{row(files, path)}  {path}")
        if functions:
            mine = sorted({k for f in funcs for k in f if k[0] == path},
                          key=lambda k: (-funcs[0][k], k[1]))
            for key in mine:
                print(f"{row(funcs, key)}        {key[1]}")
    totals = "".join(f"{sum(f.values()):>6}" for f in files)
    print(f"{totals}  total, {len(files[0])} files")
    main = threading.main_thread().ident
    looped = "".join(f"{sum(n for (_, _, i), n in c.items() if i == main):>6}" for c in counts)
    print(f"{looped}  of them on the loop's thread (the rest: the completion thread's passes)")
    code = getattr(getattr(type(app), "__call__", None), "__code__", None) or app.__code__
    called = (code.co_filename, code.co_qualname)
    entered = "".join(f"{sum(n for (p, f, _), n in c.items() if (p, f) == called):>6}"
                      for c in counts)
    print(f"{entered}  entries of {code.co_qualname}: 1 = answered at once, 2 = the loop waited "
          f"once for the answer")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--functions", action="store_true", help="each file's functions too")
    p.add_argument("--repeat", type=int, default=1, help="measured requests, each counted alone")
    p.add_argument("--app", help="MODULE:ATTR of the front's ASGI app class")
    args = p.parse_args()
    threading.setprofile(hook)  # every thread started from now on: the client's among them
    sys.setprofile(hook)
    name = f"path{os.getpid()}"
    proc, batchers = start_engine(name)
    try:
        from engine.segment import Segment
        seg = Segment.attach(name)
        configs = {name: seg.config}
        seg.close()
        app, where = front_app(configs, args.app)
        counts = asyncio.run(measure(app, name, args.repeat))
    finally:
        left = stop_engine(proc, name, batchers)
        sys.setprofile(None)
        threading.setprofile(None)
    def git(*words):
        return subprocess.run(["git", "-C", os.path.dirname(PACKAGE), *words],
                              capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--", "engine"):
        commit += ", engine/ with uncommitted changes"
    print(f"engine {PACKAGE} ({commit or 'no git'}), app {where}")
    print(f"POST /v2/models/{name}/infer, JSON float32[1,16], identity engine: 1 warm-up, then "
          f"the measured request (answer checked). Entries ('call' events in engine/) by file"
          + (f", a column for each of {args.repeat} measured requests:" if args.repeat > 1
             else ":"))
    table(counts, args.functions, app)
    threads = collections.Counter()  # the first measured request's
    for (_, _, ident), n in counts[0].items():
        threads[thread_names.get(ident, f"thread {ident} (ended)")] += n
    print("by thread: " + ", ".join(f"{t} {n}" for t, n in threads.most_common()))
    print("engine stopped: nothing left in /dev/shm, no process left" if not left
          else f"LEFT BEHIND (removed now): {left}")
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
