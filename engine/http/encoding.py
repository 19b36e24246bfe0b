"""A request body's Content-Encoding, undone in bounded steps.

identity (or no header) passes the body as it came; gzip (also x-gzip) and
deflate (the zlib format, as RFC 9110 and tritonclient mean it) are
inflated at most STEP_BYTES per step, never more than one byte past the
decoded body's limit: a body that would inflate past it is refused as soon
as it does, before the rest is inflated. What comes on the wire is bounded
too (wire_limit): a stream that grows without inflating is refused as a
large one is. Any other coding is refused (415) before the body is read.
"""
import zlib
from typing import Iterator, Optional

STEP_BYTES = 1 << 20
# the zlib window bits of each coding taken: 16 + : a gzip wrapper, else zlib's
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
TAKEN = "identity, gzip or deflate"


class Unsupported(ValueError):
    """A Content-Encoding this server does not decode (415)."""


class Undecodable(ValueError):
    """Bytes that are not the stream their coding says (400)."""


class OverLimit(ValueError):
    """A body that inflates past its limit (413)."""


def coding_of(value: Optional[str]) -> Optional[str]:
    """The coding to undo, as its WBITS key (None: identity); Unsupported for
    any other, or for more than one coding applied in turn."""
    if value is None:
        return None
    codings = [c.strip().lower() for c in value.split(",")]
    applied = [c for c in codings if c not in ("identity", "")]
    if not applied:
        return None
    if len(applied) > 1 or applied[0] not in WBITS:
        raise Unsupported(f"Content-Encoding: expected {TAKEN}, got {value[:100]!r}")
    return applied[0]


def wire_limit(limit: int) -> int:
    """The most compressed bytes a body decoding to at most `limit` bytes may
    come in: incompressible data stored as is costs 5 bytes per 64 KiB block,
    and a gzip or zlib wrapper a few bytes more."""
    return limit + limit // 1024 + 1024


class Inflater:
    """Undoes one coding, chunk by chunk, within `limit` decoded bytes."""

    def __init__(self, coding: str, limit: int) -> None:
        self.coding, self.left = coding, limit
        self.limit = limit
        self._z = zlib.decompressobj(WBITS[coding])

    def feed(self, data: bytes) -> Iterator[bytes]:
        """The decoded bytes of a chunk, at most STEP_BYTES at a time (a step
        each); OverLimit once the body is past its limit, Undecodable for
        bytes that do not decode or that come after the stream's end."""
        z = self._z
        while True:
            if z.eof and data:
                raise Undecodable(f"a {self.coding} stream, got data after its end")
            step = min(STEP_BYTES, self.left + 1)
            try:
                out = z.decompress(data, step)
            except zlib.error as e:
                raise Undecodable(f"a {self.coding} stream, got bytes that do not decode "
                                  f"({e})") from None
            self.left -= len(out)
            if self.left < 0:
                raise OverLimit()  # the reader says it, with the limit's reason
            if z.unused_data:
                raise Undecodable(f"a {self.coding} stream, got data after its end")
            if out:
                yield out
            data = z.unconsumed_tail
            if not data and len(out) < step:  # all taken in, nothing held back
                return

    def finish(self) -> None:
        """Undecodable unless the stream ended."""
        if not self._z.eof:
            raise Undecodable(f"a {self.coding} stream, got one cut short")
