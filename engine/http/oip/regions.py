"""The registered system shared-memory regions, one table for every HTTP worker of a serve.

serve's HTTP workers are separate processes, and the kernel hands a
caller's next connection to any of them: a region registered through one
must be usable through all. So the table is not a worker's: it lives in
one small anonymous file (a memfd) that serve makes and every worker
inherits (engine.http.server.workers): no name in /dev/shm or on disk,
gone with the last process that holds it, however they end; a worker that
is replaced finds the table as it was. A front made without one (tests,
Ray's replicas) makes its own, for its process alone.

The file holds [u64 version][u64 length][the records as JSON] (empty: version
0, no records). Every
change is made under an exclusive flock(2), a read under a shared one; each
worker opens the file anew (/proc/self/fd), since flock locks belong to an
open file and the inherited descriptor is one open file for all. A worker
reads the version (8 bytes) before each use and re-reads the records only
when it moved.

A record keeps what register checked: the key, the offset and size, and
the object's device and inode. Each worker opens the key itself the first
time it uses the region (engine.http.oip.region_files, every check again)
and refuses an object that is no longer the one registered (its owner
removed it and another took its name). At most MAX_REGIONS regions, names
of at most MAX_REGION_CHARS printable characters without '/' or spaces.
"""
import fcntl
import json
import os
import struct
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

from engine.http.errors import BadRequest, NotFound
from engine.http.oip import region_files
from engine.http.oip.tensors import MAX_REGION_CHARS, MAX_SHM_BYTES
from engine.http.values import json_text

MAX_REGIONS = 256
_HEAD = struct.Struct("<QQ")  # version, the JSON's length


class Record(NamedTuple):
    name: str
    key: str
    offset: int  # in the object
    byte_size: int
    dev: int  # the object registered
    ino: int
    serial: int  # this registration's (a name registered again gets another)


class Table:
    """The table in the file `fd` (None: a new one of this process's own)."""

    def __init__(self, fd: Optional[int] = None) -> None:
        made = os.memfd_create("shmbatch-regions", os.MFD_CLOEXEC) if fd is None else None
        # an open file of this process's own, so that flock excludes the other workers
        self.fd = os.open(f"/proc/self/fd/{fd if made is None else made}",
                          os.O_RDWR | os.O_CLOEXEC)
        if made is not None:
            os.close(made)

    def close(self) -> None:
        os.close(self.fd)

    def version(self) -> int:
        head = os.pread(self.fd, _HEAD.size, 0)
        return _HEAD.unpack(head)[0] if len(head) == _HEAD.size else 0

    def read(self) -> Tuple[int, List[Record]]:
        fcntl.flock(self.fd, fcntl.LOCK_SH)
        try:
            return self._read()
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def change(self, edit) -> Tuple[int, List[Record]]:
        """edit(version, records) -> the new records (or BadRequest), written
        as the next version under the exclusive lock."""
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            version, records = self._read()
            records = edit(version, records)
            blob = json.dumps([list(r) for r in records]).encode()
            os.pwrite(self.fd, blob, _HEAD.size)
            os.pwrite(self.fd, _HEAD.pack(version + 1, len(blob)), 0)
            return version + 1, records
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def _read(self) -> Tuple[int, List[Record]]:
        head = os.pread(self.fd, _HEAD.size, 0)
        if len(head) < _HEAD.size:  # a new file
            return 0, []
        version, length = _HEAD.unpack(head)
        blob = os.pread(self.fd, length, _HEAD.size)
        return version, [Record(*r) for r in json.loads(blob)]


class Regions:
    """One worker's view of the table: register, unregister, status, and
    the open file of a region in use. segments: the engines served now (no
    region may be one's segment)."""

    def __init__(self, table_fd: Optional[int], segments: Callable[[], Iterable[str]]) -> None:
        self.table = Table(table_fd)
        self.segments = segments
        self._version = -1
        self._records: Dict[str, Record] = {}
        self._open: Dict[str, Tuple[int, int]] = {}  # name -> (serial, fd) opened here

    def close(self) -> None:
        for _, fd in self._open.values():
            os.close(fd)
        self._open.clear()
        self.table.close()

    def register(self, name: str, body) -> None:
        """Registers region `name` as the register request's JSON body says
        ({key, offset, byte_size}); BadRequest naming what is wrong."""
        _check_name(name)
        if not isinstance(body, dict):
            raise BadRequest(f"expected a JSON object {{\"key\", \"offset\", \"byte_size\"}}, "
                             f"got {json_text(body)}")
        key = body.get("key")
        offset, size = _byte_count(body, "offset", 0), _byte_count(body, "byte_size", None)
        fd, st = region_files.open_key(key, self.segments())  # BadRequest unless it names one
        try:
            if offset + size > st.st_size:
                raise BadRequest(f"region {name!r}: expected offset + byte_size within the "
                                 f"object's {st.st_size} bytes, got {offset} + {size} = "
                                 f"{offset + size}")

            def add(version: int, records: List[Record]) -> List[Record]:
                if any(r.name == name for r in records):
                    raise BadRequest(f"region {name!r}: expected a name not registered, got "
                                     f"one that is (unregister it first)")
                if len(records) >= MAX_REGIONS:
                    raise BadRequest(f"region {name!r}: expected at most {MAX_REGIONS} regions "
                                     f"registered, got {len(records)} already (unregister some)")
                return records + [Record(name, str(key), offset, size, st.st_dev, st.st_ino,
                                         version + 1)]
            self._take(*self.table.change(add))
        except BaseException:
            os.close(fd)
            raise
        self._open[name] = (self._records[name].serial, fd)

    def unregister(self, name: Optional[str] = None) -> None:
        """Unregisters region `name` (None: every region); a name not
        registered is no error, as Triton's."""
        if name is not None:
            _check_name(name)
        self._take(*self.table.change(
            lambda version, records: [r for r in records if name is not None and r.name != name]))

    def status(self, name: Optional[str] = None) -> List[dict]:
        """Triton's status: [{name, key, offset, byte_size}] of each region
        (of region `name` alone: NotFound if it is not registered)."""
        self.refresh()
        if name is None:
            records = list(self._records.values())
        else:
            _check_name(name)
            if name not in self._records:
                raise NotFound(f"no system shared-memory region {name!r} is registered; "
                               f"registered: {self._names()}")
            records = [self._records[name]]
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                for r in records]

    def refresh(self) -> None:
        if self.table.version() != self._version:
            self._take(*self.table.read())

    def resolve(self, name: str, where: str) -> Tuple[Record, int]:
        """(the record, an fd of its object opened in this worker) of a
        region a tensor names, in the table as last refreshed (once a request:
        a refresh between two of its tensors could close an fd it holds);
        BadRequest if it is not registered, or its object is no longer the
        one registered."""
        record = self._records.get(name)
        if record is None:
            raise BadRequest(f"{where}: expected a registered system shared-memory region, got "
                             f"{name!r}; registered: {self._names()}")
        held = self._open.get(name)
        if held is not None and held[0] == record.serial:
            return record, held[1]
        fd, st = region_files.open_key(record.key, self.segments())
        if not region_files.same_object(st, record.dev, record.ino):
            os.close(fd)
            raise BadRequest(f"{where}: region {name!r}: expected the object registered under "
                             f"key {record.key!r}, got another of that name (removed and "
                             f"made again since: register the region again)")
        self._open[name] = (record.serial, fd)
        return record, fd

    def _take(self, version: int, records: List[Record]) -> None:
        """The table as read: files of regions gone or registered anew closed."""
        self._version, self._records = version, {r.name: r for r in records}
        for name, (serial, fd) in list(self._open.items()):
            record = self._records.get(name)
            if record is None or record.serial != serial:
                del self._open[name]
                os.close(fd)

    def _names(self) -> str:
        names = list(self._records)
        return json_text(names, 200)


def _byte_count(body: dict, field: str, default: Optional[int]) -> int:
    value = body.get(field, default)
    if type(value) is not int or not 0 <= value <= MAX_SHM_BYTES:
        raise BadRequest(f"{field}: expected a byte count >= 0, got {json_text(value)}")
    return value


def _check_name(name: str) -> None:
    if not 1 <= len(name) <= MAX_REGION_CHARS or "/" in name or \
            not all("!" <= c <= "~" for c in name):
        raise BadRequest(f"region name: expected 1..{MAX_REGION_CHARS} printable ASCII "
                         f"characters, no spaces nor '/', got {json_text(name)}")
