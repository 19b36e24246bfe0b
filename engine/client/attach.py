"""How a Client finds its engine: attach now, wait for one, or say why not.

A client attaches to a running engine only (state RUNNING, its supervisor
holding the segment's lock). While it cannot, the reason is precise, as a
web app's 503 shows it: not started yet (no segment), starting, stopping,
stopped, or died (a leftover segment). The header page is read first, so a
client polling an engine that is still starting never maps its slots.
"""
import os
import time
from typing import Optional

from engine.config import NAME_RE
from engine.errors import EngineUnavailable
from engine.segment import Segment, segment_name
from engine.shm import codes

# A Client waiting for its engine (wait_s) looks again this often: the
# segment's creation is not an event it can sleep on.
ATTACH_POLL_S = 0.02

_STATE_TEXT = {codes.ENGINE_STARTING: "is starting (not ready yet)",
               codes.ENGINE_STOPPING: "is stopping", codes.ENGINE_STOPPED: "is not running (it stopped)"}


def attach(name: str, wait_s: float = 0.0, old: Optional[Segment] = None) -> Segment:
    """The segment of the running engine `name` (not `old`, the one a client
    holds already), waiting up to wait_s for it; EngineUnavailable saying
    why not: not started yet, starting, stopping, stopped or dead."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ValueError(f"name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
    until = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            return _attach_running(name, old)
        except EngineUnavailable as e:
            left = until - time.monotonic()
            if left <= 0:
                if wait_s > 0:
                    raise EngineUnavailable(f"{e}; waited {wait_s:g} s") from None
                raise
        time.sleep(min(ATTACH_POLL_S, left))


def _attach_running(name: str, old: Optional[Segment]) -> Segment:
    if not os.path.exists(f"/dev/shm{segment_name(name)}"):
        if old is not None:  # the client's engine is gone
            raise EngineUnavailable(f"engine {name!r} is not running (it stopped, and no "
                                    f"engine of that name has started since)")
        raise EngineUnavailable(f"engine {name!r} is not started yet (no engine named {name!r} "
                                f"is running: no /dev/shm{segment_name(name)})")
    try:
        head = Segment.attach(name, header_only=True)  # one page: cheap while it cannot serve
    except EngineUnavailable:
        if _being_created(name):
            raise EngineUnavailable(f"engine {name!r} {_STATE_TEXT[codes.ENGINE_STARTING]}") \
                from None
        raise
    try:
        state, alive = head.engine_state(), head.holder_alive()
    finally:
        head.close()
    if state != codes.ENGINE_RUNNING or not alive:
        what = _STATE_TEXT.get(state, "is not running") if alive else \
            f"is not running (it died; `shmbatch cleanup {name}` removes what it left)"
        raise EngineUnavailable(f"engine {name!r} {what}")
    seg = Segment.attach(name)
    if (old is not None and seg.incarnation == old.incarnation) or \
            seg.engine_state() != codes.ENGINE_RUNNING:
        seg.close()
        raise EngineUnavailable(f"engine {name!r} is stopping or not running")
    return seg




def _being_created(name: str) -> bool:
    """Whether the segment's magic word, which its creator writes last, is
    still zero. (Read, never locked: a lock probe here could make the
    creator's own lock fail.)"""
    try:
        fd = os.open(f"/dev/shm{segment_name(name)}", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.pread(fd, 8, 0) == bytes(8)
    finally:
        os.close(fd)
