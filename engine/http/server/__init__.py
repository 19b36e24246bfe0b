"""The HTTP front's processes and connections: what a protocol never sees.

`workers` serve's side of its HTTP worker processes (bind, start, replace,
stop: each runs engine.http.worker); `connections` what a connection may
cost, and `writes` how its answers are written (the two modules that reach
into uvicorn's internals); `parsing` bodies parsed off the event loop (in a
thread, or the parser process).
"""
