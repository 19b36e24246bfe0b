"""What the benchmarks offer an engine and how they check what comes back.

The load (backend, inputs, open-loop Poisson arrivals, seeded), the arrival
schedule a sender keeps, and the answer checks: pure helpers, tested alone.
"""
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from engine.shm import ring


@dataclasses.dataclass
class Load:
    """What a row offers the engine: the backend, the inputs and the arrivals."""

    backend: str = "engine.backends:synthetic"
    backend_args: dict = dataclasses.field(
        default_factory=lambda: {"fixed_ms": 2.0, "per_item_us": 100.0})
    input_shape: Tuple[int, ...] = (16,)
    dtype: str = "float32"
    clients: int = 4
    rate: float = 1500.0
    requests: int = 1600
    queue_capacity: Optional[int] = None  # None: room for every request (an unbounded queue)
    timeout_s: float = 60.0
    seed: int = 1
    pin: bool = True  # batchers on the last cores, clients on the others (when there are >= 2)


# -- pure helpers (tested on their own) -----------------------------------------

def poisson_offsets_ns(rate_hz: float, n: int, seed: int) -> np.ndarray:
    """Arrival times (ns from the start) of n Poisson arrivals at rate_hz."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_hz, size=n)
    return (np.cumsum(gaps) * 1e9).astype(np.int64)


def split_requests(total: int, clients: int) -> List[int]:
    """total requests over clients, as evenly as whole numbers allow."""
    return [total // clients + (c < total % clients) for c in range(clients)]


def percentiles_ms(latency_ns: np.ndarray) -> Dict[str, float]:
    if len(latency_ns) == 0:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    ms = latency_ns / 1e6
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "max": float(ms.max())}


def tag_value(client: int, k: int) -> float:
    """A value exact in float32 (< 2**23) that names request k of a client."""
    return float((client % 16) * (1 << 19) + k % (1 << 19))


def expected_fn(backend: str) -> Optional[Callable[[np.ndarray], np.ndarray]]:
    """What the built-in backends answer, so every answer can be checked."""
    return {"engine.backends:synthetic": lambda x: x * 2 + 1,
            "engine.backends:identity": lambda x: x}.get(backend)


def sample_index(shape: Tuple[int, ...]) -> np.ndarray:
    """Flat positions checked in each answer: all of a small input, a strided
    sample (first, last and every 4096th) of a large one."""
    size = int(np.prod(shape))
    if size <= 4096:
        return np.arange(size)
    return np.unique(np.r_[np.arange(0, size, 4096), size - 1])


class AnswerCheck:
    """What every answer to one input must hold at the sampled flat positions,
    compared as bytes (dtype included): ~0.5 us an answer, where
    np.array_equal costs ~7 us, as much as a request in a closed loop."""

    def __init__(self, sent: np.ndarray, expect, index: np.ndarray, shape):
        self.shape, self.index = tuple(shape), index
        self.whole = len(index) == int(np.prod(shape))  # a small input: all of it
        want = None if expect is None else np.ascontiguousarray(expect(sent))
        self.dtype = None if want is None else want.dtype
        self.want = None if want is None else want.tobytes()

    def __call__(self, y: np.ndarray) -> bool:
        if self.want is None:
            return True
        if y.shape != self.shape or y.dtype != self.dtype:
            return False
        flat = y.reshape(-1)
        return (flat if self.whole else flat[self.index]).tobytes() == self.want


def check_answer(sent: np.ndarray, y: np.ndarray, expect, index: np.ndarray, shape) -> bool:
    """sent: the input's values at `index` (flat); y: the whole answer."""
    return AnswerCheck(sent, expect, index, shape)(y)


def theoretical_rps(n: int, fixed_ms: float, per_item_us: float) -> float:
    """Capacity n / S(n) of the cost model S(n) = F + n c."""
    return n / ((fixed_ms + n * per_item_us / 1000.0) / 1000.0)


def paced(offsets_ns, start_ns: int, scheduled: np.ndarray):
    """Yields k = 0, 1, ... at start_ns + offsets_ns[k] (recorded in scheduled[k]):
    an open loop's arrival schedule. A late sender is not made up for: its
    lateness counts in the latency measured from the scheduled time."""
    for k, offset in enumerate(offsets_ns):
        scheduled[k] = start_ns + offset
        delay_ns = scheduled[k] - ring.now_ns()
        if delay_ns > 0:
            time.sleep(delay_ns / 1e9)
        yield k


def fine_timer_slack() -> None:
    """Sleeps wake within ~1 us of their time instead of the default 50 us
    slack: the arrival schedule is the measurement's clock."""
    import ctypes
    ctypes.CDLL(None).prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK
