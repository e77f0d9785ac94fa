"""What a user sees while the C++ core compiles on first use.

A first ``init_process_group("fairring")`` on a machine compiles for a minute or more;
silence that long looks like a hang. The one process that builds (the holder of the
build lock in ``_build.py``; the machine's other ranks wait on that lock) says what it
builds, where, about how long that takes and that the others wait, then a line every
``PROGRESS_INTERVAL_S`` while the compiler runs, and a last line when it is done.
Everything goes to stderr, so that a job's own output on stdout stays clean.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Seconds between "still compiling" lines: well below the half minute after which a
# silent program starts to look hung.
PROGRESS_INTERVAL_S = 15.0


def say(text: str) -> None:
    rank = os.environ.get("RANK")
    who = f" (rank {rank})" if rank else ""
    print(f"fairring_pg{who}: {text}", file=sys.stderr, flush=True)


@contextmanager
def compile_progress(
    name: str, build_dir: Path, sources: int, interval: float | None = None
) -> Iterator[None]:
    """Report a compile that runs inside the ``with`` block."""
    every = PROGRESS_INTERVAL_S if interval is None else interval
    files = f"{sources} source file{'' if sources == 1 else 's'}"
    say(
        f"compiling the C++ core ({name}, {files}) into {build_dir};"
        " the other ranks on this machine wait for it"
    )
    say(
        "this happens once per machine after an install or upgrade and takes about"
        " 2 CPU-minutes, spread over the cores (minutes on a busy 2-core machine);"
        " FAIRRING_BUILD_VERBOSE=1 shows the compiler's output"
    )
    start = time.monotonic()
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every):
            say(f"still compiling the C++ core ({time.monotonic() - start:.0f} s)")

    ticker = threading.Thread(target=tick, name="fairring-build-progress", daemon=True)
    ticker.start()
    finished = False
    try:
        yield
        finished = True
    finally:
        stop.set()
        ticker.join()
        elapsed = time.monotonic() - start
        if finished:
            say(f"compiled the C++ core in {elapsed:.0f} s; later runs load it from {build_dir}")
        else:
            say(f"compiling the C++ core failed after {elapsed:.0f} s")
