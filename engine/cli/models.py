"""serve's engines under `--model-control explicit`: load, unload, and the catalog the HTTP workers route by.

An HTTP worker takes POST /v2/repository/models/NAME/load or /unload and
sends it here, to serve's own control socket (engine.serving.control, on an
abstract address only serve and its workers know, served to serve's uid
alone). One request at a time, each bounded by its engine's timeouts:

- load, of an engine that runs: a reload (Engine.reload: new batchers take
  over, nothing lost), which changes `backend` and `backend_args`; a config
  that changes any other key is refused (unload, then load). Of one that
  does not run (unloaded, or new with a config): it starts, and is added to
  /metrics and the catalog once it serves. A config is a JSON object of
  Engine's keys over the engine's last settings, checked as a TOML table is
  (engine.cli.args.engine_settings, then Engine's own checks).
- unload: UNLOADING (its routes still answer; the engine refuses new
  requests), Engine.stop() (the queued ones are answered), then UNAVAILABLE
  and gone from the catalog's routes.

The catalog (engine.serving.catalog) is written before each answer: once a
caller has its 200, every worker routes by the new set.
"""
import dataclasses
import logging
import os
import secrets
from typing import Dict, List, Optional, Tuple

from engine.cli.args import engine_settings
from engine.config import EngineConfig, EngineOptions
from engine.errors import BackendError, EngineError
from engine.segment import remove_if_dead
from engine.serving import catalog, control
from engine.serving.supervisor import Engine

log = logging.getLogger("shmbatch")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
CHOICES = ("none", "explicit")  # --model-control, in Triton's words
RELOADABLE = ("backend", "backend_args")  # what a reload changes (engine.serving.reloading)
CLOSE_WAIT_S = 30.0  # serve's stop waits this long for a load in progress


class Refused(Exception):
    """A load or unload not done: its HTTP status and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Repository:
    """The engines of `serving` (engine.cli.serve.Serving: its `engines`
    list, `collectors` and `openai`), loaded and unloaded on request;
    `settings` each engine's keys as serve started it."""

    def __init__(self, serving, settings: List[dict]) -> None:
        self.serving = serving
        self.settings: Dict[str, dict] = {s["name"]: dict(s) for s in settings}
        self.states: Dict[str, Tuple[str, str]] = {}  # name -> (state, reason), when not READY
        # the engine objects ever started under each name: a worker's Client of an
        # engine restarted with the same config is a Client of a gone segment
        self.starts: Dict[str, int] = {name: 1 for name in self.settings}
        self.catalog = catalog.Writer()
        self.address = f"\0shmbatch-serve-{os.getpid()}-{secrets.token_hex(8)}"
        self._closed = False
        self._server: Optional[control.Server] = None
        self.publish()

    def listen(self) -> None:
        self._server = control.Server("serve", self.handle, at=self.address)

    def close(self) -> None:
        """No request after this; one in progress finishes (an engine it
        starts meanwhile is stopped again)."""
        self._closed = True
        if self._server is not None:
            self._server.close()
            self._server.join(CLOSE_WAIT_S)
            self._server = None

    def release(self) -> None:
        """Drops serve's hold on the catalog (once the workers are gone)."""
        self.catalog.close()

    def _running(self, name: str) -> Optional[Engine]:
        return next((e for e in self.serving.engines if e.name == name), None)

    def publish(self) -> None:
        entries = []
        for name in sorted(self.settings):
            eng = self._running(name)
            state, reason = self.states.get(name, (READY if eng else UNAVAILABLE, ""))
            entries.append({"name": name, "state": state, "reason": reason,
                            "config": None if eng is None else eng.config.to_json().decode(),
                            "start": self.starts.get(name, 0)})
        self.catalog.write(entries)

    def _set(self, name: str, state: Optional[str], reason: str = "") -> None:
        if state is None:
            self.states.pop(name, None)
        else:
            self.states[name] = (state, reason)
        self.publish()

    # -- the control socket's requests ----------------------------------------
    def handle(self, request: dict) -> dict:
        """{"op": "load", "name", "config": {...} or None} or {"op": "unload",
        "name"} -> {"ok": True} or {"ok": False, "status", "error"}."""
        op, name = request.get("op"), request.get("name")
        try:
            if self._closed:
                raise Refused(503, "serve is stopping: no model is loaded or unloaded now")
            if not isinstance(name, str):
                raise Refused(400, f"expected a model's name, got {name!r}")
            if op == "load":
                self.load(name, request.get("config"))
            elif op == "unload":
                self.unload(name)
            else:
                raise Refused(400, f"unknown op {op!r}: expected 'load' or 'unload'")
        except Refused as e:
            log.warning("model control: %s %s refused: %s", op, name, e)
            return {"ok": False, "status": e.status, "error": str(e)}
        except Exception as e:  # the socket's thread outlives one bad request
            log.exception("model control: %s %s failed", op, name)
            return {"ok": False, "status": 500, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True}

    def load(self, name: str, config: Optional[dict]) -> None:
        base = self.settings.get(name)
        if config is None and base is None:
            raise Refused(400, f"unknown model {name!r}: expected parameters.config holding "
                               f"its keys (backend and its tensors at least), got none; this "
                               f"server has {sorted(self.settings)}")
        where = f"model {name!r}: parameters.config"
        try:
            settings = _settings(name, config, base, where)
            new = Engine(**settings)
        except (ValueError, TypeError) as e:
            message = str(e)
            raise Refused(400, message if message.startswith(where) else f"{where}: {message}") \
                from None
        if base is not None and name in (self.serving.openai or {}):
            old = Engine(**base)  # creates nothing
            if (old.config.input_specs, old.config.output_specs) != \
                    (new.config.input_specs, new.config.output_specs):
                raise Refused(400, f"{where}: model {name!r} is served on the OpenAI API, whose "
                                   f"settings were checked against its tensors: expected its "
                                   f"tensors as serve started it, got others")
        running = self._running(name)
        if running is not None:
            self._reload(running, new, settings)
        else:
            self._start(new, settings)

    def _reload(self, running: Engine, new: Engine, settings: dict) -> None:
        name = running.name
        changed = _changed(running.config, new.config) + [
            k for k in _changed(running.options, new.options) if k not in RELOADABLE]
        if changed:
            raise Refused(400, f"model {name!r} is loaded: a load reloads it, which changes "
                               f"{' and '.join(RELOADABLE)} alone; got a new "
                               f"{', '.join(changed)} (unload it, then load it with that config)")
        try:
            running.reload(new.options.backend, new.options.backend_args)
        except EngineError as e:
            raise Refused(500, f"model {name!r}: the reload failed ({type(e).__name__}: {e})") \
                from None
        self.settings[name] = settings
        log.info("model control: %s reloaded", name)

    def _start(self, new: Engine, settings: dict) -> None:
        name = new.name
        self._set(name, LOADING, "starting")
        try:
            remove_if_dead(name)  # a crashed engine's leftover of this name
            new.start()  # returns once a batcher serves (it registers before it says ready)
        except Exception as e:
            new.stop()
            why = f"{type(e).__name__}: {e}"
            self.settings.setdefault(name, settings)
            self._set(name, UNAVAILABLE, f"load failed: {why}")
            status = 500 if isinstance(e, BackendError) else 400
            raise Refused(status, f"model {name!r} did not start: {why}") from None
        if self._closed:  # serve stops: it would serve nobody, and nobody would stop it
            new.stop()
            raise Refused(503, f"model {name!r}: serve is stopping")
        self.starts[name] = self.starts.get(name, 0) + 1
        self.serving.engines.append(new)
        if self.serving.collectors is not None:
            self.serving.collectors.add(new.segment)
        self.settings[name] = settings
        self._set(name, None)
        log.info("model control: %s loaded", name)

    def unload(self, name: str) -> None:
        running = self._running(name)
        if running is None:
            if name in self.settings:
                return  # unloaded already, as Triton answers
            raise Refused(404, f"unknown model {name!r}; this server has "
                               f"{sorted(self.settings)}")
        self._set(name, UNLOADING, "draining: the requests it holds are answered")
        if self.serving.collectors is not None:
            self.serving.collectors.remove(running.segment)
        running.stop()
        self.serving.engines.remove(running)
        self._set(name, UNAVAILABLE, "unloaded")
        log.info("model control: %s unloaded", name)


def _settings(name: str, config, base: Optional[dict], where: str) -> dict:
    """The engine's settings: config's keys over base's (the last ones), or
    base as it was."""
    if config is None:
        assert base is not None
        return dict(base)
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object of Engine's keys, got "
                         f"{type(config).__name__}")
    if config.get("name", name) != name:
        raise ValueError(f"{where}: the model's name is the route's, {name!r}; got name = "
                         f"{config['name']!r}")
    return engine_settings({**(base or {}), **config, "name": name}, None, where)


def _changed(old, new) -> List[str]:
    kinds = {EngineConfig, EngineOptions}
    assert type(old) in kinds and type(new) is type(old)
    return [f.name for f in dataclasses.fields(old) if getattr(old, f.name) != getattr(new, f.name)]
