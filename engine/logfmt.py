"""How shmbatch's processes write their log: text (the default), or one JSON
object per line (`shmbatch serve --log-format json`).

configure() sets up this process and writes its choice into the environment,
which the children inherit (batchers, HTTP workers: engine.launch); a child
reads it back as it starts (from_environment), so every process behind one
serve writes the same format to the same stderr.

A JSON line holds `ts` (RFC 3339, UTC, microseconds), `level`, `engine`,
`event` (the message), `logger`, `pid`, every field the record was given with
extra={...}, and `exc` (the traceback) for an exception. `engine` is the
record's `engine` field where given; else the first argument of a message that
begins "engine %s" (how every line about one engine is written); else the
engine of the process (a batcher serves one); else null.
"""
import datetime
import json
import logging
import os
import sys
import threading
from typing import Optional

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMAT_VAR, LEVEL_VAR, ENGINE_VAR = "SHMBATCH_LOG_FORMAT", "SHMBATCH_LOG_LEVEL", "SHMBATCH_LOG_ENGINE"
ENGINE_PREFIX = "engine %s"

# a record's own attributes: any other came with extra={...}
_RECORD_KEYS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}

log = logging.getLogger("shmbatch")


def rfc3339(epoch_s: float) -> str:
    stamp = datetime.datetime.fromtimestamp(epoch_s, datetime.timezone.utc)
    return stamp.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def engine_of(record: logging.LogRecord, default: Optional[str] = None) -> Optional[str]:
    given = getattr(record, "engine", None)
    if given is not None:
        return str(given)
    if isinstance(record.msg, str) and record.msg.startswith(ENGINE_PREFIX) and \
            isinstance(record.args, tuple) and record.args:
        return str(record.args[0])
    return default


class JsonFormatter(logging.Formatter):
    """A record as one JSON object on one line (pure ASCII: any reader parses it)."""

    def __init__(self, engine: Optional[str] = None) -> None:
        super().__init__()
        self.engine = engine

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": rfc3339(record.created), "level": record.levelname,
                "engine": engine_of(record, self.engine), "event": record.getMessage(),
                "logger": record.name, "pid": record.process}
        for key, value in vars(record).items():
            if key not in _RECORD_KEYS and key not in line:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def configure(level: str, fmt: str = "text") -> None:
    """This process's log at `level` in format `fmt` on stderr, and the same
    for the children it starts. ValueError for an unknown format or level."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    level = level.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"--log-level: expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
                         f"got {level!r}")
    os.environ[FORMAT_VAR], os.environ[LEVEL_VAR] = fmt, level
    if fmt == "json":
        _json(level, os.environ.get(ENGINE_VAR))
    else:
        logging.basicConfig(level=level, stream=sys.stderr, format=TEXT_FORMAT)


def from_environment() -> None:
    """In a child process: the JSON log its parent chose (text: nothing is
    set up, as before)."""
    if json_chosen():
        _json(os.environ.get(LEVEL_VAR) or "INFO", os.environ.get(ENGINE_VAR))


def json_chosen() -> bool:
    return os.environ.get(FORMAT_VAR) == "json"


def _json(level: str, engine: Optional[str]) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(engine))
    logging.basicConfig(level=level, handlers=[handler])
    # what would otherwise reach stderr as text: warnings and uncaught exceptions
    logging.captureWarnings(True)
    sys.excepthook = _uncaught
    threading.excepthook = _uncaught_in_thread
    sys.unraisablehook = _unraisable


def _uncaught(kind, value, tb) -> None:
    log.critical("uncaught %s: %s", kind.__name__, value, exc_info=(kind, value, tb))


def _uncaught_in_thread(args) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    log.error("thread %s raised %s: %s", name, args.exc_type.__name__, args.exc_value,
              exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def _unraisable(u) -> None:
    log.warning("%s: %r", u.err_msg or "exception ignored", u.object,
                exc_info=(u.exc_type, u.exc_value, u.exc_traceback))
