"""The thread pools a batcher's model computes with, as `shmbatch status` shows them.

Unless told otherwise, torch, onnxruntime, OpenMP and OpenBLAS size their
pools to the machine's cores. An unpinned batcher whose pool is as wide as
the cores it may run on takes them from the web workers and clients beside
it (torch with 2 threads on 2 cores beside 4 web workers: p99 576 ms; with 1
thread, 43 ms). report() says, in the batcher process once its factory ran,
which pools there are. It imports nothing: it reads torch only when the model
imported it, and onnxruntime through the session the backend holds as
`fn.session` (engine.backends.onnx's does). describe() and advice() put
reports in words.
"""
import os
import sys
from typing import Any, List, Optional

# The variables that size the numeric libraries' pools (OpenMP: torch and
# others; OpenBLAS and MKL: numpy), read by each library once, when it loads.
POOL_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def report(fn: Any, pinned: bool) -> dict:
    """This process's thread pools once the backend `fn` is loaded: torch's
    (None unless the model imported torch), onnxruntime's (None unless fn has
    an onnxruntime session as .session), the pool variables (None: unset),
    the CPU affinity, whether the engine pinned it (its `cpus` setting), and
    the threads the process has then (torch and OpenMP start theirs at the
    first batch: not counted)."""
    return {
        "torch": _torch_pools(),
        "onnxruntime": _onnxruntime_pools(fn),
        "env": {var: os.environ.get(var) for var in POOL_VARS},
        "affinity": sorted(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "pinned": bool(pinned),
        "os_threads": _os_threads(),
    }


def _torch_pools() -> Optional[dict]:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:  # neither starts a pool: each says the size it has or will have
        return {"intra_op": int(torch.get_num_threads()),
                "inter_op": int(torch.get_num_interop_threads())}
    except Exception:  # a module named torch without these: not the one we know
        return None


def _onnxruntime_pools(fn: Any) -> Optional[dict]:
    if "onnxruntime" not in sys.modules:
        return None
    session = getattr(fn, "session", None)
    try:
        options = session.get_session_options()
        return {"intra_op": int(options.intra_op_num_threads),
                "inter_op": int(options.inter_op_num_threads)}
    except Exception:  # no session, or not an onnxruntime one
        return None


def _os_threads() -> Optional[int]:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def describe(r: dict) -> str:
    """One batcher's report in one line, e.g. "torch intra-op 2, inter-op 2;
    OMP_NUM_THREADS, MKL_NUM_THREADS, OPENBLAS_NUM_THREADS unset; not pinned:
    may run on all 2 cores", and "; warmed up in 850 ms" after a warmup."""
    parts = []
    if r.get("torch"):
        t = r["torch"]
        parts.append(f"torch intra-op {t['intra_op']}, inter-op {t['inter_op']}")
    if r.get("onnxruntime"):
        o = r["onnxruntime"]
        intra = o["intra_op"] or "0 (default: a thread per physical core)"
        parts.append(f"onnxruntime intra-op {intra}, inter-op {o['inter_op'] or '0 (default)'}")
    if not parts:
        parts.append("no torch or onnxruntime pool")
    env = r.get("env", {})
    unset = [var for var in POOL_VARS if env.get(var) is None]
    set_vars = ", ".join(f"{var}={env[var]}" for var in POOL_VARS if env.get(var) is not None)
    parts.append(", ".join(filter(None, [set_vars, ", ".join(unset) + " unset" if unset else ""])))
    parts.append(_where(r))
    if r.get("warmup_ms") is not None:  # the batcher reports its warmup beside its pools
        parts.append(f"warmed up in {r['warmup_ms']:.0f} ms")
    return "; ".join(parts)


def _where(r: dict) -> str:
    cores, count = r["affinity"], r["cpu_count"]
    if r["pinned"]:
        return f"pinned to core(s) {_cores_text(cores)} (cpus)"
    if count is not None and len(cores) == count:
        return f"not pinned: may run on all {count} cores"
    return f"not pinned by cpus: may run on core(s) {_cores_text(cores)} of {count}"


def _cores_text(cores: List[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            runs.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(runs)


def width(r: dict) -> Optional[int]:
    """The widest pool the model computes with (None: onnxruntime's default,
    sized by it to the machine's physical cores; 1: none known)."""
    widths = [1]
    if r.get("torch"):
        widths.append(r["torch"]["intra_op"])
    if r.get("onnxruntime"):
        if not r["onnxruntime"]["intra_op"]:
            return None
        widths.append(r["onnxruntime"]["intra_op"])
    return max(widths)


def advice(reports: List[dict]) -> Optional[str]:
    """A line of advice when the pools of the unpinned batchers are as wide,
    together, as the cores they may run on (leaving none to the web workers
    and clients beside them), or when one runs onnxruntime's default pool;
    None otherwise."""
    free = [r for r in reports if r and not r["pinned"]]
    if not free:
        return None
    widths = [width(r) for r in free]
    cores = len(set().union(*(r["affinity"] for r in free)))
    if None in widths:
        why = "onnxruntime's default pool has a thread per physical core"
    elif max(widths) > 1 and sum(widths) >= cores:
        why = (f"the model's pools ({sum(widths)} threads in {len(free)} unpinned "
               f"batcher(s)) fill the {cores} core(s) they may run on")
    else:
        return None
    fixes = []
    if any(r.get("torch") for r in free):
        fixes.append("torch.set_num_threads(1) in the factory")
    if any(r.get("onnxruntime") for r in free):
        fixes.append("intra_op_threads=1 (engine.backends.onnx) or "
                     "SessionOptions.intra_op_num_threads")
    fixes.append("cpus=[[core], ...] to pin each batcher")
    return f"{why}, leaving none to the web workers and clients: size them with " + \
        ", or ".join(fixes)
