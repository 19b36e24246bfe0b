"""shmbatch: multiprocess shared-memory dynamic batching for Python and numpy.

    eng = engine.Engine("demo", input_shape=(16,), output_shape=(16,)).start()
    with engine.Client("demo") as c:
        y = c.infer(x)
    eng.stop()
"""
from engine.client import Client as Client
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
from engine.supervisor import Engine as Engine

__all__ = ["Engine", "Client", "EngineError", "InvalidInput", "QueueFull", "Overloaded", "RequestTimeout",
           "BackendError", "EngineUnavailable", "EngineCorrupt", "EngineAlreadyRunning", "SegmentTooLarge"]
