"""Several engines in one `shmbatch serve`, and what serves them all: /metrics, HTTP and gRPC.

All start or none. Every engine is built (its settings validated) before
any is created, and the HTTP port is bound (the gRPC port held) before any starts; then the
segments crashed engines of these names left are removed (a restart after a
crash finds its /dev/shm as the crash left it), and the engines start one
after another, and one that fails stops those already
serving, so the start fails naming it with nothing left in /dev/shm and no
process behind. Ready means every engine serves, /metrics is up and every
HTTP worker has attached to every engine.

A stop (serve's SIGINT or SIGTERM) first stops the HTTP workers, whose
requests in progress are answered by the engines still serving (a new
connection meanwhile is answered 503 at once), then drains every engine at
once: each refuses new requests, answers the queued ones and removes its
segment.
"""
import logging
import os
import threading
from typing import Dict, List, Optional

from engine.errors import EngineError
from engine.segment import remove_if_dead
from engine.cli import models
from engine.serving import metrics
from engine.serving.metrics_compat import parse as metrics_compat_kinds
from engine.serving.supervisor import Engine

log = logging.getLogger("shmbatch")


class StartFailed(EngineError):
    """One engine of several did not start; none serves."""


class Serving:
    """The engines of one serve (each a dict of Engine(...)'s keywords) and,
    when asked, their /metrics and the Open Inference Protocol over HTTP."""

    def __init__(self, engines: List[dict], *, metrics_port: Optional[int] = None,
                 metrics_host: Optional[str] = None, metrics_compat=None,
                 http_port: Optional[int] = None,
                 http_host: Optional[str] = None, http_workers: Optional[int] = None,
                 grpc_port: Optional[int] = None, grpc_host: Optional[str] = None,
                 http_timeout_s: Optional[float] = None,
                 http_max_body_bytes: Optional[int] = None,
                 http_read_timeout_s: Optional[float] = None,
                 http_max_connections: Optional[int] = None,
                 openai: Optional[Dict[str, dict]] = None,
                 api_key: Optional[str] = None, model_control: Optional[str] = None) -> None:
        self.engines: List[Engine] = []
        several = len(engines) > 1  # a single engine's errors read as they always did
        for settings in engines:
            with _Naming(settings.get("name") if several else None):
                self.engines.append(Engine(**settings))
        self.metrics_port, self.metrics_host = metrics_port, metrics_host or "127.0.0.1"
        self.metrics_compat = metrics_compat_kinds(metrics_compat)
        if self.metrics_compat and metrics_port is None:
            raise ValueError(f"--metrics-compat {','.join(self.metrics_compat)}: the names are "
                             f"served on /metrics: expected --metrics-port (or metrics_port in "
                             f"--config), got none")
        self.http_port, self.http_host = http_port, http_host or "127.0.0.1"
        given = {"--http-host": http_host, "--http-workers": http_workers,
                 "--http-timeout-s": http_timeout_s, "--http-max-body-bytes": http_max_body_bytes,
                 "--http-read-timeout-s": http_read_timeout_s,
                 "--http-max-connections": http_max_connections, "--api-key": api_key,
                 "--grpc-port": grpc_port, "--grpc-host": grpc_host,
                 "--model-control": model_control if model_control == "explicit" else None}
        if http_port is None:
            if any(v is not None for v in given.values()):
                raise ValueError(f"{', '.join(k for k, v in given.items() if v is not None)} "
                                 f"without --http-port (or http_port in --config)")
        else:
            self._check_http(http_workers, http_timeout_s, http_max_body_bytes)
            self._check_connections(http_read_timeout_s, http_max_connections)
            from engine.http import auth
            self._api_key = None if api_key is None else auth.checked(api_key)
        self.grpc_port, self.grpc_host = grpc_port, grpc_host or "127.0.0.1"
        if grpc_port is not None:
            _check_grpc(grpc_port)
        elif grpc_host is not None:
            raise ValueError("--grpc-host without --grpc-port (or grpc_port in --config)")
        self.openai = self._check_openai(openai or {})
        self.model_control = model_control or "none"
        if self.model_control not in models.CHOICES:
            raise ValueError(f"expected --model-control {' or '.join(models.CHOICES)}, got "
                             f"{model_control!r}")
        self._settings = engines  # each engine's keys, for --model-control explicit
        self.collectors: Optional[metrics.Collectors] = None  # /metrics' engines
        self.repository: Optional[models.Repository] = None
        self._sock = None
        self._grpc_sock = None  # the gRPC port, held bound (engine.http.server.workers.reserve)
        self._workers = None

    def _check_http(self, workers, timeout_s, max_body_bytes) -> None:
        import importlib.util
        if importlib.util.find_spec("uvicorn") is None or \
                importlib.util.find_spec("httptools") is None:
            raise ValueError("--http-port needs uvicorn and httptools: "
                             "pip install 'shmbatch[http]'")
        from engine.http.engines import DEFAULT_TIMEOUT_S
        from engine.http.values import datatype_of
        self.http_workers = 1 if workers is None else int(workers)
        self.http_timeout_s = float(DEFAULT_TIMEOUT_S if timeout_s is None
                                    else timeout_s)
        # None: each model's limit derived from its engine (engine.http.oip.request)
        self.http_max_body_bytes = None if max_body_bytes is None else int(max_body_bytes)
        if (self.http_workers < 1 or not self.http_timeout_s > 0
                or (self.http_max_body_bytes is not None and self.http_max_body_bytes < 1)):
            raise ValueError(f"expected --http-workers >= 1, --http-timeout-s > 0 and "
                             f"--http-max-body-bytes >= 1, got {self.http_workers}, "
                             f"{self.http_timeout_s:g} and {self.http_max_body_bytes}")
        for eng in self.engines:  # every tensor needs a datatype of the protocol
            with _Naming(eng.name):
                for spec in eng.config.input_specs + eng.config.output_specs:
                    datatype_of(spec.dtype)

    def _check_openai(self, tables: Dict[str, dict]) -> Dict[str, dict]:
        """{engine: its OpenAI settings}, each [engines.NAME.openai] table
        checked against its engine's tensors (engine.http.openai.settings)."""
        if not tables:
            return {}
        if self.http_port is None:
            raise ValueError(f"[engines.{next(iter(tables))}.openai]: the OpenAI API is served on "
                             f"the HTTP port: expected --http-port (or http_port in --config), "
                             f"got none")
        from engine.http.openai import settings as openai_settings
        configs = {eng.name: eng.config for eng in self.engines}
        settings = [openai_settings.parse(name, table, configs[name])
                    for name, table in tables.items()]
        openai_settings.check_all(settings)
        return {s.engine: s.to_dict() for s in settings}

    def _check_connections(self, read_timeout_s, max_connections) -> None:
        from engine.http.server import connections
        self.http_read_timeout_s = float(connections.DEFAULT_READ_TIMEOUT_S
                                         if read_timeout_s is None else read_timeout_s)
        self.http_max_connections = None if max_connections is None else int(max_connections)
        if not self.http_read_timeout_s > 0:
            raise ValueError(f"expected --http-read-timeout-s > 0, got "
                             f"{self.http_read_timeout_s:g}")
        if self.http_max_connections is not None and self.http_max_connections < 1:
            raise ValueError(f"expected --http-max-connections >= 1, got {max_connections}")

    @property
    def names(self) -> List[str]:
        return [eng.name for eng in self.engines]

    # -- lifecycle ----------------------------------------------------------------
    def start(self) -> None:
        """Starts every engine, /metrics and the HTTP workers; on any failure
        stops what started and raises."""
        try:
            if self.http_port is not None:
                from engine.http.server import workers
                self._sock = workers.bind(self.http_host, self.http_port)
                if self.grpc_port is not None:
                    self._grpc_sock = workers.reserve(self.grpc_host, self.grpc_port)
            # every crashed engine's leftover goes before the first size check:
            # the space one holds may be what another of these engines needs
            for step in (lambda eng: remove_if_dead(eng.name), lambda eng: eng.start()):
                for eng in self.engines:
                    try:
                        step(eng)
                    except Exception as e:
                        if len(self.engines) == 1:
                            raise
                        raise StartFailed(f"engine {eng.name!r} did not start: "
                                          f"{type(e).__name__}: {e}") from e
            if self.metrics_port is not None:
                self.collectors = metrics.Collectors([eng.segment for eng in self.engines])
                try:
                    metrics.serve_http(self.collectors, self.metrics_port, self.metrics_host,
                                       self.metrics_compat)
                except OSError as e:
                    raise OSError(f"--metrics-port {self.metrics_port}: cannot listen on "
                                  f"{self.metrics_host}:{self.metrics_port} "
                                  f"({e.strerror or e})") from None
                log.info("metrics on http://%s:%d/metrics", self.metrics_host, self.metrics_port)
            if self._sock is not None:
                if self.model_control == "explicit":
                    self.repository = models.Repository(self, self._settings)
                    self.repository.listen()
                self._start_http()
        except BaseException:
            self.stop()
            raise

    def _start_http(self) -> None:
        from engine.http.server import workers
        self._workers = workers.Workers(
            self._sock, self.http_workers, {e.name: e.config.to_json() for e in self.engines},
            timeout_s=self.http_timeout_s, max_body_bytes=self.http_max_body_bytes,
            graceful_s=max(e.options.drain_timeout_s for e in self.engines),
            read_timeout_s=self.http_read_timeout_s, max_connections=self.http_max_connections,
            log_level=logging.getLevelName(log.getEffectiveLevel()), openai=self.openai,
            api_key=self._api_key,
            catalog_fd=None if self.repository is None else self.repository.catalog.fd,
            control_at=None if self.repository is None else self.repository.address,
            grpc_at=None if self._grpc_sock is None else
            (self.grpc_host, self._grpc_sock.getsockname()[1]))
        self._workers.start()
        log.info("Open Inference Protocol on %s%s (%d HTTP worker(s), pids %s%s)", self.http_url,
                 f" and gRPC {self.grpc_url}" if self.grpc_url else "",
                 self.http_workers, self._workers.pids,
                 "; every route but the health probes needs the API key" if self._api_key
                 else "")

    @property
    def http_url(self) -> Optional[str]:
        return None if self._sock is None else f"http://{_address(self._sock)}"

    @property
    def grpc_url(self) -> Optional[str]:
        """host:port of the gRPC server (None: none), as a gRPC client takes it."""
        return None if self._grpc_sock is None else _address(self._grpc_sock)

    def ready_line(self) -> str:
        if len(self.engines) == 1:
            eng = self.engines[0]
            line = (f"shmbatch serve: engine {eng.name!r} ready (pid {os.getpid()}, batchers "
                    f"{eng.stats()['batcher_pids']})")
        else:
            each = ", ".join(f"{e.name!r} (batchers {e.stats()['batcher_pids']})"
                             for e in self.engines)
            line = f"shmbatch serve: engines {each} ready (pid {os.getpid()})"
        if self._workers is not None:
            line += f"; Open Inference Protocol on {self.http_url}"
            if self._grpc_sock is not None:
                line += f" and gRPC {self.grpc_url}"
        return line

    def watch(self) -> None:
        """What serve does every second while it serves, never waiting: a new
        HTTP worker in place of one that died (one that fails to start is
        tried again later and later, at most every 10 s)."""
        if self._workers is not None:
            self._workers.watch()

    def stop(self) -> None:
        """Stops the HTTP workers, then drains every engine at once."""
        if self.repository is not None:
            self.repository.close()  # a load in progress ends first
        if self._workers is not None:
            self._workers.stop()
            self._workers = None
        for sock in (self._sock, self._grpc_sock):
            if sock is not None:
                sock.close()
        self._sock = self._grpc_sock = None
        if self.repository is not None:
            self.repository.release()
            self.repository = None
        stoppers = [threading.Thread(target=_stop, args=(eng,), name=f"shmbatch-stop-{eng.name}")
                    for eng in self.engines]  # stop() of one not started returns at once
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()


def _check_grpc(port) -> None:
    """ValueError unless the gRPC server can be served: grpcio and protobuf installed."""
    import importlib.util
    find = importlib.util.find_spec
    if find("grpc") is None or find("google.protobuf") is None:
        raise ValueError(f"--grpc-port {port} needs grpcio and protobuf: "
                         f"pip install 'shmbatch[grpc]'")


def _address(sock) -> str:
    """host:port a socket is bound to (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"{f'[{host}]' if ':' in host else host}:{port}"


def _stop(eng: Engine) -> None:
    try:
        eng.stop()
    except Exception:
        log.exception("engine %s did not stop cleanly", eng.name)


class _Naming:
    """A ValueError or TypeError raised inside (a bad setting) names the
    engine it is about (unless name is None)."""

    def __init__(self, name) -> None:
        self.name = name

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if self.name is None or kind is None or not issubclass(kind, (ValueError, TypeError)):
            return False
        raise ValueError(f"engine {self.name!r}: {error}") from None
