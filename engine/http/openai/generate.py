"""POST /v1/completions and /v1/chat/completions on an iterative engine.

A request is one engine stream: its prompt's token ids (a completion's
prompt, or a chat's messages through the tokenizer's chat template) and the
engine's other inputs from its fields, max_tokens (chat: also
max_completion_tokens) as its max_steps. Each step's token id is decoded
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
from typing import List, Optional

from engine.errors import BackendError, EngineError, EngineUnavailable
from engine.http import events
from engine.http.openai import fields
from engine.http.openai.replies import DONE, of_engine, send_json
from engine.http.openai.text import Detokenizer, Stops


class Request:
    """A completion or chat request, read: its fields by the constructor (no
    tokenizer's work), its text by tokenize()."""

    def __init__(self, served: fields.Served, body: dict, chat: bool) -> None:
        fields.refuse_unhonoured(body)
        self.served, self.chat, self.body = served, chat, body
        self.field = "messages" if chat else "prompt"
        names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        self.max_steps = fields.max_steps(body, names, served.config.max_steps)
        self.stops = fields.stops(body)
        self.stream = fields.flag(body, "stream")
        self.include_usage = self.stream and fields.include_usage(body)
        self.ids: List[int] = []
        self.x = None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    async def tokenize(self) -> "Request":
        served, body = self.served, self.body
        self.ids = await (fields.chat_ids(served, body) if self.chat
                          else fields.prompt_ids(served, body))
        self.x = served.request(self.ids, body, self.field)
        return self


class Text:
    """An answer's text as its tokens come, and why it finished."""

    def __init__(self, request: Request) -> None:
        self.detokenizer = Detokenizer(request.served.tokenizer)
        self.stops = Stops(request.stops)
        self.eos, self.vocab = request.served.eos, request.served.vocab
        self.tokens = 0
        self.finish: Optional[str] = None  # set once the answer is over

    def add(self, token: int) -> str:
        """The text this token lets out; finish is set if it ends the answer.
        BackendError for an id outside the vocabulary (the model's fault: no
        tokenizer is asked to decode it)."""
        if self.vocab is not None and not 0 <= token < self.vocab:
            raise BackendError("BadToken", f"the model answered token id {token}, outside "
                                           f"the tokenizer's vocabulary of {self.vocab}")
        self.tokens += 1
        if token == self.eos:
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
        piece, stopped = self.stops.feed(self.detokenizer.flush())
        if not stopped:
            piece += self.stops.flush()
        self.finish = "stop" if stopped else reason
        return piece


async def answer(client, request: Request, timeout_s: float, scope, receive, send) -> None:
    """Answers the request through send (EngineError and OpenAIError before
    anything was sent are raised, for the caller to answer)."""
    chunks = client.open_stream_async(request.x, timeout_s, max_steps=request.max_steps)
    if request.stream:
        return await ChunkEvents(request, chunks, scope, receive, send, timeout_s).run()
    follower = events.Follower(chunks, receive)
    text, pieces = Text(request), []
    try:
        while not text.finish:
            got = await follower.next()
            if got is None:  # its caller left: withdrawn
                return
            for token in request.served.tokens(got):
                pieces.append(text.add(token))
                if text.finish:
                    break
    except StopAsyncIteration:
        pieces.append(text.end(chunks.finish_reason))
    except asyncio.CancelledError:  # the server stops: its drain ran out
        return await send_json(send, 503, of_engine(EngineUnavailable(events.SHUTDOWN)).body())
    finally:
        await follower.close()  # withdraws the request unless it ended
    content = "".join(pieces)
    if request.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": content},
                  "logprobs": None, "finish_reason": text.finish}
    else:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": text.finish}
    await send_json(send, 200, {**_head(request, False), "choices": [choice],
                                "usage": _usage(request, text)})


class ChunkEvents(events.EventStream):
    """A streamed answer in OpenAI's chunk format: every token's text as it
    comes (a chat's first event names the role), the last choice chunk with
    finish_reason, the usage chunk if asked, then [DONE]; an error as OpenAI's
    error object in a last event, with no [DONE]. A text chunk's event is its
    text written between two strings made once per request."""

    def __init__(self, request: Request, chunks, scope, receive, send, timeout_s: float) -> None:
        super().__init__(chunks, scope, receive, send, timeout_s)
        self.request, self.text = request, Text(request)
        self.first = request.chat  # the role chunk is still to come
        sample = _event(_chunk(request, MARK))  # the event of a text chunk, its text MARK
        # the text is the event's last string (a model named MARK comes before it)
        self.before, _, self.after = sample.rpartition(events.dumps(MARK))

    def events(self, chunks, finish_reason) -> bytes:
        request, text, out = self.request, self.text, []
        if self.first:
            self.first = False
            out.append(_event(_chunk(request, {"role": "assistant", "content": ""})))
        for token in request.served.tokens(chunks):
            try:
                piece = text.add(token)
            except Exception as e:  # the text so far goes out, then the error
                raise events.Failed("".join(out).encode(), e) from None
            if text.finish:
                out.append(_event(_chunk(request, piece, text.finish)))
                raise events.Finished("".join(out).encode(), text.finish)
            if piece:
                out.append(self.before + events.dumps(piece) + self.after)
        return "".join(out).encode()

    def end(self, finish_reason: str) -> bytes:
        request, text, out = self.request, self.text, []
        if not text.finish:  # the engine ended it: the text held back goes out
            out.append(_event(_chunk(request, text.end(finish_reason), text.finish)))
        if request.include_usage:
            out.append(_event({**_head(request, True), "choices": [],
                               "usage": _usage(request, text)}))
        return "".join(out).encode() + DONE

    def error_body(self, error: EngineError) -> bytes:
        return json.dumps(of_engine(error).body()).encode()


MARK = "\u2603"  # a text that stands for a chunk's own in the event made once per request


def _event(obj) -> str:
    return "data: " + events.dumps(obj) + "\n\n"


def _head(request: Request, chunk: bool) -> dict:
    kind = ("chat.completion" if request.chat else "text_completion") + (
        ".chunk" if chunk and request.chat else "")
    return {"id": request.id, "object": kind, "created": request.created,
            "model": request.served.model}


def _chunk(request: Request, piece, finish: Optional[str] = None) -> dict:
    """A streamed chunk of one choice: piece is its text (a chat's delta dict
    for the role chunk)."""
    if request.chat:
        delta = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}
    out = {**_head(request, True), "choices": [choice]}
    if request.include_usage:
        out["usage"] = None
    return out


def _usage(request: Request, text: Text) -> dict:
    return {"prompt_tokens": len(request.ids), "completion_tokens": text.tokens,
            "total_tokens": len(request.ids) + text.tokens}
