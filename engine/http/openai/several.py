"""A completion or chat answered with several choices: a list of prompts, or `n` > 1.

Each prompt is one engine request (a run), all enqueued at once from the
event loop so that they batch with everyone's; if one is refused, those
enqueued are withdrawn (as embeddings' inputs are). A run's tokens make each
of its prompt's n choices where they are one greedy answer (an engine that
does not sample, or temperature 0, as vLLM gives n choices there); a
sampling engine's choices at temperature > 0 are a run each, seeded apart
(engine.http.openai.sampled). A choice's `index` is prompt x n + choice.

The runs are followed as one stream (Runs): each wake reads every run that
moved. A run that ends at eos or a stop string is withdrawn at once, the
others go on; an error of any run ends the whole answer (a stream's with an
error event). Not streamed, the answer lists the choices in index order,
usage summed (each prompt's tokens once, each choice's completion tokens).
Streamed, each chunk carries one choice and its index, as OpenAI and vLLM
stream several, a chat's role chunk first for each (with logprobs or echo,
a run's chunk per wake, as generate.ChunkEvents's); once every choice has
finished, the usage chunk if asked, then [DONE].
"""
import asyncio
import json
from typing import List, Optional

from engine.client.async_streams import Waits
from engine.errors import EngineError, EngineUnavailable
from engine.http import events
from engine.http.openai.generate import ROLE, Request, Text, choice, chunk, head, sse, usage
from engine.http.openai.replies import DONE, of_engine, send_json


class Run:
    """One engine request: the text its tokens make, and the choices it answers."""

    def __init__(self, request: Request, prompt: int, choices: range, sampling) -> None:
        self.request, self.text = request, Text(request, prompt)
        self.prompt, self.choices, self.sampling = prompt, choices, sampling
        self.pieces: List[str] = []  # its text so far, when not streamed

    def take(self, blocks: list, ended: bool, reason: Optional[str],
             prompt_logprobs: Optional[list] = None) -> List[str]:
        """The pieces of text that these blocks of chunks let out, the last one
        the answer's end if they end it (text.finish is then set);
        prompt_logprobs its stream's (an echoed prompt's)."""
        pieces, text = [], self.text
        for block in blocks:
            pieces += text.feed(block, prompt_logprobs)
            if text.finish:
                return pieces
        if ended:
            pieces.append(text.end(reason))  # the engine ended it (reason None: cut short)
        return pieces


class Runs(Waits):
    """The runs' engine streams followed as one, through the interface of an
    AsyncStream that events.Follower and events.EventStream read: ready()
    hands out, for each run that moved, (its index, its blocks of chunks,
    whether it ended, its finish_reason), None while none moved; a run's
    error is raised. A wake of any run wakes it."""

    def __init__(self, streams: list) -> None:
        self.streams = streams
        self.open = list(range(len(streams)))  # the runs still to be read
        self.loop = asyncio.get_running_loop()
        for stream in streams:
            stream.on_wake = self.wake

    def prompt_logprobs(self, i: int) -> Optional[list]:
        """Run i's prompt's logprobs, once its first chunk came (if it asked them)."""
        return self.streams[i].prompt_logprobs

    @property
    def finish_reason(self) -> Optional[str]:
        """Once every run ended: each one's end is in ready()'s items."""
        return None if self.open else "stop"

    def ready(self):
        if not self.open:
            raise StopAsyncIteration
        items = []
        for i in list(self.open):
            blocks, ended = self._take(i)
            if blocks or ended:
                items.append((i, blocks, ended, self.streams[i].finish_reason))
        return items or None

    def _take(self, i: int):
        """(the blocks come on run i, whether it ended): it ends once its slot
        settled, with its last chunk or on the wake of its settle after it."""
        stream = self.streams[i]
        blocks: list = []
        try:
            while True:
                got = stream.ready()
                if got is None:
                    return blocks, False
                blocks.append(got)
                if stream.finish_reason is None:
                    return blocks, False
        except StopAsyncIteration:
            self.open.remove(i)
            return blocks, True

    def drop(self, i: int) -> None:
        """Withdraws run i (its answer is over: a stop string came), unless it ended."""
        if i in self.open:
            self.open.remove(i)
            self.streams[i].close()

    @property
    def final(self) -> bool:
        """Once every run was read to its end, or one run is final (its end or
        its error is what ready() reads next)."""
        return not self.open or any(self.streams[i].final for i in self.open)

    async def aclose(self) -> None:
        """Withdraws every run that has not ended."""
        self.open.clear()
        for stream in self.streams:
            stream.close()


def opened(client, request: Request, runs: List[Run], timeout_s: float) -> Runs:
    """Every run's engine request enqueued now; if one is refused, those
    enqueued before it are withdrawn."""
    streams: list = []
    try:
        for run in runs:
            streams.append(request.open(client, timeout_s, request.xs[run.prompt], run.sampling))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return Runs(streams)


async def answer(client, request: Request, timeout_s: float, scope, receive, send) -> None:
    """Answers the request through send (EngineError and OpenAIError before
    anything was sent are raised, for the caller to answer)."""
    runs = [Run(request, *run) for run in request.runs()]
    streams = opened(client, request, runs, timeout_s)
    if request.stream:
        return await ChoiceEvents(request, runs, streams, scope, receive, send, timeout_s).run()
    follower = events.Follower(streams, receive)
    left = len(runs)
    try:
        while left:
            got = await follower.next()
            if got is None:  # its caller left: withdrawn
                return
            for i, blocks, ended, reason in got:
                run = runs[i]
                run.pieces += run.take(blocks, ended, reason, streams.prompt_logprobs(i))
                if run.text.finish:
                    left -= 1
                    streams.drop(i)
    except asyncio.CancelledError:  # the server stops: its drain ran out
        return await send_json(send, 503, of_engine(EngineUnavailable(events.SHUTDOWN)).body())
    finally:
        await follower.close()  # withdraws the runs that have not ended
    choices = sorted((choice(request, "".join(run.pieces), run.text.finish, index, logprobs)
                      for run in runs for logprobs in (run.text.take(),)
                      for index in run.choices), key=lambda c: c["index"])
    await send_json(send, 200, {**head(request, False), "choices": choices,
                                "usage": usage(request, _completion_tokens(runs))})


class ChoiceEvents(events.EventStream):
    """Several choices streamed in OpenAI's chunk format: each chunk one
    choice's text with its index, the last of each with its finish_reason;
    once all finished, the usage chunk if asked, then [DONE]."""

    def __init__(self, request: Request, runs: List[Run], streams: Runs, scope, receive, send,
                 timeout_s: float) -> None:
        super().__init__(streams, scope, receive, send, timeout_s)
        self.request, self.runs, self.streams = request, runs, streams
        self.left = len(runs)  # the runs not finished
        self.first = request.chat  # the role chunks are still to come
        self.blocks = request.logprobs is not None or request.echo  # a run's chunk per wake

    def events(self, items, finish_reason) -> bytes:
        request, out = self.request, []
        if self.first:
            self.first = False
            out += [sse(chunk(request, ROLE, index=i)) for run in self.runs for i in run.choices]
        for i, blocks, ended, reason in items:
            run = self.runs[i]
            try:
                pieces = run.take(blocks, ended, reason, self.streams.prompt_logprobs(i))
            except Exception as e:  # the text so far goes out, then the error
                raise events.Failed("".join(out).encode(), e) from None
            if self.blocks:
                out += self.block(run, pieces)
                if run.text.finish:
                    self.left -= 1
                    self.streams.drop(i)
                continue
            last = pieces.pop() if run.text.finish else None
            out += [sse(chunk(request, piece, index=c)) for piece in pieces if piece
                    for c in run.choices]
            if last is not None:
                out += [sse(chunk(request, last, run.text.finish, c)) for c in run.choices]
                self.left -= 1
                self.streams.drop(i)
        if not self.left:
            raise events.Finished("".join(out).encode(), "stop")
        return "".join(out).encode()

    def block(self, run: Run, pieces: List[str]) -> List[str]:
        """A run's chunk of these pieces, with their logprobs, for each of its choices."""
        text = run.text
        if not (text.finish or any(pieces) or (text.logprobs and text.logprobs.ids)):
            return []
        piece, logprobs = "".join(pieces), text.take()
        return [sse(chunk(self.request, piece, text.finish, c, logprobs)) for c in run.choices]

    def end(self, finish_reason: str) -> bytes:
        if not self.request.include_usage:
            return DONE
        return sse({**head(self.request, True), "choices": [],
                    "usage": usage(self.request, _completion_tokens(self.runs))}).encode() + DONE

    def error_body(self, error: EngineError) -> bytes:
        return json.dumps(of_engine(error).body()).encode()


def _completion_tokens(runs: List[Run]) -> int:
    return sum(run.text.tokens * len(run.choices) for run in runs)
