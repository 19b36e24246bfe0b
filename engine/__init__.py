"""shmbatch: multiprocess shared-memory dynamic batching for Python and numpy.

    eng = engine.Engine("demo", input_shape=(16,), output_shape=(16,)).start()
    with engine.Client("demo") as c:
        y = c.infer(x)
    eng.stop()

The package by floor, top down. A module imports from its own floor or from
those below it, never up; on one floor, only within its own sub-package
(tests/test_architecture.py reads this table):

    floor 6  engine.cli       the `shmbatch` command (also `python -m engine`)
    floor 5  engine.tools     bench, tune, manifests, dashboard: the runtime never imports them
    floor 5  engine.ray       Ray Serve replicas sharing one engine per node
    floor 4  engine.http      the HTTP front (Open Inference Protocol, OpenAI API) and its workers
    floor 3  engine.serving   the supervisor: batcher processes, restarts, reload, metrics
    floor 2  engine.client    a process attached to an engine: requests and answers
    floor 2  engine.batching  the batcher process: one-shot and iterative loops
    floor 1  engine.shm       the C ring's binding, its constants, slot owners

and on floor 1 beside engine.shm, the modules directly in engine/: `errors`,
`tensors`, `knobs` (a knob's field and its kind's check), `config`, `segment`
(a segment made from a config), `spec` (what a backend is), `backends` (the
built-in models), `launch` (child processes), `logfmt` (the log's format),
`sampling` (a request's sampling parameters and their record). This module,
the package's face, is above them all; `__main__` runs the command.
"""
from typing import TYPE_CHECKING

from engine.errors import BackendError as BackendError
from engine.errors import EngineAlreadyRunning as EngineAlreadyRunning
from engine.errors import EngineCorrupt as EngineCorrupt
from engine.errors import EngineError as EngineError
from engine.errors import EngineUnavailable as EngineUnavailable
from engine.errors import InvalidInput as InvalidInput
from engine.errors import Overloaded as Overloaded
from engine.errors import QueueFull as QueueFull
from engine.errors import RequestTimeout as RequestTimeout
from engine.errors import SegmentTooLarge as SegmentTooLarge

if TYPE_CHECKING:
    from engine.client.client import Client as Client
    from engine.sampling import Sampling as Sampling
    from engine.serving.supervisor import Engine as Engine
else:
    def __getattr__(name: str):
        """These names load at their first use: a batcher, which runs neither
        Engine nor Client, starts without their modules (a dead one's successor
        serves sooner), and the command without numpy until a subcommand needs it."""
        if name == "Client":
            from engine.client.client import Client
            return Client
        if name == "Engine":
            from engine.serving.supervisor import Engine
            return Engine
        if name == "Sampling":
            from engine.sampling import Sampling
            return Sampling
        raise AttributeError(f"module 'engine' has no attribute {name!r}")

    def __dir__():
        return sorted(set(globals()) | set(__all__))

__all__ = ["Engine", "Client", "EngineError", "InvalidInput", "QueueFull", "Overloaded", "RequestTimeout",
           "BackendError", "EngineUnavailable", "EngineCorrupt", "EngineAlreadyRunning", "SegmentTooLarge",
           "Sampling"]
