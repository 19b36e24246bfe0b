"""A simple Python streaming server doing the decoder bench's model work: FastAPI + StreamingResponse.

The baseline row of `shmbatch bench --model decoder --baseline`. It runs the
same model as the bench's iterative engine (engine.tools.decoder's step model,
DecoderSteps: the same weights, the same join and step calls) in its own
process, with the simplest continuous batching one would write in an
afternoon: one model thread; before each step every waiting request joins
the running batch (first come, first served, up to --max-batch-size; its
prompt prefilled at join), the step decodes one token for each running
request, a request leaves at its max_steps (or when the model ends it), and
the step's tokens are handed to the event loop at once (one
call_soon_threadsafe a step) into each request's asyncio queue. Each
request is a StreamingResponse of server-sent events read from its queue.

No admission, no deadlines, no limit on what waits: a request waits until a
row of the batch is free. A caller that disconnects has its row dropped at
the next step.

    POST /v2/models/NAME/generate_stream   {"INPUT": [token ids], "parameters": {"max_steps": n}}
        -> data: {"model_name": NAME, "model_version": "1", "OUTPUT": token} per token, the
           last one with "finish_reason" ("length" at max_steps, "stop" at the context's end)
    GET  /stats                            {"avg_batch_size", "steps_total"}

    python bench/fastapi_stream_baseline.py --port 0 --name dec --model '{"d_model": 128}'

prints `fastapi_stream_baseline: ready on http://HOST:PORT` once it serves.
"""
import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import socket
import sys
import threading

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.tools import decoder


class Stream:
    """One request: its prompt, the tokens it still wants, its queue of (token, finish)."""

    ids = itertools.count()

    def __init__(self, prompt: np.ndarray, steps: int) -> None:
        self.id = next(Stream.ids)
        self.prompt, self.left = prompt, steps
        self.queue: asyncio.Queue = asyncio.Queue()
        self.gone = False


class Batcher:
    """The model's thread: continuous batching of the simplest kind."""

    def __init__(self, model_args: dict, max_batch_size: int, loop) -> None:
        self.model = decoder.steps(**model_args)
        self.max_batch_size, self.loop = max_batch_size, loop
        self.waiting: collections.deque = collections.deque()
        self.running: dict = {}
        self.wake = threading.Condition()
        self.steps_total = self.rows_total = 0
        threading.Thread(target=self.run, daemon=True).start()

    def submit(self, stream: Stream) -> None:
        with self.wake:
            self.waiting.append(stream)
            self.wake.notify()

    def run(self) -> None:
        while True:
            with self.wake:
                while not self.waiting and not self.running:
                    self.wake.wait()
                joining = []
                while self.waiting and len(self.running) + len(joining) < self.max_batch_size:
                    joining.append(self.waiting.popleft())
            for s in joining:
                if not s.gone:
                    self.model.join(np.array([s.id]), s.prompt[None, :])
                    self.running[s.id] = s
            for s in [s for s in self.running.values() if s.gone]:
                self._leave(s)
            if not self.running:
                continue
            ids = np.fromiter(self.running, np.int64, len(self.running))
            out, done = self.model.step(ids)
            self.steps_total += 1
            self.rows_total += len(ids)
            handed = []
            for rid, token, end in zip(ids.tolist(), out.tolist(), done.tolist()):
                s = self.running[rid]
                s.left -= 1
                finish = "length" if s.left == 0 else "stop" if end else None
                if finish:
                    self._leave(s)
                handed.append((s, token, finish))
            self.loop.call_soon_threadsafe(_deliver, handed)

    def _leave(self, s: Stream) -> None:
        del self.running[s.id]
        self.model.leave(np.array([s.id]))


def _deliver(handed) -> None:
    for s, token, finish in handed:
        s.queue.put_nowait((token, finish))


def app_of(args) -> FastAPI:
    model_args = json.loads(args.model)
    vocab = decoder.Decoder(**model_args).vocab
    state = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["batcher"] = Batcher(model_args, args.max_batch_size, asyncio.get_running_loop())
        print(f"fastapi_stream_baseline: ready on {state['url']}", flush=True)
        yield

    app = FastAPI(lifespan=lifespan)
    app.state.shared = state

    @app.post("/v2/models/{name}/generate_stream")
    async def generate_stream(name: str, request: Request):
        if name != args.name:
            return JSONResponse({"error": f"no model {name!r}"}, status_code=404)
        body = await request.json()
        try:
            prompt = np.asarray(body["INPUT"], np.int64)
            steps = int(body.get("parameters", {}).get("max_steps", args.max_steps))
        except (KeyError, TypeError, ValueError) as e:
            return JSONResponse({"error": f"expected {{\"INPUT\": [ids]}}: {e}"}, status_code=400)
        if (prompt.ndim != 1 or not 1 <= len(prompt) <= args.max_prompt or prompt.min() < 0
                or prompt.max() >= vocab or not 1 <= steps <= args.max_steps):
            return JSONResponse({"error": "expected 1..max_prompt token ids in [0, vocab) and "
                                          "1 <= max_steps <= the server's"}, status_code=400)
        stream = Stream(prompt, steps)
        state["batcher"].submit(stream)

        async def events():
            try:
                while True:
                    token, finish = await stream.queue.get()
                    event = {"model_name": name, "model_version": "1", "OUTPUT": token}
                    if finish:
                        event["finish_reason"] = finish
                    yield f"data: {json.dumps(event)}\n\n"
                    if finish:
                        return
            finally:
                stream.gone = True  # a caller that left: its row is dropped at the next step

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/stats")
    async def stats():
        b = state["batcher"]
        return {"avg_batch_size": b.rows_total / max(1, b.steps_total),
                "steps_total": b.steps_total}

    return app


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--name", default="decoder", help="the model's name in the route")
    p.add_argument("--model", default="{}", help="engine.tools.decoder.Decoder's arguments, as JSON")
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=128)
    args = p.parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    app = app_of(args)
    app.state.shared["url"] = "http://%s:%d" % sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
