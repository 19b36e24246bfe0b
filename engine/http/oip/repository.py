"""Triton's model repository extension: POST /v2/repository/index, .../models/NAME/load and /unload.

The index lists every engine with its state: READY (it serves), UNAVAILABLE
(not running, not yet serving, or unloaded: `reason` says which), and under
`serve --model-control explicit` also LOADING and UNLOADING; a body
`{"ready": true}` keeps the READY ones. Load and unload are serve's to do
(engine.cli.models), reached through engine.http.engines; without
--model-control explicit (Triton's mode "none") they are refused, 400.

A load's body may carry `parameters.config`: Engine's keys as a JSON object,
or as a JSON string holding one (Triton's client sends a string). Its
"file:" parameters (a model directory's files) are refused: an engine has
no files to override. Other parameters are ignored, as Triton does.
"""
import json
from typing import List, Optional

from engine.errors import EngineUnavailable
from engine.http import body
from engine.http.asgi import Receive, Scope
from engine.http.engines import Engines
from engine.http.errors import BadRequest
from engine.http.values import json_object

VERSION = "1"  # every engine is one model of one version
MAX_BODY_BYTES = 32 << 10  # a config fits many times over; serve reads at most 64 KiB
FIXED = ("models are fixed at serve time (Triton's model control mode 'none'): expected serve "
         "--model-control explicit to load or unload one")


async def index(engines: Engines, scope: Scope, receive: Receive) -> List[dict]:
    raw = await body.read(scope, receive, MAX_BODY_BYTES, "the model repository's bound")
    ready_only = _object(raw, "an index request").get("ready", False)
    if not isinstance(ready_only, bool):
        raise BadRequest(f"ready: expected true or false, got {json.dumps(ready_only)}")
    if engines.explicit:
        entries = [(e["name"], e["state"], e["reason"]) for e in engines.entries]
    else:
        entries = [(name, "READY", "") for name in sorted(engines.configs)]
    found = []
    for name, state, reason in entries:
        if state == "READY":
            try:
                engines.ready(name)
            except EngineUnavailable as e:
                state, reason = "UNAVAILABLE", str(e)
        if state == "READY" or not ready_only:
            found.append({"name": name, "version": VERSION, "state": state, "reason": reason})
    return found


async def control(engines: Engines, name: str, op: str, scope: Scope, receive: Receive) -> None:
    """A load or unload of engine `name`, done by serve; BadRequest with
    serve's status and why when it is not."""
    if not engines.explicit:
        raise BadRequest(FIXED)
    raw = await body.read(scope, receive, MAX_BODY_BYTES, "the model repository's bound")
    what = f"a {op} request"
    parameters = _object(raw, what).get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest(f"parameters: expected an object, got {json.dumps(parameters)}")
    message: dict = {"op": op, "name": name}
    if op == "load":
        message["config"] = _config(parameters)
    elif not isinstance(parameters.get("unload_dependents", False), bool):
        raise BadRequest(f"parameters.unload_dependents: expected true or false, got "
                         f"{json.dumps(parameters['unload_dependents'])}")
    try:
        reply = await engines.control(message)
    except TimeoutError as e:
        raise BadRequest(f"{op} of model {name!r}: {e} (the index says where it stands)",
                         504) from None
    engines.refresh()  # this worker routes by the new set at once
    if not reply.get("ok"):
        raise BadRequest(str(reply.get("error", "serve gave no reason")),
                         int(reply.get("status", 500)))


def _config(parameters: dict) -> Optional[dict]:
    files = sorted(k for k in parameters if isinstance(k, str) and k.startswith("file:"))
    if files:
        raise BadRequest(f"parameters.{files[0]}: expected config alone (an engine loads no "
                         f"model files: its config names its backend), got a file")
    config = parameters.get("config")
    if config is None:
        return None
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except (ValueError, RecursionError) as e:
            raise BadRequest(f"parameters.config: expected a JSON object of Engine's keys, got "
                             f"a string that is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise BadRequest(f"parameters.config: expected a JSON object of Engine's keys, got "
                         f"{type(config).__name__}")
    return config


def _object(raw: bytes, what: str) -> dict:
    """The body's JSON object; an empty body is {}."""
    return json_object(raw, f"{what} as a JSON object") if raw.strip() else {}
