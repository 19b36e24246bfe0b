"""The engines one HTTP worker serves, a Client each, shared by every protocol the front mounts.

Each engine is reached through one Client per worker process, so the
requests of every worker and of every protocol batch together in its
queue. The Clients attach at the front's start (or at the first request,
under a server without lifespan events). A protocol's routes see only
this: an engine's config, Client and segment, whether it is ready, when a refused
caller should try again, and answers_of() for a request of several rows.

Under `serve --model-control explicit` the engines change while the worker
runs: serve's catalog (engine.serving.catalog) says which, and refresh(),
called before each request, reads it when it moved. A Client of an engine
gone or restarted is closed once the requests it may still answer have had
their timeout; load and unload travel to serve (control()).
"""
import asyncio
import math
import time
from typing import Dict, List, Optional, Sequence, Tuple

from engine.client.client import Client
from engine.config import EngineConfig
from engine.errors import EngineError, EngineUnavailable, Overloaded, QueueFull
from engine.segment import Segment
from engine.serving import catalog, control

DEFAULT_TIMEOUT_S = 30.0  # a request's, when neither it nor the server sets one
CONTROL_TIMEOUT_S = 600.0  # a load's bound here; serve bounds it by the engine's timeouts


class Engines:
    """configs: {engine: its config}; clients: Clients lent already (else
    one of each is made at open()). close() closes them all. With
    catalog_fd and control_at (serve's): the engines serve's catalog holds."""

    def __init__(self, configs: Dict[str, EngineConfig], timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_body_bytes: Optional[int] = None,
                 clients: Optional[Dict[str, Client]] = None,
                 catalog_fd: Optional[int] = None, control_at: Optional[str] = None) -> None:
        self.configs, self.timeout_s = configs, timeout_s
        # None: each route's limit derived from its engines
        self.max_body_bytes = max_body_bytes
        self.clients: Dict[str, Client] = dict(clients or {})
        self.control_at = control_at
        self.catalog = None if catalog_fd is None else catalog.Reader(catalog_fd)
        self.entries: List[dict] = []  # the catalog's, as last read
        self._starts: Dict[str, tuple] = {}  # engine -> (its config's JSON, its start)
        self._retired: List[Tuple[float, Client]] = []  # (when to close it, a Client)
        self.refresh()

    @property
    def explicit(self) -> bool:
        """Whether models are loaded and unloaded while serve runs."""
        return self.catalog is not None

    def refresh(self) -> None:
        """The catalog's engines, if it moved since it was last read."""
        if self.catalog is None:
            return
        if not self.catalog.changed():
            if self._retired:
                self._close_retired(time.monotonic())
            return
        entries = self.catalog.read()
        configs, starts = {}, {}
        for entry in entries:
            if entry["config"] is None:
                continue
            name, key = entry["name"], (entry["config"], entry["start"])
            same = self._starts.get(name) == key and name in self.configs
            configs[name] = self.configs[name] if same else \
                EngineConfig.from_json(entry["config"].encode())
            starts[name] = key
        now = time.monotonic()
        for name in [n for n in self.clients if configs.get(n) is not self.configs.get(n)]:
            self._retired.append((now + self.timeout_s, self.clients.pop(name)))
        self._close_retired(now)
        self.configs, self._starts, self.entries = configs, starts, entries

    def _close_retired(self, now: float) -> None:
        """Closes the Clients of gone or restarted engines whose requests have
        had their timeout."""
        for when, client in [r for r in self._retired if r[0] <= now]:
            client.close()
        self._retired = [r for r in self._retired if r[0] > now]

    def counted(self) -> List[str]:
        """The engines the server's readiness counts: every one, but one that
        unloads (it refuses new requests while it drains)."""
        if self.catalog is None:
            return list(self.configs)
        return [e["name"] for e in self.entries if e["name"] in self.configs
                and e["state"] != "UNLOADING"]

    async def control(self, message: dict) -> dict:
        """serve's answer to a load or unload (engine.cli.models)."""
        if self.control_at is None:
            raise EngineUnavailable("models are fixed at serve time")
        return await asyncio.to_thread(control.request, "serve", message, CONTROL_TIMEOUT_S,
                                       self.control_at)

    def open(self) -> None:
        """A Client of each engine (EngineUnavailable if one is not running;
        under explicit model control, one that is not is attached later)."""
        for name in self.configs:
            if name not in self.clients:
                try:
                    self.clients[name] = Client(name)
                except EngineUnavailable:
                    if not self.explicit:
                        raise

    def close(self) -> None:
        clients, self.clients = self.clients, {}
        retired, self._retired = self._retired, []
        for client in [*clients.values(), *(c for _, c in retired)]:
            client.close()
        if self.catalog is not None:
            self.catalog.close()
            self.catalog = None

    def client(self, name: str) -> Client:
        client = self.clients.get(name)  # per request: one lookup once attached
        if client is None:
            client = self.clients[name] = Client(name)
        return client

    def ready(self, name: str) -> None:
        """EngineUnavailable (503) unless the engine runs and a live batcher
        that has loaded its model serves it."""
        if not self.segment(name).serves():
            raise EngineUnavailable(f"model {name!r} is not ready: expected a live batcher "
                                    f"that has loaded its model, got none (the engine starts, "
                                    f"or replaces a batcher)")

    def segment(self, name: str) -> Segment:
        """The engine's segment (its figures: any worker reads the same), attached
        again after a restart; EngineUnavailable while the engine does not run."""
        client = self.client(name)
        client.predicted_wait_s()  # attached (again, after a restart) and running
        seg = client.attached
        if seg is None:  # closed meanwhile
            raise EngineUnavailable(f"model {name!r} is not running")
        return seg

    def retry_after_s(self, name: str, error: EngineError, priority: int = 0) -> int:
        """A 503's Retry-After: the engine's predicted wait, whole seconds, >= 1."""
        wait_s = 1.0
        if isinstance(error, Overloaded) and error.predicted_wait_ms:
            wait_s = error.predicted_wait_ms / 1000
        elif isinstance(error, QueueFull):
            try:
                wait_s = self.client(name).predicted_wait_s(priority)
            except EngineError:
                pass
        return max(1, math.ceil(wait_s))


async def answers_of(client: Client, rows: Sequence, timeout_s: float,
                     priority: int = 0) -> List:
    """Each row's answer, in order. Every row is submitted from the event loop
    as a single request is (priority shares, admission); if one is refused,
    or the wait ends otherwise (an error, a cancel), those submitted are
    withdrawn."""
    sent = []
    try:
        for row in rows:
            sent.append(client.submit(row, timeout_s, priority=priority))
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in sent)))
    except BaseException:
        for f in sent:
            f.cancel()  # withdrawn, unless a batch answered it already
        raise
