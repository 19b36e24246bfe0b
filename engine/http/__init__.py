"""The HTTP front: one ASGI app over the engines' Clients, mounting each protocol.

Its rooms, top down; a module imports only from its own room or those below
(tests/test_architecture.py reads this table); oip and openai never import
each other; grpc reads its requests by oip's rules:

    worker   one HTTP worker process of `serve --http-port`: uvicorn running the front
    front    the ASGI app: the engines' Clients, the lifespan, each protocol mounted
    grpc     the Open Inference Protocol over gRPC, beside the ASGI app on its loop
    oip      the Open Inference Protocol (KServe v2, Triton's extensions)
    openai   the OpenAI API (/v1/)
    server   the processes and connections around the app, knowing no protocol
    (shared) what every protocol speaks, directly in engine/http:

`asgi` the ASGI types, named once, and a whole response; `errors` what is
refused and each engine error's status; `body` a body under its limit and
the 413; `encoding` a body's Content-Encoding, undone in bounded steps; `values` JSON values as an engine's arrays, and as a refusal
shows them; `watch` a caller's disconnect and deadline, watched; `events`
a stream followed at the engine's pace and written as server-sent events;
`engines` the engines a worker serves, a Client each; `auth` the API key a
request must present.
"""
