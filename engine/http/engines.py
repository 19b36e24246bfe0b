"""The engines one HTTP worker serves, a Client each, shared by every protocol the front mounts.

Each engine is reached through one Client per worker process, so the
requests of every worker and of every protocol batch together in its
queue. The Clients attach at the front's start (or at the first request,
under a server without lifespan events). A protocol's routes see only
this: an engine's config and Client, whether it is ready, when a refused
caller should try again, and answers_of() for a request of several rows.
"""
import asyncio
import math
from typing import Dict, List, Optional, Sequence

from engine.client.client import Client
from engine.config import EngineConfig
from engine.errors import EngineError, EngineUnavailable, Overloaded, QueueFull

DEFAULT_TIMEOUT_S = 30.0  # a request's, when neither it nor the server sets one


class Engines:
    """configs: {engine: its config}; clients: Clients lent already (else
    one of each is made at open()). close() closes them all."""

    def __init__(self, configs: Dict[str, EngineConfig], timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_body_bytes: Optional[int] = None,
                 clients: Optional[Dict[str, Client]] = None) -> None:
        self.configs, self.timeout_s = configs, timeout_s
        # None: each route's limit derived from its engines
        self.max_body_bytes = max_body_bytes
        self.clients: Dict[str, Client] = dict(clients or {})

    def open(self) -> None:
        """A Client of each engine (EngineUnavailable if one is not running)."""
        for name in self.configs:
            if name not in self.clients:
                self.clients[name] = Client(name)

    def close(self) -> None:
        clients, self.clients = self.clients, {}
        for client in clients.values():
            client.close()

    def client(self, name: str) -> Client:
        client = self.clients.get(name)  # per request: one lookup once attached
        if client is None:
            self.open()
            client = self.clients[name]
        return client

    def ready(self, name: str) -> None:
        """EngineUnavailable (503) unless the engine runs and a live batcher
        that has loaded its model serves it."""
        client = self.client(name)
        client.predicted_wait_s()  # attached (again, after a restart) and running
        seg = client.attached
        if seg is None or not seg.serves():
            raise EngineUnavailable(f"model {name!r} is not ready: expected a live batcher "
                                    f"that has loaded its model, got none (the engine starts, "
                                    f"or replaces a batcher)")

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
