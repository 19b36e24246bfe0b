"""The OpenAI API for the engines that have an [engines.NAME.openai] table.

Mounted by the front (engine.http.front), which hands it every path under
/v1/, in each HTTP worker: the engines are reached through the front's
Clients (engine.http.engines), so the requests of every worker and of both
APIs batch together.
Each engine's tokenizer is loaded here, once per worker (a factory that
fails fails the worker's start, naming the engine).

    GET  /v1/models, /v1/models/MODEL   the engines with an openai table
    POST /v1/completions                iterative engines (engine.http.openai.generate;
                                        several prompts or choices: .several)
    POST /v1/chat/completions           iterative engines, through the chat template
    POST /v1/embeddings                 one-shot engines (engine.http.openai.embeddings)
    POST /v1/rerank, /rerank            one-shot engines of task "rerank" (.rerank)

Every route takes vLLM's top-level `priority` as the engine requests'.
A body is read under its route's limit (the largest that one of the route's
models can need: body.HEADER_BYTES + BYTES_PER_TOKEN for each token its requests
can hold, or a byte for each character of their max_prompt_chars if more, for
each text it may carry (a completion's prompts, an embedding's inputs, a rerank's
documents and query), or the server's http_max_body_bytes), refused with 413 from its
Content-Length before it is read, then parsed as JSON where its size says
(engine.http.server.parsing: a large one in the parser process, which hands
back no text longer than the route's models take). Every refusal is in
OpenAI's shape (engine.http.openai.replies); a request's deadline is the
server's http_timeout_s.
"""
import json
import logging
import time
from typing import Dict, List, Tuple

from engine.errors import EngineError, EngineUnavailable, QueueFull
from engine.http import body as bodies
from engine.http.asgi import Receive, Scope, Send
from engine.http.engines import Engines
from engine.http.errors import BadRequest, Disconnected, allowed
from engine.http.openai import embeddings, fields, generate, rerank, several, text, tokenizing
from engine.http.openai.fields import Served
from engine.http.openai.replies import OpenAIError, bad, of_engine, send_error, send_json
from engine.http.openai.settings import EMBED, GENERATE, RERANK, OpenAISettings
from engine.http.server import parsing
from engine.http.values import json_object

log = logging.getLogger("shmbatch")

BYTES_PER_TOKEN = 64      # a token's text (or id) in JSON, escapes included
# a body up to this size is parsed on the loop (a few ms at most); a larger one
# in the parser process (engine.http.server.parsing)
INLINE_PARSE_BYTES = parsing.PROCESS_BYTES
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# each POST route: the task of the models it serves
TASKS = {COMPLETIONS: GENERATE, CHAT: GENERATE, "/v1/embeddings": EMBED, "/v1/rerank": RERANK,
         "/rerank": RERANK}
ROOT_PATHS = ("/rerank",)  # the routes outside /v1/ (vLLM's, Jina's) that the front sends here
# the fields of each route's texts, checked by length where its body is parsed
TEXTS = {COMPLETIONS: ("prompt",), CHAT: ("messages",), "/v1/embeddings": ("input",),
         "/v1/rerank": ("query", "documents"), "/rerank": ("query", "documents")}


class App:
    """The /v1/ routes over `engines` (their Clients, timeout and body
    limit); tables: the engines' openai settings ({engine:
    OpenAISettings.to_dict()})."""

    def __init__(self, engines: Engines, tables: Dict[str, dict],
                 parser: parsing.Parser) -> None:
        self.engines, self.parser = engines, parser
        self.created = int(time.time())
        self.served: Dict[str, Served] = {}
        self.pairs: Dict[str, rerank.Pairing] = {}  # each reranker's (query, document) ids
        self.tokens_of = tokenizing.Tokenizing()
        for engine, table in tables.items():
            settings = OpenAISettings(**table)
            tokenizer = text.load(settings.tokenizer, engine)
            self.served[settings.model] = Served(settings, engines.configs[engine], tokenizer,
                                                 self.tokens_of)
            if settings.task == RERANK:
                self.pairs[settings.model] = rerank.pairing(tokenizer, engine)
        explicit = engines.max_body_bytes
        self.limits = {path: explicit or self._limit(path) for path in TASKS}
        # a text longer than every model of a route takes is dropped where the body is parsed
        self.most_chars = {path: max((s.max_chars for s in self._models(path)), default=0)
                           for path in TASKS}

    def close(self) -> None:
        self.tokens_of.close()

    def _models(self, path: str) -> List[Served]:
        return [s for s in self.served.values() if s.settings.task == TASKS[path]]

    def _limit(self, path: str) -> int:
        # a text's bytes: its tokens' or, where a text may hold more, its characters';
        # times the texts a request may carry
        def texts(s: Served) -> int:
            if path == CHAT:
                return 1
            return s.most_inputs + (1 if TASKS[path] == RERANK else 0)  # and the query
        text = [max(s.bound * BYTES_PER_TOKEN, s.max_chars) * texts(s) for s in self._models(path)]
        return min(bodies.HEADER_BYTES + max(text, default=0), bodies.MAX_JSON_BYTES)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._route(scope, receive, send)
        except Disconnected:
            return
        except bodies.Refused as e:  # answered, then the rest of its body read and dropped
            await bodies.refuse(scope, receive, send,
                                OpenAIError(e.status, str(e), headers=e.headers).encoded(), e)
        except BadRequest as e:
            await send_error(send, OpenAIError(e.status, str(e), headers=e.headers))
        except OpenAIError as e:
            await send_error(send, e)
        except EngineError as e:
            await send_error(send, of_engine(e))
        except Exception as e:
            log.exception("%s %s failed", scope["method"], scope["path"])
            await send_error(send, OpenAIError(500, f"{type(e).__name__}: {e}"))

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"].rstrip("/")
        if path == "/v1/models":
            allowed(method, "GET")
            return await send_json(send, 200, {"object": "list", "data": [
                self._card(name) for name in self._live()]})
        if path.startswith("/v1/models/"):
            allowed(method, "GET")
            name = path[len("/v1/models/"):]
            self._served(name)
            return await send_json(send, 200, self._card(name))
        if path not in self.limits:
            raise OpenAIError(404, f"no route {scope['path']}: expected /v1/models, "
                                   f"/v1/completions, /v1/chat/completions, /v1/embeddings or "
                                   f"/v1/rerank", code="unknown_url")
        allowed(method, "POST")
        body, overlong = await self._body(scope, receive, path)
        served = self._served(body.get("model"))
        if overlong is not None:
            field, chars = overlong
            raise fields.too_long(f"{field}: expected at most {served.max_chars} characters "
                                  f"(what {served.bound} tokens can hold), got {chars}", field)
        task = served.settings.task
        if task != TASKS[path]:
            serves = [p for p, t in TASKS.items() if t == task]
            raise bad(f"model {served.model!r} serves {' and '.join(serves)}, got {path}",
                      "model")
        client = self.engines.client(served.engine)
        timeout_s = self.engines.timeout_s
        field = {GENERATE: "prompt", EMBED: "input", RERANK: "documents"}[task]
        field = "messages" if path == CHAT else field
        priority = fields.priority(body, served.config.priority_levels)
        try:
            if task == EMBED:
                return await embeddings.answer(client, served, body, timeout_s, priority,
                                               receive, send)
            if task == RERANK:
                return await rerank.answer(client, served, self.pairs[served.model], body,
                                           timeout_s, priority, receive, send)
            request = await generate.Request(served, body, path == CHAT, priority).tokenize()
            answering = several if request.several else generate
            return await answering.answer(client, request, timeout_s, scope, receive, send)
        except (QueueFull, EngineUnavailable) as e:  # 503: when to try again
            retry_s = self.engines.retry_after_s(served.engine, e, priority)
            raise of_engine(e, retry_after_s=retry_s) from None
        except EngineError as e:
            raise of_engine(e, field) from None

    async def _body(self, scope: Scope, receive: Receive, path: str):
        """(the request's JSON object, (field, characters) of a text too long
        for any of the route's models, taken out of it, or None)."""
        limit = self.limits[path]
        why = ("http_max_body_bytes" if self.engines.max_body_bytes else
               f"the most that {path}'s models take: {bodies.HEADER_BYTES} B + "
               f"{BYTES_PER_TOKEN} B per token their requests hold, or a byte per character "
               f"of their max_prompt_chars")
        raw = await bodies.read(scope, receive, limit, why)
        most, texts = self.most_chars[path], TEXTS[path]
        if len(raw) <= INLINE_PARSE_BYTES:  # a thread would hold the GIL as long
            return read_body(raw, most, texts)
        return await self.parser.parse(len(raw), read_body, raw, most, texts)

    def _live(self) -> list:
        """The models whose engines are loaded now."""
        return [m for m, s in self.served.items() if s.engine in self.engines.configs]

    def _served(self, name) -> Served:
        if not isinstance(name, str):
            raise bad(f"model: expected the name of a model, got {json.dumps(name)}", "model")
        served = self.served.get(name)
        config = None if served is None else self.engines.configs.get(served.engine)
        if served is None or config is None:  # none, or its engine unloaded
            raise OpenAIError(404, f"unknown model {name!r}; this server has "
                              f"{sorted(self._live())}", "model",
                              "model_not_found")
        if config is not served.config:  # its engine loaded again: its settings may differ
            served = self.served[name] = Served(served.settings, config, served.tokenizer,
                                                self.tokens_of)
        return served

    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "shmbatch"}


def read_body(raw: bytes, most_chars: int, texts: Tuple[str, ...]):
    """(a body's JSON object, None), or with a text of more than most_chars
    characters (a prompt, an input, a document, the messages' together)
    taken out of its field (one of `texts`), (the object, (the field, its
    characters)): run where the body is parsed (engine.http.server.parsing),
    so that a text no model takes is never handed back. BadRequest for a
    body that is not a JSON object."""
    body = json_object(raw)
    for field in texts:
        value = body.get(field)
        chars = _messages_chars(value) if field == "messages" else _text_chars(value)
        if chars > most_chars:
            body[field] = None
            return body, (field, chars)
    return body, None


def _text_chars(value) -> int:
    """The characters of a field's longest text: a string, or each of a list
    of strings or of {"text": str} (each text its own request's)."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, list):
        return 0
    return max((len(t) for t in (v.get("text") if isinstance(v, dict) else v for v in value)
                if isinstance(t, str)), default=0)


def _messages_chars(value) -> int:
    """The characters of messages' texts together (one prompt): each content
    a string or a list of text parts."""
    if not isinstance(value, list):
        return _text_chars(value)
    total = 0
    for item in value:
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            content = item.get("content")
            total += _text_chars(content) if not isinstance(content, list) else sum(
                len(p.get("text", "")) for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str))
    return total
