"""cffi builder for engine._ringc (API, out-of-line mode).

The cdef is the part of ring.h between its "cdef" markers, so the header is
the one contract: cffi reads the same prototypes and constants that ring.c
is compiled against.
"""
import pathlib

from cffi import FFI

CSRC = pathlib.Path(__file__).resolve().parent


def _cdef_section(header: pathlib.Path) -> str:
    text = header.read_text()
    begin = text.index("/* --- cdef:")
    end = text.index("/* --- cdef end")
    return text[text.index("\n", begin) + 1:end]


ffibuilder = FFI()
ffibuilder.cdef(_cdef_section(CSRC / "ring.h"))
ffibuilder.set_source(
    "engine._ringc",
    '#include "ring.h"',
    sources=["csrc/ring.c"],  # relative: setuptools builds from the project root
    include_dirs=["csrc"],
    extra_compile_args=["-std=gnu11", "-O2", "-Wall"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
