"""Compiling and loading the C++ core (``fairring_pg_C``) on first use.

The build is cached in a directory named after a hash of everything that affects the
binary, so an upgrade of torch, Python or the sources rebuilds, and a rerun loads.
All ranks of a job start together: one takes an exclusive ``flock`` and compiles, the
others wait on it and then load the result. The kernel drops a ``flock`` when its
holder dies, so a killed builder never leaves the others waiting forever (torch's own
lock file inside the build directory can; we clear it while holding ours). The builder
reports its progress (``_build_progress.py``); a load from the cache prints nothing.

``FAIRRING_BUILD_DIR`` replaces the cache directory, ``FAIRRING_BUILD_VERBOSE=1`` shows
the compiler's output.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import IO

from fairring_pg import _build_pch, _torch_range
from fairring_pg._build_progress import PROGRESS_INTERVAL_S, compile_progress, say
from fairring_pg.config import Config

EXTENSION_NAME = "fairring_pg_C"
# Test-only native code (tests/native/: the stream vehicle, bindings of the core's
# internals), built only by the test suite, linked against the core.
TEST_EXTENSION_NAME = "fairring_pg_testing"
CFLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
_SOURCE_SUFFIXES = {".cpp", ".cc"}
_HASHED_SUFFIXES = _SOURCE_SUFFIXES | {".h", ".hpp", ".inl", ".cu", ".cuh"}
_ERROR_TAIL_LINES = 40

_loaded: dict[tuple[str, str], ModuleType] = {}


def source_dir_candidates() -> list[Path]:
    package = Path(__file__).resolve().parent
    # A regular install ships the sources inside the package; an editable one (and a
    # plain checkout on sys.path) has them at the top of the repository.
    return [package / "_src", package.parent / "src"]


def default_source_dir() -> Path:
    candidates = source_dir_candidates()
    for candidate in candidates:
        if _sources(candidate):
            return candidate
    raise RuntimeError(
        "fairring_pg: no C++ sources (*.cpp) found; looked in "
        + " and ".join(str(c) for c in candidates)
        + ". Reinstall fairring_pg (pip install -e . from a checkout)."
    )


def _sources(source_dir: Path) -> list[Path]:
    if not source_dir.is_dir():
        return []
    return sorted(p for p in source_dir.rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file())


def build_hash(source_dir: Path, name: str = EXTENSION_NAME, extra: str = "") -> str:
    import torch

    digest = hashlib.sha256()
    # The source path is part of the key because torch's build.ninja records absolute
    # paths: two installs sharing one directory would rebuild each other's binary.
    # The precompiled header's text too: it is the first include of every source. And
    # where torch and Python's headers are: build.ninja names them, so a new virtual
    # environment with the same versions is a build of its own, reported as one.
    parts = (name, str(source_dir), torch.__version__, sys.version, " ".join(_cflags()), extra)
    parts += (_build_pch.TEXT, str(Path(torch.__file__).resolve().parent))
    parts += (sysconfig.get_path("include", "posix_prefix"),)
    for part in (*parts, os.environ.get("CXX", "")):
        digest.update(part.encode())
        digest.update(b"\0")
    for path in sorted(source_dir.rglob("*")):
        if path.suffix in _HASHED_SUFFIXES and path.is_file():
            digest.update(str(path.relative_to(source_dir)).encode())
            digest.update(b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()[:20]


def build_directory(digest: str, name: str = EXTENSION_NAME) -> Path:
    """Where the build with this ``build_hash`` lives."""
    override = Config.read("build_dir")
    if override:
        # The test module beside the core, not over it: torch writes one build.ninja
        # per directory.
        base = Path(override).expanduser()
        return base / name if name == TEST_EXTENSION_NAME else base
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "fairring_pg" / digest


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock_file:
        _wait_for_lock(lock_file, lock_path)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _wait_for_lock(lock_file: IO[str], lock_path: Path) -> None:
    """Take the build lock. Another process holding it is compiling (and says so where
    its output goes, which may not be here): a wait past PROGRESS_INTERVAL_S says what
    it waits for, and again at that interval."""
    start = time.monotonic()
    said = start
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if now - said >= PROGRESS_INTERVAL_S:
                said = now
                say(
                    f"waiting for another process to finish compiling the C++ core "
                    f"({lock_path.with_suffix('')}, {now - start:.0f} s)"
                )
            time.sleep(0.1)


def load_extension(
    source_dir: Path | str | None = None,
    name: str = EXTENSION_NAME,
    *,
    link_with: ModuleType | None = None,
    include_dirs: tuple[Path, ...] = (),
) -> ModuleType:
    """Build (if needed) and import the C++ extension; cached per process.

    ``link_with``: an extension already loaded whose shared object this one links
    against (the test module uses the core's symbols; the dynamic loader finds the very
    object Python loaded, so both share one copy of the core's state)."""
    src = Path(source_dir) if source_dir is not None else default_source_dir()
    src = src.resolve()
    key = (str(src), name)
    if key in _loaded:
        return _loaded[key]
    sources = _sources(src)
    if not sources:
        raise RuntimeError(f"fairring_pg: no C++ sources (*.cpp) found under {src}")

    import torch

    # Before anything compiles: an older torch is refused here, in one message.
    untested = _torch_range.check(torch.__version__)
    cpp_extension = _import_cpp_extension()

    verbose = build_verbose()
    linked = str(Path(link_with.__file__).resolve()) if link_with is not None else ""
    digest = build_hash(src, name, extra=_digest_of_file(linked) if linked else "")
    build_dir = build_directory(digest, name)
    with _exclusive(build_dir.with_name(build_dir.name + ".lock")):
        build_dir.mkdir(parents=True, exist_ok=True)
        # Only a process holding our flock ever builds here, so a leftover torch baton
        # can only come from a builder that died: waiting on it would hang forever.
        (build_dir / "lock").unlink(missing_ok=True)
        # The stamp names what the binary was built from; FAIRRING_BUILD_DIR is not
        # keyed by the hash, so it can hold an older build that needs compiling again.
        stamp = build_dir / f"{name}.build_hash"
        built = (build_dir / f"{name}.so").is_file() and _read(stamp) == digest
        progress: AbstractContextManager[None] = (
            nullcontext() if built else compile_progress(name, build_dir, len(sources))
        )
        if untested and not built:
            say(untested)
        includes = [str(src), *(str(d) for d in include_dirs)]
        first = _build_pch.include_flags(build_dir)
        fresh = not (build_dir / f"{name}.so").is_file() and len(sources) >= _build_pch.WORTH_IT
        pch = _build_pch.precompiled(build_dir, name, includes, _cflags(), cpp_extension, fresh)
        try:
            with progress, pch:
                module = cpp_extension.load(
                    name=name,
                    sources=[str(p) for p in sources],
                    extra_include_paths=includes,
                    extra_cflags=[*_cflags(), *first],
                    extra_ldflags=[linked] if linked else None,
                    build_directory=str(build_dir),
                    verbose=verbose,
                    with_cuda=False,
                )
        except Exception as exc:
            raise RuntimeError(_failure_message(exc, build_dir, verbose, untested)) from exc
        if not built:
            stamp.write_text(digest)
    _loaded[key] = module
    return module


def load_test_extension(native_dir: Path | str | None = None) -> ModuleType:
    """The test-only module built from ``native_dir`` (default: tests/native/ of the
    checkout this package is in), linked against the core (which it loads first).
    Never part of a user's install."""
    core = load_extension()
    native = (
        Path(native_dir)
        if native_dir is not None
        else Path(__file__).resolve().parent.parent / "tests" / "native"
    )
    if not _sources(native):
        raise RuntimeError(f"fairring_pg: no test sources in {native}: tests run from a checkout")
    return load_extension(
        native, TEST_EXTENSION_NAME, link_with=core, include_dirs=(default_source_dir(),)
    )


def _digest_of_file(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _import_cpp_extension() -> ModuleType:
    # On a machine with a CUDA toolkit but no GPU, importing cpp_extension with a CUDA
    # build of torch logs "No CUDA runtime is found, using CUDA_HOME=..." on every rank
    # of every job. The core compiles no CUDA code (with_cuda=False): the line can only
    # mislead, so it is dropped; anything else torch logs there still shows.
    logger = logging.getLogger("torch.utils.cpp_extension")
    quiet = _DropMessage("No CUDA runtime is found")
    logger.addFilter(quiet)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.removeFilter(quiet)
    return cpp_extension


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def build_verbose() -> bool:
    return bool(Config.read("build_verbose"))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cflags() -> list[str]:
    # The same flags for CPU and CUDA builds of torch: the core reaches CUDA only
    # through c10's device-generic stream and event interface (src/subgroups/),
    # so it needs neither CUDA's headers nor nvcc.
    return list(CFLAGS)


def _failure_message(
    exc: BaseException, build_dir: Path, verbose: bool, untested: str | None
) -> str:
    lines = str(exc).splitlines()
    tail = "\n".join(lines[-_ERROR_TAIL_LINES:])
    hint = (
        "see the build output above"
        if verbose
        else "set FAIRRING_BUILD_VERBOSE=1 to see the whole build output"
    )
    # Last, where it is read: with an untested torch, that is the likely cause.
    why = f"\nfairring_pg: {untested}" if untested else ""
    return (
        f"fairring_pg: building the C++ extension failed in {build_dir}:\n"
        f"{type(exc).__name__}: {tail}\n({hint}){why}"
    )
