"""Process identity and death, as the kernel tells it.

A process is named by (pid, start time): a bare pid can be reused by an
unrelated process after its owner dies. The start time is field 22 of
/proc/PID/stat, in clock ticks since boot, exact and cheap to read. A zombie
counts as dead: it will never touch the segment again.
"""
import ctypes
import os
import signal
from typing import Optional

_PR_SET_PDEATHSIG = 1


def start_ticks(pid: int) -> Optional[int]:
    """The start time of a live (non-zombie) pid, or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after it
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def is_alive(pid: int, ticks: int = 0) -> bool:
    """True while pid runs and, when ticks is known (non-zero), is that process."""
    now = start_ticks(pid)
    return now is not None and (ticks == 0 or now == ticks)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that spawned it exits (Linux);
    parent_pid is the spawner's, passed down: an orphan's parent is init or
    a subreaper (a container's init, systemd --user), not always pid 1, and
    a wrapper between the two (valgrind, a launcher script) is a parent that
    is not the spawner while the spawner lives."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # a zombie spawner is gone too: is_alive reads its state, where kill(pid, 0) succeeds
    if os.getppid() != parent_pid and not is_alive(parent_pid):
        os._exit(1)  # the spawner died before prctl took effect


def netns() -> int:
    """This process's network namespace (its inode; 0 if unknown): an abstract
    socket's name reaches only processes of the same one."""
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0
