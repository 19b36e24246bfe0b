"""cffi builder for engine._ringc (API, out-of-line mode).

The cdef is the part of ring.h between its "cdef" markers, so the header is
the one contract: cffi reads the same prototypes and constants that csrc/*.c
are compiled against.
"""
import os
import pathlib

from cffi import FFI

CSRC = pathlib.Path(__file__).resolve().parent


def _cdef_section(header: pathlib.Path) -> str:
    text = header.read_text()
    begin = text.index("/* --- cdef:")
    end = text.index("/* --- cdef end")
    return text[text.index("\n", begin) + 1:end]


# SHMBATCH_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer
# (README, Development: how to run the tests under it)
SANITIZE = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer",
            "-fno-sanitize-recover=undefined"] if os.environ.get("SHMBATCH_SANITIZE") else []

ffibuilder = FFI()
ffibuilder.cdef(_cdef_section(CSRC / "ring.h"))
ffibuilder.set_source(
    "engine._ringc",
    '#include "ring.h"',
    sources=sorted(str(p.relative_to(CSRC.parent)) for p in CSRC.glob("*.c")),
    include_dirs=["csrc"],
    extra_compile_args=["-std=gnu11", "-O2", "-Wall", *SANITIZE],
    extra_link_args=SANITIZE,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
