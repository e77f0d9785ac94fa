"""Start-up waits that fail fast when another rank has already failed.

Every rank of a group waits on the store for the others (configuration, topology, job
token). A rank whose own start fails (a bad ``FAIRRING_*`` value on that machine, a
failed build) publishes its error under one key, and every wait here watches that key,
so the other ranks raise at once, naming the rank and its error, instead of sitting out
the whole init timeout and then blaming a store timeout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

FAILURE_KEY = "fairring/startup_failed"
PASSED_KEY = "fairring/startup_passed"
_POLL_S = 0.05


def publish_failure(store: Any, rank: int, exc: BaseException) -> None:
    """Tell the other ranks why this one cannot start (best effort: never raises)."""
    try:
        store.set(FAILURE_KEY, f"rank {rank}: {type(exc).__name__}: {exc}")
    except Exception:  # noqa: BLE001 - the original error is what matters
        pass


def all_passed(store: Any, rank: int, size: int, timeout: timedelta) -> None:
    """This rank passed every check of its start; wait until every rank says so, or raise
    the first failure one of them published. No rank builds a group (Gloo's, the core's)
    before this: one that did would see a peer that failed later leave mid-connect, and
    report a closed connection instead of the setting at fault."""
    store.set(f"{PASSED_KEY}/{rank}", "1")
    keys = [f"{PASSED_KEY}/{r}" for r in range(size)]
    wait_for(
        store, keys, timeout, "waiting for every rank to pass its start-up checks", range(size)
    )


def wait_for(
    store: Any, keys: Sequence[str], timeout: timedelta, what: str, ranks: Sequence[int]
) -> None:
    """Wait until every key exists (``ranks[i]`` writes ``keys[i]``); raise at once if
    another rank failed to start, and at the timeout naming the ranks that never wrote."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check(list(keys)):
        if store.check([FAILURE_KEY]):
            raise RuntimeError(
                f"fairring: another rank failed to start this process group, so this one "
                f"stops too ({what}): {store.get(FAILURE_KEY).decode()}"
            )
        if time.monotonic() > deadline:
            missing = [r for r, key in zip(ranks, keys, strict=True) if not store.check([key])]
            named = ", ".join(f"rank {r}" for r in missing)
            raise RuntimeError(
                f"fairring: timed out after {timeout} {what}: {named} never wrote it "
                "(did not start, died or stalled)"
            )
        time.sleep(_POLL_S)
