"""A WSGI app whose workers reach the model through a shmbatch sidecar.

Run with `gunicorn --preload`: the Client is made once, at import, in the
master, and every forked worker uses it. SHMBATCH_NAME names the engine;
with SHMBATCH_IN_WORKER=1 the model runs inside each worker instead (the
deployment shmbatch replaces: no batching, one model per worker).
"""
import os

import numpy as np

import engine
from engine import backends

NAME = os.environ.get("SHMBATCH_NAME", "demo")
if os.environ.get("SHMBATCH_IN_WORKER") == "1":
    model = backends.synthetic(float(os.environ.get("SHMBATCH_FIXED_MS", "2.0")),
                               float(os.environ.get("SHMBATCH_PER_ITEM_US", "100.0")))
    client = None
else:
    model = None
    client = engine.Client(NAME)


def app(environ, start_response):
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    x = np.frombuffer(body, dtype=np.float32)
    try:
        y = model(x[None])[0] if model is not None else client.infer(x, timeout=5.0)
    except engine.InvalidInput as e:
        status, y = "400 Bad Request", str(e).encode()
    except (engine.EngineUnavailable, engine.QueueFull) as e:
        status, y = "503 Service Unavailable", str(e).encode()
    except engine.EngineError as e:
        status, y = "500 Internal Server Error", str(e).encode()
    else:
        status, y = "200 OK", y.astype(np.float32).tobytes()
    start_response(status, [("Content-Type", "application/octet-stream"),
                            ("Content-Length", str(len(y)))])
    return [y]
