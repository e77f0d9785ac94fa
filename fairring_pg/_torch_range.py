"""The torch releases fairring_pg is tested with, and what a torch outside them gets.

The C++ core compiles against the installed torch's c10d headers on first use, so a
torch it was not written for fails there, as a compiler's wall of errors. Before
compiling, ``_build.load_extension`` asks :func:`check`: an older torch than
pyproject.toml's lower bound is refused with one message saying what to install; a
newer one than tested is tried (c10d's interfaces rarely break between releases), with
one line saying so and the same advice if the build then fails.
"""

from __future__ import annotations

import re

# pyproject.toml's lower bound (tests/test_torch_range.py checks that they agree).
OLDEST = (2, 11)
# The newest minor release the suite has run on; .ci/run tests what pip resolves to
# and builds the core against OLDEST in a virtual environment of its own.
NEWEST_TESTED = (2, 15)


def tested_range() -> str:
    return f"{_name(OLDEST)} to {_name(NEWEST_TESTED)}"


def advice() -> str:
    """What to install to get a tested torch."""
    newest = (NEWEST_TESTED[0], NEWEST_TESTED[1] + 1)
    return f"pip install 'torch>={_name(OLDEST)},<{_name(newest)}'"


def check(version: str) -> str | None:
    """Raise for a torch older than OLDEST; return a note for one newer than tested
    (None within the tested range). ``version`` is ``torch.__version__``."""
    found = _minor(version)
    if found is not None and found < OLDEST:
        raise RuntimeError(
            f"fairring_pg needs torch >= {_name(OLDEST)} (tested: {tested_range()}), found"
            f" torch {version}: its C++ core does not compile against this torch. Upgrade"
            f" torch ({advice()}), then run again."
        )
    if found is not None and found > NEWEST_TESTED:
        return (
            f"torch {version} is newer than the releases fairring_pg is tested with"
            f" ({tested_range()}); trying it. If the build or a collective fails, install"
            f" a tested torch ({advice()}) or a newer fairring_pg."
        )
    return None


def _minor(version: str) -> tuple[int, int] | None:
    # "2.14.1", "2.14.1+cu130", "2.15.0.dev20260101+cpu", "2.14.0a0+git1234": the
    # release a pre-release or a source build leads up to counts as that release.
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _name(minor: tuple[int, int]) -> str:
    return f"{minor[0]}.{minor[1]}"
