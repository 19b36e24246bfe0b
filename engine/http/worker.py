"""One HTTP worker process of `shmbatch serve --http-port`: uvicorn running the front.

Started by serve's engine.http.server.workers (through engine.launch) on the
listening socket serve passed, it runs uvicorn with the front
(engine.http.front) and the connections' guard (engine.http.server.connections),
and says it is ready once its Clients attached (the lifespan's startup) and,
with serve's --grpc-port, its gRPC server listens (engine.http.grpc.server).
It dies with serve (parent-death signal), raises its open-file limit to the
hard limit and its oom_score_adj by 500.
"""
import logging
import socket
import sys

from engine import launch, logfmt
from engine.http.server.workers import BACKLOG


def _entry() -> None:
    """A worker process (engine.launch): uvicorn with the protocol's app on the
    socket serve passed."""
    from engine.shm import liveness
    liveness.die_with_parent(launch.parent_pid())
    args, ready = launch.child_args()
    logging.basicConfig(level=args["log_level"].upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = None
    try:
        import uvicorn

        from engine.config import EngineConfig
        from engine.http.front import Front
        from engine.http.server import connections
        connections.raise_oom_score()
        nofile = connections.raise_nofile()
        # rebuilt from the fd, the socket's protocol is read from it: asyncio sets
        # TCP_NODELAY on accepted connections only when it is IPPROTO_TCP (a
        # socket rebuilt with proto 0 leaves Nagle's algorithm on, and a
        # keep-alive request then waits ~40 ms for the client's delayed ACK)
        sock = socket.socket(fileno=args["fd"])
        configs = {name: EngineConfig.from_json(blob) for name, blob in args["configs"].items()}
        cap = connections.max_connections(args["max_connections"], nofile)
        grpc_at = args.get("grpc_at")
        app = Front(configs, args["timeout_s"], args["max_body_bytes"],
                    on_ready=lambda: launch.tell_ready(ready), openai=args.get("openai"),
                    api_key=args.get("api_key"), catalog_fd=args.get("catalog_fd"),
                    control_at=args.get("control_at"), regions_fd=args.get("regions_fd"),
                    grpc_at=None if grpc_at is None else tuple(grpc_at), max_rpcs=cap)
        guard = connections.Guard(args["read_timeout_s"], cap, app.whole)
        # uvicorn's own lines at INFO (four per worker start and stop) say what
        # serve's one line says already
        level = max(logging.getLevelName(args["log_level"].upper()), logging.WARNING)
        # JSON (engine.logfmt): uvicorn's loggers go to the root's handler, not its own text
        logs: dict = {"log_config": None} if logfmt.json_chosen() else {}
        # proxy_headers off: no route reads the client's address or scheme, and
        # uvicorn's middleware for them costs a coroutine and a header scan a request
        config = uvicorn.Config(app, lifespan="on", log_level=level, access_log=False, **logs,
                                proxy_headers=False,
                                timeout_graceful_shutdown=args["graceful_s"],
                                http=connections.protocol(guard), backlog=BACKLOG)
        connections.quiet_floods()
        graceful_s = args["graceful_s"]
        connections.Server(config, guard, lambda: app.drain(graceful_s)).run(sockets=[sock])
    except BaseException as e:
        if app is not None and app.startup_error is not None:  # uvicorn exits (SystemExit 3)
            launch.tell_failed(ready, launch.ChildFailed("StartFailed", app.startup_error))
        else:
            launch.tell_failed(ready, e)
        if app is None:  # failed to start: told, and serve says it in one line
            raise SystemExit(1) from None
        raise
    if app is not None and app.startup_error is not None:  # an older uvicorn returns
        launch.tell_failed(ready, launch.ChildFailed("StartFailed", app.startup_error))
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("engine.http.worker runs as a child of shmbatch serve (engine.launch)")
