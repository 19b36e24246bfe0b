"""`shmbatch manifest ... --measure`: the memory a serve config's processes
take, measured on this host, to size the pod's (engine.tools.manifest_pod).

The config runs as the pod runs it: `shmbatch serve --config` in its own
process, every engine with warmup = true (each batcher has called its model
at every batch shape it will see before it is ready), an HTTP front when the
pod has one and /metrics, both on free ports. Each engine gets ROUNDS full
batches of requests of its largest shapes through a Client and, with an HTTP
front, HTTP_PER_WORKER requests per worker through its generate route; then
serve stops (SIGTERM: it drains and removes its segments; past its bound
SIGKILL, and what it left is removed): nothing stays in /dev/shm, no process.

From ready to the end of the requests each process's memory is read every
SAMPLE_EVERY_S and the most seen kept: serve's own, each batcher's and each
HTTP worker's (with a child of theirs, such as a worker's parser process).
The figure is PSS + swap over the mappings outside /dev/shm:
- RSS counts a page in every process that maps it: a model's libraries
  (torch's take hundreds of MiB) would count once per batcher, though the
  container's cgroup is charged for them once;
- USS counts private pages alone: those shared libraries would count nowhere;
- PSS splits a shared page among the processes that map it: summed over the
  pod's processes, each page counts once, as the cgroup charges it (a page
  this measuring process shares, Python's or numpy's, is split with it too:
  a few MiB missed, within the margin);
- /dev/shm holds the segments, which the emptyDir is sized for: counted
  here too, they would count twice.
"""
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import numpy as np
import psutil

from engine import launch
from engine.client.client import Client
from engine.errors import EngineError
from engine.http import auth
from engine.segment import Segment, remove_if_dead
from engine.serving import metrics
from engine.tools.manifest_pod import Measured, ServePod

ROUNDS = 2  # full batches of each engine through a Client
HTTP_PER_WORKER = 2  # requests of each engine per HTTP worker
REQUEST_TIMEOUT_S = 300.0
SAMPLE_EVERY_S = 0.05
STOP_MARGIN_S = 10.0
SHM = "/dev/shm/"
READY = " ready (pid "  # in serve's ready line, of one engine or several
HTTP_AT = "Open Inference Protocol on "


def process_memory(pid: int) -> Tuple[int, int]:
    """(PSS + swap, RSS) in bytes of the process's mappings outside /dev/shm;
    (0, 0) once it is gone."""
    try:
        maps = psutil.Process(pid).memory_maps(grouped=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0, 0
    kept = [m for m in maps if not m.path.startswith(SHM)]
    return sum(m.pss + m.swap for m in kept), sum(m.rss for m in kept)


def tree_memory(pid: int) -> Tuple[int, int]:
    """process_memory() of the process and its descendants, summed."""
    try:
        pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    figures = [process_memory(p) for p in pids]
    return sum(f[0] for f in figures), sum(f[1] for f in figures)


def toml_value(value) -> str:
    """Inline TOML of a value tomllib read (a key: a quoted string)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # inf, nan and 1e-05 are TOML floats too
    if isinstance(value, str):  # JSON's escapes are TOML's; DEL is the control JSON leaves raw
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_value(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"--measure: cannot write the config's value {value!r} back as TOML")


def warm_config(path: str) -> dict:
    """The config file's keys, every engine's with warmup = true."""
    with open(path, "rb") as f:
        keys = tomllib.load(f)
    tables = keys.get("engines")
    for table in tables.values() if isinstance(tables, dict) else [keys]:
        table["warmup"] = True
    return keys


def largest_request(cfg):
    """A request of the engine's largest shapes (a variable dim at its bound),
    all ones: a valid value, token id or mask for most models."""
    return cfg.request_of({spec.name: np.ones(spec.max_shape, spec.dtype)
                           for spec in cfg.input_specs})


class Sampler:
    """Each (role, pid, with its children) process's memory, the most seen
    (PSS + swap, RSS) per role, read every SAMPLE_EVERY_S inside the block."""

    def __init__(self, roles: List[Tuple[str, int, bool]]) -> None:
        self.roles = roles
        self.peak: Dict[str, Tuple[int, int]] = {role: (0, 0) for role, _, _ in roles}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shmbatch-measure", daemon=True)

    def sample(self) -> None:
        for role, pid, tree in self.roles:
            pss, rss = (tree_memory if tree else process_memory)(pid)
            seen = self.peak[role]
            self.peak[role] = (max(seen[0], pss), max(seen[1], rss))

    def _run(self) -> None:
        while not self._done.wait(SAMPLE_EVERY_S):
            self.sample()

    def __enter__(self) -> "Sampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.sample()


def roles(serve_pid: int, names: List[str]) -> List[Tuple[str, int, bool]]:
    """(role, pid, with its children) of serve, each batcher by engine and
    number, each HTTP worker, and any other child of serve."""
    batchers = {}
    for name in names:
        seg = Segment.attach(name, header_only=True)
        try:
            for i, pid in enumerate(metrics.batcher_pids(seg.ring, seg.config.instances)):
                batchers[pid] = f"batcher {name} {i}"
        finally:
            seg.close()
    found = [("serve", serve_pid, False)]
    workers, others = [], []
    for child in sorted(psutil.Process(serve_pid).children(), key=lambda c: c.pid):
        if child.pid in batchers:
            continue
        try:
            worker = "engine.http.worker" in " ".join(child.cmdline())
        except psutil.Error:
            continue  # gone meanwhile
        (workers if worker else others).append(child.pid)
    found += [(role, pid, True) for pid, role in batchers.items()]
    found += [(f"HTTP worker {i}", pid, True) for i, pid in enumerate(workers)]
    return found + [(f"child {pid}", pid, True) for pid in others]


def through_client(cfg) -> int:
    """ROUNDS full batches of the engine's largest request; how many were sent."""
    x = largest_request(cfg)
    per_round = max(1, min(cfg.max_batch_size, cfg.queue_capacity))
    with Client(cfg.name) as c:
        try:
            for _ in range(ROUNDS):
                futures = [c.submit(x, timeout=REQUEST_TIMEOUT_S) for _ in range(per_round)]
                for f in futures:
                    f.result()
        except EngineError as e:
            raise RuntimeError(f"--measure: engine {cfg.name!r} failed a request of its "
                               f"largest shapes: {type(e).__name__}: {e}") from None
    return ROUNDS * per_round


def through_http(cfg, url: str, workers: int, api_key: Optional[str]) -> int:
    """HTTP_PER_WORKER requests per worker, at once, through the engine's
    generate route (one-shot and iterative engines both answer it)."""
    body = {spec.name or "INPUT": np.ones(spec.max_shape, spec.dtype).tolist()
            for spec in cfg.input_specs}
    body["parameters"] = {"timeout": int(REQUEST_TIMEOUT_S * 1e6)}
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    where = urllib.parse.urlsplit(url)

    def post(_) -> None:
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", f"/v2/models/{cfg.name}/generate", data, headers)
            reply = conn.getresponse()
            text = reply.read(300)
        finally:
            conn.close()
        if reply.status != 200:
            raise RuntimeError(f"--measure: engine {cfg.name!r} answered its HTTP request "
                               f"{reply.status}: {text.decode('utf-8', 'replace')}")

    count = HTTP_PER_WORKER * workers
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(post, range(count)))
    return count


def _last_line(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "(no output)"


def await_ready(proc: subprocess.Popen, out_path: str, timeout_s: float) -> Optional[str]:
    """serve's HTTP URL (None: no HTTP front) once it says it is ready;
    RuntimeError with its last line if it exits first or is not ready in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(out_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("shmbatch serve: ") and READY in line:
                    return line.split(HTTP_AT, 1)[1].split()[0] if HTTP_AT in line else None
        if proc.poll() is not None:
            raise RuntimeError(f"--measure: serve exited ({proc.returncode}) before it was "
                               f"ready: {_last_line(out_path)}")
        time.sleep(SAMPLE_EVERY_S)  # a poll of its output file, bounded by the deadline
    raise RuntimeError(f"--measure: serve was not ready within {timeout_s:g} s: "
                       f"{_last_line(out_path)}")


def stop(proc: subprocess.Popen, names: List[str], bound_s: float) -> None:
    """SIGTERM: serve drains and removes its segments; past bound_s SIGKILL,
    and the segments it left (its batchers die with it) are removed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(bound_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_MARGIN_S)
        for name in names:
            try:
                remove_if_dead(name)
            except (EngineError, OSError):
                pass  # still held: a batcher outlived its parent's death signal


def measure(pod: ServePod, config_path: str, *, margin_bytes: int,
            limit_factor: float) -> Measured:
    """Runs the config here and returns what its processes took."""
    keys = warm_config(config_path)
    # serve's own order: the environment's key wins over the config's
    api_key = os.environ.get(auth.ENV) or keys.get("api_key")
    command = [sys.executable, "-m", "engine", "serve", "--metrics-port", "0"]
    if pod.http_port is not None:
        command += ["--http-port", "0"]
    with tempfile.TemporaryDirectory(prefix="shmbatch-measure-") as folder:  # mode 0700
        path, out_path = os.path.join(folder, "models.toml"), os.path.join(folder, "serve.out")
        with open(path, "w", encoding="utf-8") as f:
            f.write("".join(f"{toml_value(k)} = {toml_value(v)}\n" for k, v in keys.items()))
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(command + ["--config", path], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            url = await_ready(proc, out_path, pod.start_bound_s + launch.START_TIMEOUT_S)
            with Sampler(roles(proc.pid, pod.names)) as sampler:
                sent = 0
                for cfg, _ in pod.engines:
                    sent += through_client(cfg)
                    if url is not None:
                        sent += through_http(cfg, url, pod.http_workers, api_key)
        finally:
            stop(proc, pod.names, pod.stop_bound_s + STOP_MARGIN_S)
    return Measured(processes=tuple((role, pss) for role, (pss, _) in sampler.peak.items()),
                    rss_bytes=sum(rss for _, rss in sampler.peak.values()), requests=sent,
                    margin_bytes=margin_bytes, limit_factor=limit_factor)
