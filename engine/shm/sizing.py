"""How much shared memory an engine's segment takes, and whether it fits.

An engine never takes the last of /dev/shm nor of the host's memory: it
checks before anything is allocated, and a segment that does not fit fails
the start with what it needs, what there is, and how to give it room.
"""
import os

import psutil

from engine.errors import SegmentTooLarge

# Where POSIX shared memory lives on Linux (glibc's shm_open).
SHM_DIR = "/dev/shm"
# An engine never takes the last of /dev/shm nor of the host's memory: after
# its segment, 1/16 of /dev/shm's size (at least 1 MiB) must stay free there,
# and 1/16 of the RAM (at least 64 MiB) must stay available.
SHM_MARGIN_DIVISOR = 16
SHM_MARGIN_MIN_BYTES = 1 << 20
MEMORY_MARGIN_MIN_BYTES = 64 << 20


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _round_up_text(n: int) -> str:
    """A size for --shm-size / sizeLimit: n rounded up to whole MiB or GiB."""
    gib, mib = -(-n // (1 << 30)), -(-n // (1 << 20))
    return (f"{gib}g", f"{gib}Gi") if n >= 1 << 30 else (f"{mib}m", f"{mib}Mi")


def check_fits(config, size: int) -> None:
    """SegmentTooLarge, before anything is allocated, unless a segment of size
    bytes fits in /dev/shm's free space and the host's available memory, with
    their margins left (see SHM_MARGIN_DIVISOR)."""
    st = os.statvfs(SHM_DIR)
    shm_total, shm_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    shm_margin = max(SHM_MARGIN_MIN_BYTES, shm_total // SHM_MARGIN_DIVISOR)
    memory = psutil.virtual_memory()
    mem_margin = max(MEMORY_MARGIN_MIN_BYTES, memory.total // SHM_MARGIN_DIVISOR)
    if size <= shm_free - shm_margin and size <= memory.available - mem_margin:
        return
    in_bytes, out_bytes = config.input_slot_bytes, config.output_slot_bytes
    if config.in_place:
        rows, per_slot = f"{size_text(in_bytes)} (answers overwrite their input)", in_bytes
    else:
        rows = f"({size_text(in_bytes)} input + {size_text(out_bytes)} output)"
        per_slot = in_bytes + out_bytes
    control = size - per_slot * config.queue_capacity
    if size > shm_free - shm_margin:
        # a /dev/shm of T fits it beside what is there now when T - used - T/16 >= size
        docker, k8s = _round_up_text((size + shm_total - shm_free) * SHM_MARGIN_DIVISOR
                                     // (SHM_MARGIN_DIVISOR - 1) + SHM_MARGIN_MIN_BYTES)
        where = (f"/dev/shm has {size_text(max(0, shm_free))} free of {size_text(shm_total)} and "
                 f"keeps {size_text(shm_margin)} (1/{SHM_MARGIN_DIVISOR}) free")
        remedy = (f"give /dev/shm more room (Docker: --shm-size={docker}; Kubernetes: an emptyDir "
                  f"volume {{medium: Memory, sizeLimit: {k8s}}} mounted at /dev/shm)")
    else:
        where = (f"the host has {size_text(memory.available)} of memory available and keeps "
                 f"{size_text(mem_margin)} (1/{SHM_MARGIN_DIVISOR} of its RAM) free")
        remedy = "free memory on the host"
    raise SegmentTooLarge(
        f"engine {config.name!r} needs {size_text(size)} ({size:,} B) of shared memory "
        f"(queue_capacity {config.queue_capacity} x {rows} per slot, + {size_text(control)} "
        f"header and slot control), but {where}: lower queue_capacity or the max shapes, "
        f"or {remedy}")
