"""POST /v1/completions and /v1/chat/completions on an iterative engine.

A request of one prompt and one choice is one engine stream, answered here:
its prompt's token ids (a completion's prompt, or a chat's messages through
the tokenizer's chat template) and the engine's other inputs from its
fields, max_tokens (chat: also max_completion_tokens) as its max_steps (a
completion's absent: 16, OpenAI's and vLLM's default; a chat's absent: the
engine's max_steps, as OpenAI's chat runs to the model's end), its
`priority` the engine's (engine.http.openai.fields); on an engine that
samples, its engine.Sampling (engine.http.openai.sampled), and with
logprobs each token's (engine.http.openai.logprobs), an echoed prompt's
text and logprobs first. Several prompts or choices are
engine.http.openai.several's. Each step's token id is decoded
incrementally (engine.http.openai.text); the answer ends at the engine's end
(finish_reason "stop" when the model said done, "length" at max_steps), at
the tokenizer's eos_token_id or at a stop string ("stop"): the stream is then
closed, which withdraws the request. Its text never holds a stop string nor
what follows one, nor the eos token's text; usage counts the prompt's tokens
and every token the engine gave (the eos and a stop string's included).

Not streamed, the answer is one JSON object with `usage`. Streamed (`stream`),
it is server-sent events in OpenAI's chunk format, begun once the first token
came (an error before that is an ordinary error response), the last choice
chunk carrying finish_reason, then with stream_options.include_usage a chunk
of `usage` and no choice, then `data: [DONE]`. A stream that ends any other
way (an engine error, its timeout, the server stopping) ends with a last
`data: {"error": {...}}` event and no [DONE]. A caller that disconnects
withdraws its request; one that stops reading is cut at its deadline
(engine.http.events, which writes a wake's tokens as one HTTP chunk).
"""
import asyncio
import json
import time
import uuid
from typing import List, Optional, Tuple

from engine.errors import BackendError, EngineError, EngineUnavailable
from engine.http import events
from engine.http.openai import fields, honoured, sampled
from engine.http.openai.logprobs import Logprobs
from engine.http.openai.replies import DONE, bad, of_engine, send_json
from engine.http.openai.text import Detokenizer, Stops


class Request:
    """A completion or chat request, read: its fields by the constructor (no
    tokenizer's work), its text by tokenize(): `prompts` the token ids of
    each prompt, `xs` the engine's request of each, each to get `n` choices.
    On an engine that samples, `asked` is its sampling (engine.http.openai.sampled):
    a prompt's choices are then each an engine request of its own unless greedy."""

    def __init__(self, served: fields.Served, body: dict, chat: bool, priority: int) -> None:
        honoured.refuse_unhonoured(served, body)
        self.served, self.chat, self.body = served, chat, body
        self.field = "messages" if chat else "prompt"
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        default = None if chat else fields.DEFAULT_MAX_TOKENS
        # max_tokens 0 with echo (OpenAI's legacy scoring call): the prompt alone is the
        # answer; the engine still makes one token (its prompt logprobs come with the
        # first chunk), which is left out
        least = 0 if not chat and served.sampling and body.get("echo") is True else 1
        self.max_steps = fields.max_steps(body, names, served.config.max_steps, default, least)
        self.echo_only = self.max_steps == 0
        if self.echo_only:
            self.max_steps = 1
        self.n = fields.choices(body)
        self.asked = sampled.asked(served, body, chat, self.max_steps) if served.sampling \
            else None
        self.logprobs = None if self.asked is None else self.asked.logprobs
        self.echo = self.asked is not None and self.asked.echo
        # the engine requests of one prompt: one per choice when they differ, else one
        # whose tokens make every choice
        self.per_prompt = self.n if self.asked is not None and not self.asked.greedy else 1
        if self.per_prompt > 1:
            prompts = 1 if chat else len(fields.prompt_items(body))
            most = served.most_inputs
            if prompts * self.n > most:
                raise bad(f"n: expected prompts x n at most {most} (each sampled choice "
                                   f"one engine request, all enqueued at once), got {prompts} x "
                                   f"{self.n}", "n")
        self.priority = priority
        self.stops = fields.stops(body)
        self.stream = fields.flag(body, "stream")
        self.include_usage = self.stream and fields.include_usage(body)
        self.prompts: List[List[int]] = []
        self.texts: List[str] = []  # each prompt's text, when echoed
        self.xs: list = []
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    async def tokenize(self) -> "Request":
        """Every prompt tokenized and checked before any is enqueued."""
        served, body = self.served, self.body
        self.prompts = [await fields.chat_ids(served, body)] if self.chat \
            else await fields.prompts_ids(served, body)
        several = len(self.prompts) > 1
        self.xs = [served.request(ids, body, self.field, f"{self.field}[{k}]" if several else None)
                   for k, ids in enumerate(self.prompts)]
        if self.echo:
            self.texts = [p if isinstance(p, str) else served.tokenizer.decode(ids)
                          for p, ids in zip(fields.prompt_items(body), self.prompts)]
        return self

    @property
    def several(self) -> bool:
        """Whether the answer has several choices (engine.http.openai.several's)."""
        return len(self.prompts) > 1 or self.n > 1

    def runs(self) -> List[Tuple[int, range, object]]:
        """Each engine request to make: (its prompt, the choices its tokens
        make, its engine.Sampling or None)."""
        n, per = self.n, self.per_prompt
        width = n // per
        return [(p, range(p * n + c * width, p * n + (c + 1) * width),
                 None if self.asked is None else self.asked.of_choice(c))
                for p in range(len(self.xs)) for c in range(per)]

    def open(self, client, timeout_s: float, x, sampling=None):
        """The engine stream of one of its prompts' requests, enqueued now."""
        return client.open_stream_async(x, timeout_s, priority=self.priority,
                                        max_steps=self.max_steps, sampling=sampling)


class Text:
    """An answer's text as its tokens come, and why it finished; with
    logprobs, each token's (engine.http.openai.logprobs); echoed, its
    prompt's text (and logprobs) first. The tokenizer's eos and a sampling
    request's stop_token_ids end it, their text left out (as vLLM's)."""

    def __init__(self, request: Request, prompt: int = 0) -> None:
        served, asked = request.served, request.asked
        self.served = served
        self.detokenizer = Detokenizer(served.tokenizer)
        self.stops = Stops(request.stops)
        self.eos, self.vocab = served.eos, served.vocab
        self.ends = frozenset(asked.base.stop_token_ids) if asked is not None else frozenset()
        if asked is not None and asked.base.ignore_eos:
            self.eos = None
        self.logprobs = None if request.logprobs is None else Logprobs(
            served.token_text, request.logprobs, request.chat)
        self.echo = (request.prompts[prompt], request.texts[prompt]) if request.echo else None
        self.echo_only = request.echo_only
        self.tokens = 0
        self.finish: Optional[str] = None  # set once the answer is over

    def feed(self, chunks, prompt_logprobs: Optional[list] = None) -> List[str]:
        """The pieces of text a block of chunks lets out (the echoed prompt's
        first, with its stream's prompt_logprobs), up to the one that ends the
        answer (finish is then set), each token's logprobs gathered."""
        pieces = [self.echoed(prompt_logprobs)] if self.echo is not None else []
        if self.echo_only:  # max_tokens 0: the token made is not the answer's
            return pieces + [self.end("length")]
        logprobs = self.logprobs
        for i, token in enumerate(self.served.tokens(chunks)):
            pieces.append(self.add(token))
            if logprobs is not None:
                logprobs.add(token, chunks, i)
            if self.finish:
                break
        return pieces

    def echoed(self, prompt_logprobs: Optional[list]) -> str:
        """The echoed prompt's text, once (its logprobs gathered)."""
        if self.echo is None:
            return ""
        (ids, text), self.echo = self.echo, None
        if self.logprobs is not None:
            self.logprobs.add_prompt(ids, prompt_logprobs)
        return text

    def take(self) -> Optional[dict]:
        """The logprobs gathered since the last take, None without logprobs."""
        return None if self.logprobs is None else self.logprobs.take()

    def add(self, token: int) -> str:
        """The text this token lets out; finish is set if it ends the answer.
        BackendError for an id outside the vocabulary (the model's fault: no
        tokenizer is asked to decode it)."""
        if self.vocab is not None and not 0 <= token < self.vocab:
            raise BackendError("BadToken", f"the model answered token id {token}, outside "
                                           f"the tokenizer's vocabulary of {self.vocab}")
        self.tokens += 1
        if token == self.eos or token in self.ends:
            return self.end("stop")
        piece = self.detokenizer.add(token)
        if not piece:
            return ""
        piece, stopped = self.stops.feed(piece)
        if stopped:
            self.finish = "stop"
        return piece

    def end(self, reason: Optional[str]) -> str:
        """The text held back, once the answer ended (at eos, or the engine's
        end) for `reason`."""
        if reason is None:  # never a clean end short of the answer
            raise EngineUnavailable(events.CUT)
        echoed = self.echoed(None)  # an answer of no token
        piece, stopped = self.stops.feed(self.detokenizer.flush())
        if not stopped:
            piece += self.stops.flush()
        self.finish = "stop" if stopped else reason
        return echoed + piece


async def answer(client, request: Request, timeout_s: float, scope, receive, send) -> None:
    """Answers the request through send (EngineError and OpenAIError before
    anything was sent are raised, for the caller to answer)."""
    chunks = request.open(client, timeout_s, request.xs[0], request.runs()[0][2])
    if request.stream:
        return await ChunkEvents(request, chunks, scope, receive, send, timeout_s).run()
    follower = events.Follower(chunks, receive)
    text, pieces = Text(request), []
    try:
        while not text.finish:
            got = await follower.next()
            if got is None:  # its caller left: withdrawn
                return
            pieces += text.feed(got, chunks.prompt_logprobs)
    except StopAsyncIteration:
        pieces.append(text.end(chunks.finish_reason))
    except asyncio.CancelledError:  # the server stops: its drain ran out
        return await send_json(send, 503, of_engine(EngineUnavailable(events.SHUTDOWN)).body())
    finally:
        await follower.close()  # withdraws the request unless it ended
    await send_json(send, 200, {**head(request, False),
                                "choices": [choice(request, "".join(pieces), text.finish,
                                                   logprobs=text.take())],
                                "usage": usage(request, text.tokens)})


class ChunkEvents(events.EventStream):
    """A streamed answer in OpenAI's chunk format: every token's text as it
    comes (a chat's first event names the role), the last choice chunk with
    finish_reason, then the usage chunk if asked, then [DONE]; an error as OpenAI's
    error object in a last event, with no [DONE]. A text chunk's event is its
    text written between two strings made once per request. With logprobs or
    echo, a wake's tokens are one chunk: their text and logprobs (the echoed
    prompt's first)."""

    def __init__(self, request: Request, chunks, scope, receive, send, timeout_s: float) -> None:
        super().__init__(chunks, scope, receive, send, timeout_s)
        self.request, self.text = request, Text(request)
        self.first = request.chat  # the role chunk is still to come
        self.blocks = request.logprobs is not None or request.echo  # a chunk per wake
        sample = sse(chunk(request, MARK))  # the event of a text chunk, its text MARK
        # the text is the event's last string (a model named MARK comes before it)
        self.before, _, self.after = sample.rpartition(events.dumps(MARK))

    def events(self, chunks, finish_reason) -> bytes:
        request, text, out = self.request, self.text, []
        if self.first:
            self.first = False
            out.append(sse(chunk(request, ROLE)))
        if self.blocks:
            return self.block(chunks, out)
        for token in request.served.tokens(chunks):
            try:
                piece = text.add(token)
            except Exception as e:  # the text so far goes out, then the error
                raise events.Failed("".join(out).encode(), e) from None
            if text.finish:
                out.append(sse(chunk(request, piece, text.finish)))
                raise events.Finished("".join(out).encode(), text.finish)
            if piece:
                out.append(self.before + events.dumps(piece) + self.after)
        return "".join(out).encode()

    def block(self, chunks, out: List[str]) -> bytes:
        """The events of a wake's tokens as one chunk, with their logprobs."""
        request, text = self.request, self.text
        try:
            piece = "".join(text.feed(chunks, self.chunks.prompt_logprobs))
        except Exception as e:  # the text so far goes out, then the error
            raise events.Failed("".join(out).encode(), e) from None
        out.append(sse(chunk(request, piece, text.finish, logprobs=text.take())))
        if text.finish:
            raise events.Finished("".join(out).encode(), text.finish)
        return "".join(out).encode()

    def end(self, finish_reason: str) -> bytes:
        request, text, out = self.request, self.text, []
        if not text.finish:  # the engine ended it: the text held back goes out
            piece = text.end(finish_reason)
            out.append(sse(chunk(request, piece, text.finish, logprobs=text.take())))
        if request.include_usage:
            out.append(sse({**head(request, True), "choices": [],
                            "usage": usage(request, text.tokens)}))
        return "".join(out).encode() + DONE

    def error_body(self, error: EngineError) -> bytes:
        return json.dumps(of_engine(error).body()).encode()


MARK = "\u2603"  # a text that stands for a chunk's own in the event made once per request
ROLE = {"role": "assistant", "content": ""}  # a chat's first delta


def sse(obj) -> str:
    return "data: " + events.dumps(obj) + "\n\n"


def head(request: Request, streamed: bool) -> dict:
    kind = ("chat.completion" if request.chat else "text_completion") + (
        ".chunk" if streamed and request.chat else "")
    return {"id": request.id, "object": kind, "created": request.created,
            "model": request.served.model}


def choice(request: Request, content: str, finish: Optional[str], index: int = 0,
           logprobs: Optional[dict] = None) -> dict:
    """A choice of a whole (not streamed) answer (logprobs: Text.take()'s)."""
    if request.chat:
        return {"index": index, "message": {"role": "assistant", "content": content},
                "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish}


def chunk(request: Request, piece, finish: Optional[str] = None, index: int = 0,
          logprobs: Optional[dict] = None) -> dict:
    """A streamed chunk of one choice: piece is its text (a chat's delta dict
    for the role chunk); logprobs those of its tokens (Text.take()'s)."""
    if request.chat:
        delta = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": piece, "logprobs": logprobs, "finish_reason": finish}
    out = {**head(request, True), "choices": [choice]}
    if request.include_usage:
        out["usage"] = None
    return out


def usage(request: Request, completion_tokens: int) -> dict:
    """The answer's usage: each prompt's tokens, and the completion_tokens of all its choices."""
    prompt_tokens = sum(map(len, request.prompts))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
