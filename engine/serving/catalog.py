"""Which engines a serve has now, as every HTTP worker reads it: one memfd, written by serve.

Under `serve --model-control explicit` the engines change while the HTTP
workers run, and a load or unload is answered only once every worker would
route by the new set: serve writes the catalog, then answers. The catalog is
a memfd (no name under /dev/shm: it goes with the last process holding it),
passed to each worker at its launch and mapped read-only there. A worker
reads the 8-byte sequence word before each request (a memory read) and the
JSON body only when it moved.

Layout: [u64 sequence][u64 body length][body: JSON]. The writer makes the
sequence odd, writes the body, then makes it even (a seqlock): a reader that
saw an odd word, or a different one after copying, reads again.
"""
import json
import mmap
import os
import struct
import time
from typing import List

SIZE_BYTES = 1 << 20  # the body's bound: hundreds of engines' configs
HEADER = struct.Struct("=QQ")
READ_TIMEOUT_S = 1.0  # a writer never holds the word odd longer than a copy takes


class Writer:
    """serve's side: write(entries) publishes a new catalog; fd is what the
    workers are passed; close() drops serve's hold."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("shmbatch-catalog", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, SIZE_BYTES)
            self._map = mmap.mmap(self.fd, SIZE_BYTES)
        except BaseException:
            os.close(self.fd)
            raise
        self._sequence = 0

    def write(self, entries: List[dict]) -> None:
        """entries: one per engine, {"name", "state", "reason", "config": its
        EngineConfig JSON text, or None while it has no routes, "start": a count
        of its starts, which tells a restarted engine from the one before}."""
        body = json.dumps(entries).encode()
        if HEADER.size + len(body) > SIZE_BYTES:
            raise ValueError(f"the catalog of {len(entries)} engines takes {len(body)} B; "
                             f"expected at most {SIZE_BYTES - HEADER.size}")
        self._sequence += 1  # odd: being written
        HEADER.pack_into(self._map, 0, self._sequence, 0)
        self._map[HEADER.size:HEADER.size + len(body)] = body
        self._sequence += 1
        HEADER.pack_into(self._map, 0, self._sequence, len(body))

    def close(self) -> None:
        if self.fd >= 0:
            self._map.close()
            os.close(self.fd)
            self.fd = -1


class Reader:
    """A worker's side, on the fd its launch passed."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, SIZE_BYTES, prot=mmap.PROT_READ)
        os.close(fd)  # the mapping holds the memfd
        self.sequence = -1  # of the entries last read

    def changed(self) -> bool:
        return HEADER.unpack_from(self._map, 0)[0] != self.sequence

    def read(self) -> List[dict]:
        """The entries as serve last wrote them (and their sequence, kept)."""
        deadline = time.monotonic() + READ_TIMEOUT_S
        while True:
            sequence, length = HEADER.unpack_from(self._map, 0)
            if sequence % 2 == 0 and length <= SIZE_BYTES - HEADER.size:
                body = self._map[HEADER.size:HEADER.size + length]
                if HEADER.unpack_from(self._map, 0)[0] == sequence:
                    self.sequence = sequence
                    return json.loads(body)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the catalog stayed mid-write for {READ_TIMEOUT_S:g} s")
            time.sleep(0)

    def close(self) -> None:
        self._map.close()
