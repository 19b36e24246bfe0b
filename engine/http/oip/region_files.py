"""The files behind system shared-memory regions: opened only when safe, read and written by offset.

A region's key names a POSIX shared-memory object, a file directly in
/dev/shm (glibc's shm_open: "/name" or "name"). open_key() opens it only if
a caller of the server's own user could: no '/' past the leading one, no
'..', opened relative to /dev/shm with O_NOFOLLOW (a symlink is refused,
not followed) and O_NONBLOCK (a FIFO never stalls the worker), then fstat:
a regular file owned by the server's uid. Never an engine's own segment:
no name of engine.segment's (`shmbatch-...`), no file with another name (a
hard link could be a segment under a new name), and not the inode of a
segment of the engines served.

The data moves with os.pread / os.pwrite, never through an mmap: a region's
owner may truncate its file at any time, and touching an mmap past the end
raises SIGBUS, which would kill the worker and every request it holds; a
pread past the end is a short read (a 400), and a pwrite is preceded by an
fstat that refuses a file shorter than the tensor's end, so a write never
extends the file, and its position and length are checked against the
region (engine.http.oip.sysshm), so it never lands outside it. The copy costs what an mmap's
would: the engine takes its own copy into its slot either way.
"""
import errno
import os
import stat
from typing import Iterable, Tuple

import numpy as np

from engine import segment
from engine.http.errors import BadRequest

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = segment.segment_name("")[1:]  # every engine's segment: /dev/shm/shmbatch-NAME
MAX_KEY_CHARS = 255  # NAME_MAX: a longer name is no file's
_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def file_name(key: object) -> str:
    """The file in /dev/shm a key names; BadRequest for a key that names
    anything else (a path, a parent, an engine's segment)."""
    name = key[1:] if isinstance(key, str) and key.startswith("/") else key
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_KEY_CHARS or \
            not name.isprintable() or "/" in name or ".." in name or name == ".":
        raise BadRequest(f"key: expected a shared-memory object's name (\"/name\" or \"name\", "
                         f"1..{MAX_KEY_CHARS} printable characters, no '/' after the first, "
                         f"no '..'), got {_shown(key)}")
    if name.startswith(SEGMENT_PREFIX):
        raise BadRequest(f"key: expected a region of the caller's own, got {_shown(key)}: "
                         f"/dev/shm/{SEGMENT_PREFIX}* are the engines' own segments")
    return name


def open_key(key: object, segments: Iterable[str]) -> Tuple[int, os.stat_result]:
    """(an O_RDWR fd, its fstat) of the object key names, checked as the
    module says; segments: the engines' names, whose segments it must not be."""
    name = file_name(key)
    try:
        dir_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise BadRequest(f"key {key!r}: expected {SHM_DIR} to hold it, got {e.strerror}") from None
    try:
        try:
            fd = os.open(name, _FLAGS, dir_fd=dir_fd)
        except OSError as e:
            why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror  # O_NOFOLLOW's
            raise BadRequest(f"key {key!r}: expected a shared-memory object the server's user "
                             f"can read and write in {SHM_DIR}, got {why}") from None
        try:
            st = os.fstat(fd)
            _check(key, st, segments, dir_fd)
        except BaseException:
            os.close(fd)
            raise
    finally:
        os.close(dir_fd)
    return fd, st


def _check(key: object, st: os.stat_result, segments: Iterable[str], dir_fd: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise BadRequest(f"key {key!r}: expected a regular file, got mode "
                         f"{stat.filemode(st.st_mode)}")
    if st.st_uid != os.geteuid():
        raise BadRequest(f"key {key!r}: expected an object owned by the server's user (uid "
                         f"{os.geteuid()}), got one of uid {st.st_uid}")
    if st.st_nlink != 1:
        raise BadRequest(f"key {key!r}: expected an object of one name, got one of "
                         f"{st.st_nlink} (another name could be an engine's segment)")
    for engine in segments:
        try:
            seg = os.stat(segment.segment_name(engine)[1:], dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if (seg.st_dev, seg.st_ino) == (st.st_dev, st.st_ino):
            raise BadRequest(f"key {key!r}: expected a region of the caller's own, got engine "
                             f"{engine!r}'s segment")


def same_object(st: os.stat_result, dev: int, ino: int) -> bool:
    return (st.st_dev, st.st_ino) == (dev, ino)


def read_into(fd: int, array: np.ndarray, position: int, where: str) -> None:
    """Fills array (C-contiguous) with the file's bytes from position;
    BadRequest if the file ends first (its owner truncated it)."""
    view = array.data.cast("B")
    got = 0
    while got < len(view):
        try:
            n = os.preadv(fd, [view[got:]], position + got)
        except OSError as e:
            raise BadRequest(f"{where}: expected {len(view)} bytes at byte {position} of its "
                             f"object, got a read error ({e.strerror})") from None
        if n == 0:
            raise BadRequest(f"{where}: expected {len(view)} bytes at byte {position} of its "
                             f"object, got {got}: the object is shorter than the region "
                             f"(truncated since it was registered?)")
        got += n


def write_from(fd: int, array: np.ndarray, position: int, where: str) -> None:
    """Writes array's bytes (little-endian, C order) at position; BadRequest,
    nothing written, if the file is now shorter than position + its bytes."""
    data = np.ascontiguousarray(array, array.dtype.newbyteorder("<"))
    view = data.data.cast("B")
    end = position + len(view)
    size = os.fstat(fd).st_size
    if size < end:
        raise BadRequest(f"{where}: expected an object of at least {end} bytes to write "
                         f"{len(view)} at byte {position}, got {size} (truncated since it "
                         f"was registered?)")
    done = 0
    while done < len(view):
        try:
            n = os.pwrite(fd, view[done:], position + done)
        except OSError as e:
            raise BadRequest(f"{where}: expected to write {len(view)} bytes at byte "
                             f"{position}, got a write error ({e.strerror})") from None
        if n == 0:
            raise BadRequest(f"{where}: expected to write {len(view)} bytes at byte "
                             f"{position}, got {done} written")
        done += n


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
