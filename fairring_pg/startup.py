"""Start-up waits that fail fast when another rank has already failed.

Every rank of a group waits on the store for the others (configuration, topology, job
token, the groups it connects). A rank whose own start fails (a bad ``FAIRRING_*`` value
on that machine, a failed build, a peer that died while the groups connect) publishes
its error under one key, the first to fail keeping it, and every wait here, each Gloo
group's connect and the core's own connecting watch that key, so the other ranks raise
at once naming the rank and its error, instead of sitting out the whole init timeout
and then blaming a store timeout or a peer that left because of it.

Every wait of one group's start ends by one deadline, the group's timeout from the
moment its core is loaded (``one_deadline``): a peer that dies while the start runs is
told within that timeout whichever stage it dies in, not within the timeout of the
stage this rank had reached.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

# The core's store is the group's under this prefix (core_store); the failure key is in
# it, where the core reads it too (src/transport/startup_failure.h).
CORE_PREFIX = "fairring/core/"
FAILURE_KEY = "startup_failed"
PASSED_KEY = "fairring/startup_passed"
STARTED_KEY = "fairring/started"
_POLL_S = 0.05
_STARTED_POLL_S = 0.01  # every group creation waits on it once
# How long past its timeout a Gloo group's connect may run before this rank gives up on
# it: Gloo's own connect can wait ~15 s for a peer that died mid-connect, whatever the
# timeout it was given (pair.h, "Connect timeout").
CONNECT_GRACE_S = 0.3
# How long a rank whose start failed waits for the others to say how theirs ended
# (why, or, in a Gloo connect, that it ended).
SETTLE_S = 0.5

T = TypeVar("T")

# When the start of the group this thread creates must end (time.monotonic()); None
# outside a start.
_START_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "fairring_start_deadline", default=None
)


@contextlib.contextmanager
def one_deadline(timeout: timedelta) -> Iterator[None]:
    """Within it, every wait below ends by ``timeout`` from now at the latest."""
    token = _START_DEADLINE.set(time.monotonic() + timeout.total_seconds())
    try:
        yield
    finally:
        _START_DEADLINE.reset(token)


def deadline_after(timeout: timedelta) -> float:
    """``timeout`` from now, or the start's deadline if that comes first."""
    deadline = time.monotonic() + timeout.total_seconds()
    start = _START_DEADLINE.get()
    return deadline if start is None else min(deadline, start)


def time_left(timeout: timedelta) -> timedelta:
    """What is left of the start's time (at least 1 ms; ``timeout`` outside a start)."""
    left = deadline_after(timeout) - time.monotonic()
    return timedelta(seconds=max(left, 0.001))


def settle_until(settle_s: float) -> float:
    """When a rank whose start failed stops waiting for the others to say how theirs
    ended: ``settle_s`` from now, or from the start's deadline if this rank's own wait
    ran to it (the others' waits end there too)."""
    now = time.monotonic()
    start = _START_DEADLINE.get()
    return now + settle_s if start is None else max(now, min(now, start) + settle_s)


def core_store(store: Any) -> Any:
    """The core's store: the group's ``store`` under CORE_PREFIX."""
    import torch.distributed as dist

    return dist.PrefixStore(CORE_PREFIX, store)


def publish_failure(store: Any, rank: int, exc: BaseException) -> None:
    """Tell the other ranks why this one cannot start: under its own key, and under the
    one every wait watches unless another rank already did (its reason is the nearer to
    the cause). Best effort: never raises."""
    why = f"rank {rank}: {type(exc).__name__}: {exc}"
    try:
        store = core_store(store)
        store.set(f"{FAILURE_KEY}/{rank}", why)
    except Exception:  # noqa: BLE001 - the original error is what matters
        return
    try:
        store.compare_set(FAILURE_KEY, "", why)
    except Exception:  # noqa: BLE001 - a store without compare_set: the last one wins
        try:
            store.set(FAILURE_KEY, why)
        except Exception:  # noqa: BLE001 - the original error is what matters
            pass


def failures_of_others(store: Any, rank: int, size: int, settle: bool = True) -> list[str]:
    """What the other ranks published of their own failure to start, once each has or
    SETTLE_S has passed (``settle``; else what is there now): ranks whose waits timed
    out together (each for the next in a chain to a dead one) then each name the whole
    chain, not just their neighbour."""
    keys = [f"{FAILURE_KEY}/{r}" for r in range(size) if r != rank]
    deadline = settle_until(SETTLE_S) if settle else time.monotonic()
    try:
        store = core_store(store)
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        published = [store.get(key).decode() for key in keys if store.check([key])]
    except Exception:  # noqa: BLE001 - a dead store: this rank's own error says enough
        return []
    # A rank that stopped because another failed only repeats that one's reason.
    return [why for why in published if f": {AnotherRankFailed.__name__}: " not in why]


def published_failure(store: Any) -> str | None:
    """The failure a rank published, if any (None also where the store cannot say)."""
    try:
        store = core_store(store)
        return store.get(FAILURE_KEY).decode() if store.check([FAILURE_KEY]) else None
    except Exception:  # noqa: BLE001 - the caller's own wait reports a dead store
        return None


class AnotherRankFailed(RuntimeError):
    """This rank's start stops because another rank's failed (its reason inside)."""


class ConnectGivenUp(TimeoutError):
    """A connect that did not end in time (connect_watched): it still runs, unfinished."""


class PeersNamed(RuntimeError):
    """A failure to start whose message names the ranks at fault, having given them
    time to say how they ended (no second wait for them)."""


def _another_failed(what: str, why: str) -> AnotherRankFailed:
    return AnotherRankFailed(
        f"fairring: another rank failed to start this process group, so this one stops "
        f"too ({what}): {why}"
    )


def connect_watched(make: Callable[[], T], store: Any, timeout: timedelta, what: str) -> T:
    """``make()`` (a blocking connect, e.g. a ProcessGroupGloo) on a thread of its own,
    waited for until it ends, another rank publishes a failure (raised at once, naming
    it) or ``timeout`` + CONNECT_GRACE_S passes (ConnectGivenUp). A connect given up on
    ends on its own thread later and is dropped; the process's exit waits for it."""
    ended = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = make()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            result["error"] = exc
        finally:
            ended.set()

    # Not a daemon: the interpreter's exit waits for a connect given up on (it ends with
    # the start, process_groups.gloo_group) rather than finalizing under it, which aborts
    # the process when the connect's thread comes back into Python.
    threading.Thread(target=run, name="fairring-connect", daemon=False).start()
    deadline = deadline_after(timeout) + CONNECT_GRACE_S
    while not ended.wait(_POLL_S):
        if (why := published_failure(store)) is not None:
            raise _another_failed(what, why)
        if time.monotonic() > deadline:
            raise ConnectGivenUp(f"{what} did not end within {timeout} (+{CONNECT_GRACE_S} s)")
    if "error" in result:
        raise result["error"]
    return result["value"]


def all_passed(store: Any, rank: int, size: int, timeout: timedelta) -> None:
    """This rank passed every check of its start; wait until every rank says so, or raise
    the first failure one of them published. No rank builds a group (Gloo's, the core's)
    before this: one that did would see a peer that failed later leave mid-connect, and
    report a closed connection instead of the setting at fault."""
    _all_say(store, rank, size, PASSED_KEY, timeout, "to pass its start-up checks", _POLL_S)


def all_started(store: Any, rank: int, size: int, timeout: timedelta) -> None:
    """This rank's groups are connected and its core started; wait until every rank's
    are, or raise the failure one of them published. The group is then made on every
    rank or on none: a rank whose peers all connected to it would otherwise return a
    group that fails at its first call, naming a peer that left because of a third."""
    _all_say(store, rank, size, STARTED_KEY, timeout, "to start", _STARTED_POLL_S)


def _all_say(
    store: Any, rank: int, size: int, key: str, timeout: timedelta, what: str, poll_s: float
) -> None:
    """Every rank says ``key``: a count each look reads in one request, whatever the
    group's size, and a key per rank that names the silent ones at the timeout."""
    store.set(f"{key}/{rank}", "1")
    store.add(f"{key}/count", 1)
    waiting = f"waiting for every rank {what}"
    deadline = deadline_after(timeout)
    while store.add(f"{key}/count", 0) < size:
        if (why := published_failure(store)) is not None:
            raise _another_failed(waiting, why)
        if time.monotonic() > deadline:
            silent = [r for r in range(size) if not store.check([f"{key}/{r}"])]
            named = ", ".join(f"rank {r}" for r in silent)
            raise RuntimeError(
                f"fairring: timed out after {timeout} {waiting}: {named} never said so "
                "(did not start, died or stalled)"
            )
        time.sleep(poll_s)


def wait_for(
    store: Any, keys: Sequence[str], timeout: timedelta, what: str, ranks: Sequence[int]
) -> None:
    """Wait until every key exists (``ranks[i]`` writes ``keys[i]``); raise at once if
    another rank failed to start, and at the timeout naming the ranks that never wrote."""
    deadline = deadline_after(timeout)
    while not store.check(list(keys)):
        if (why := published_failure(store)) is not None:
            raise _another_failed(what, why)
        if time.monotonic() > deadline:
            missing = [r for r, key in zip(ranks, keys, strict=True) if not store.check([key])]
            named = ", ".join(f"rank {r}" for r in missing)
            raise RuntimeError(
                f"fairring: timed out after {timeout} {what}: {named} never wrote it "
                "(did not start, died or stalled)"
            )
        time.sleep(_POLL_S)
