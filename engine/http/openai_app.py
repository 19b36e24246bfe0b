"""The OpenAI API for the engines that have an [engines.NAME.openai] table.

Mounted by engine.http.openinference's App, which hands it every path under
/v1/, in each HTTP worker: the engines are reached through the App's
Clients, so the requests of every worker and of both APIs batch together.
Each engine's tokenizer is loaded here, once per worker (a factory that
fails fails the worker's start, naming the engine).

    GET  /v1/models, /v1/models/MODEL   the engines with an openai table
    POST /v1/completions                iterative engines (engine.http.openai_generate)
    POST /v1/chat/completions           iterative engines, through the chat template
    POST /v1/embeddings                 one-shot engines (engine.http.openai_embed)

A body is read under its route's limit (the largest that one of the route's
models can need: HEADER_BYTES + BYTES_PER_TOKEN for each token its requests
can hold, or the server's http_max_body_bytes), refused with 413 from its
Content-Length before it is read, then parsed as JSON. Every refusal is in
OpenAI's shape (engine.http.openai_reply); a request's deadline is the
server's http_timeout_s.
"""
import asyncio
import json
import logging
import time
from typing import Dict

from engine.errors import EngineError, EngineUnavailable, QueueFull
from engine.http import oip_body, openai_embed, openai_generate, openai_text
from engine.http.openai_config import OpenAISettings
from engine.http.openai_fields import Served
from engine.http.openai_reply import (
    OpenAIError,
    bad,
    of_engine,
    refuse_too_large,
    send_error,
    send_json,
)

log = logging.getLogger("shmbatch")

HEADER_BYTES = 64 << 10   # a body's fields other than its tokens' text
BYTES_PER_TOKEN = 64      # a token's text (or id) in JSON, escapes included
MAX_BODY_BYTES = 64 << 20
THREAD_PARSE_BYTES = 1 << 20  # a larger body is parsed off the event loop
GENERATE = ("/v1/completions", "/v1/chat/completions")
EMBED = "/v1/embeddings"


class OpenAIApp:
    """The /v1/ routes of one HTTP worker; front is its openinference.App
    (its Clients, timeout and body limit), tables the engines' openai
    settings ({engine: OpenAISettings.to_dict()})."""

    def __init__(self, front, tables: Dict[str, dict]) -> None:
        self.front = front
        self.created = int(time.time())
        self.served: Dict[str, Served] = {}
        for engine, table in tables.items():
            settings = OpenAISettings(**table)
            tokenizer = openai_text.load(settings.tokenizer, engine)
            self.served[settings.model] = Served(settings, front.configs[engine], tokenizer)
        explicit = front.max_body_bytes
        self.limits = {path: explicit or self._limit(path) for path in (*GENERATE, EMBED)}

    def _limit(self, path: str) -> int:
        tokens = [s.bound * (s.config.queue_capacity if path == EMBED else 1)
                  for s in self.served.values() if s.config.iterative == (path != EMBED)]
        return min(HEADER_BYTES + max(tokens, default=0) * BYTES_PER_TOKEN, MAX_BODY_BYTES)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._route(scope, receive, send)
        except oip_body.Disconnected:
            return
        except oip_body.TooLarge as e:  # answered, then the rest of its body read and dropped
            await refuse_too_large(scope, receive, send, e)
        except OpenAIError as e:
            await send_error(send, e)
        except EngineError as e:
            await send_error(send, of_engine(e))
        except Exception as e:
            log.exception("%s %s failed", scope["method"], scope["path"])
            await send_error(send, OpenAIError(500, f"{type(e).__name__}: {e}"))

    async def _route(self, scope, receive, send) -> None:
        method, path = scope["method"], scope["path"].rstrip("/")
        if path == "/v1/models":
            _allowed(method, "GET")
            return await send_json(send, 200, {"object": "list", "data": [
                self._card(name) for name in self.served]})
        if path.startswith("/v1/models/"):
            _allowed(method, "GET")
            name = path[len("/v1/models/"):]
            self._served(name)
            return await send_json(send, 200, self._card(name))
        if path not in self.limits:
            raise OpenAIError(404, f"no route {scope['path']}: expected /v1/models, "
                                   f"/v1/completions, /v1/chat/completions or /v1/embeddings",
                              code="unknown_url")
        _allowed(method, "POST")
        body = await self._body(scope, receive, path)
        served = self._served(body.get("model"))
        if served.config.iterative != (path in GENERATE):
            serves = "/v1/completions and /v1/chat/completions" if served.config.iterative \
                else "/v1/embeddings"
            raise bad(f"model {served.model!r} serves {serves}, got {path}", "model")
        self.front.open()
        model = self.front.models[served.engine]
        timeout_s = self.front.timeout_s
        field = "input" if path == EMBED else "messages" if "chat" in path else "prompt"
        try:
            if path == EMBED:
                return await openai_embed.answer(model, served, body, timeout_s, receive, send)
            request = openai_generate.Request(served, body, chat="chat" in path)
            return await openai_generate.answer(model, request, timeout_s, scope, receive, send)
        except (QueueFull, EngineUnavailable) as e:  # 503: when to try again
            raise of_engine(e, retry_after_s=model.retry_after_s(e)) from None
        except EngineError as e:
            raise of_engine(e, field) from None

    async def _body(self, scope, receive, path: str) -> dict:
        limit = self.limits[path]
        why = ("http_max_body_bytes" if self.front.max_body_bytes else
               f"the most that {path}'s models take: {HEADER_BYTES} B + {BYTES_PER_TOKEN} B "
               f"per token their requests hold")
        raw = await oip_body.read(scope, receive, limit, why)
        try:
            if len(raw) > THREAD_PARSE_BYTES:
                body = await asyncio.to_thread(json.loads, raw)
            else:
                body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise bad(f"expected a JSON object, got a body that is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise bad(f"expected a JSON object, got {type(body).__name__}")
        return body

    def _served(self, name) -> Served:
        if not isinstance(name, str):
            raise bad(f"model: expected the name of a model, got {json.dumps(name)}", "model")
        served = self.served.get(name)
        if served is None:
            raise OpenAIError(404, f"unknown model {name!r}; this server has "
                                   f"{sorted(self.served)}", "model", "model_not_found")
        return served

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "shmbatch"}


def _allowed(method: str, allowed: str) -> None:
    if method != allowed:
        raise OpenAIError(405, f"expected {allowed}, got {method}",
                          headers=[(b"allow", allowed.encode())])
