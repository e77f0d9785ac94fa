"""The torch headers every source of the core parses first, compiled once per fresh build.

Each source includes ATen's and c10d's headers, and parsing them is most of its compile
time: compiled once into a precompiled header, they are read once per build instead of
once per source (a source of the engine: 15 s, then 6 s). GCC uses
``torch_headers.h.gch`` only where it was made with the very flags of the source it
compiles, and otherwise reads ``torch_headers.h`` as text, so the binary is the same
either way. The ``.gch`` (hundreds of MB) is removed after the build; an incremental
build (a few sources) reads the header as text. torch/extension.h stays out: with it the
header grows to 800 MB, takes 45 s to make on one core and saves about that much (the
test module's bindings: 39 s each, 20 s with it).
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

HEADERS = (
    "ATen/ATen.h",
    "torch/csrc/distributed/c10d/Backend.hpp",
    "torch/csrc/distributed/c10d/Store.hpp",
    "torch/csrc/distributed/c10d/Types.hpp",
    "torch/csrc/distributed/c10d/Work.hpp",
)
# Making the header takes about as long as 3 sources save: below this many, none is made.
WORTH_IT = 4
TEXT = "".join(f"#include <{header}>\n" for header in HEADERS)


def include_flags(build_dir: Path) -> list[str]:
    """The flags that put the header first in every source, the header written here
    (only where it differs: its time is a dependency of every object)."""
    header = build_dir / "torch_headers.h"
    if not header.is_file() or header.read_text() != TEXT:
        header.write_text(TEXT)
    return ["-include", str(header)]


@contextmanager
def precompiled(
    build_dir: Path,
    name: str,
    includes: list[str],
    cflags: list[str],
    cpp_extension: ModuleType,
    fresh: bool,
) -> Iterator[None]:
    """Around a build, after ``include_flags``: where ``fresh``, the header compiled
    first with the flags torch's cpp_extension gives every source (``cflags``: ours,
    without the ``-include``); the ``.gch`` removed after, whatever happened."""
    gch = build_dir / "torch_headers.h.gch"
    try:
        if fresh:
            _compile(build_dir, name, includes, cflags, cpp_extension, gch)
        yield
    finally:
        gch.unlink(missing_ok=True)


def _compile(
    build_dir: Path,
    name: str,
    includes: list[str],
    cflags: list[str],
    cpp_extension: ModuleType,
    gch: Path,
) -> None:
    system = [*cpp_extension.include_paths(), sysconfig.get_path("include", "posix_prefix")]
    flags = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    flags += [f"-I{path}" for path in includes]
    for path in system:
        flags += ["-isystem", path]
    flags += ["-fPIC", "-std=c++20", *cflags]
    cxx = os.environ.get("CXX", "c++")
    header = build_dir / "torch_headers.h"
    made = subprocess.run(
        [cxx, *flags, "-x", "c++-header", str(header), "-o", str(gch)],
        capture_output=True,
        check=False,
    )
    # A header GCC would not take for these flags: read as text instead.
    probe = subprocess.run(
        [cxx, *flags, "-Winvalid-pch", "-include", str(header), "-fsyntax-only", "-x", "c++"]
        + ["/dev/null"],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0 or probe.returncode != 0 or "precompiled header" in probe.stderr:
        gch.unlink(missing_ok=True)
