"""A node's engine as a process of its own: the supervisor its owner actor starts.

The owner (engine.ray.owner) starts it with engine.launch, so that a dead
supervisor is a dead child the owner can see, restart, and clean up after,
while the owner itself lives on. It runs engine.Engine(name, **knobs),
says ready once clients can attach, and on SIGTERM (or SIGINT) stops the
engine: new requests are refused, the queued ones answered, the segment
removed. It takes SIGTERM by the kernel's parent-death signal too, and
checks its parent besides: an owner that dies, however it dies, leaves
nothing behind, even while its supervisor starts (Ray kills an actor's
children as it kills the actor, and the owner may restart one meanwhile):
the supervisor checks its parent against the owner's pid, passed to it, and
one whose owner is gone already starts nothing.
"""
import ctypes
import os
import select
import signal
from multiprocessing.connection import Connection
from typing import Tuple

from engine import launch

_PR_SET_PDEATHSIG = 1
PARENT_CHECK_S = 0.5  # how often the parent is checked, should the signal be missed


def spawn(name: str, knobs: dict) -> Tuple[launch.Child, Connection]:
    """Starts engine `name`'s supervisor, this process its owner: (the
    process, the reader of its readiness pipe)."""
    return launch.launch("engine.ray.node_engine",
                         {"name": name, "knobs": knobs, "owner_pid": os.getpid()})


def start(name: str, knobs: dict, timeout_s: float) -> launch.Child:
    """Starts engine `name` in a child process and waits until it serves;
    launch.ChildFailed (the child killed) unless it does within timeout_s."""
    proc, reader = spawn(name, knobs)
    try:
        launch.await_ready(proc, reader, timeout_s, f"engine {name!r}", died="EngineDied")
        return proc
    except BaseException:
        launch.kill(proc)
        raise
    finally:
        reader.close()


def _entry() -> None:
    args, conn = launch.child_args()
    parent = args["owner_pid"]  # not getppid(): an orphan's parent is init (or a subreaper)
    # a signal wakes the loop below by a byte on this pipe: a handler that took a lock
    # (Event.set) could wait forever on the one the main thread held when interrupted
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    # the signal follows the thread that started this process: the owner's monitor thread
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the owner died before the signal was armed
        return
    from engine.serving.supervisor import Engine
    try:
        eng = Engine(args["name"], **args["knobs"]).start()
    except BaseException as e:
        launch.tell_failed(conn, e)
        return
    try:
        launch.tell_ready(conn, {"pid": os.getpid()})
        conn.close()
        while os.getppid() == parent and not select.select([woken], [], [], PARENT_CHECK_S)[0]:
            pass
    finally:
        eng.stop()
