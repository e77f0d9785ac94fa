"""A rank whose groups fail to connect fails the start on every rank, naming the cause,
within the group's timeout and a second.

After the ranks' verdict (test_startup_verdict.py) each builds Gloo's groups and starts
the core. Forced here, each on one rank of a 2 x 2 job:

- its Gloo connect holds past the timeout (Gloo's own connect waited ~15 s for a
  peer that died mid-connect, whatever timeout it had: chaos seeds 17, 67, 139);
- its core fails at once (the others wait for its address);
- its core fails once every rank's core has started (without the ranks' last wait they
  would return a group);
- its core holds past the timeout: it holds back only the connections to it (a rank
  connects to each peer once that one published its address, in any order), so the rank
  that is no peer of it connects all of its own and waits for every rank to start, and
  the others name it. Before, each waited for the next in a chain to it and a timeout
  named a rank that left because of it (chaos seeds 67, 195, 125).

Each has its plant, the bug the fix is for, and the test that the plant fails. Times
count from the ranks' verdict, when the groups begin to connect.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import stream_mutants
from multiprocess import SHAPES
from reliability_helpers import run_bare, timed_init

SHAPE = SHAPES["2x2"]
AT_FAULT = {"gloo_held": 1, "core_fails": 3, "core_fails_late": 0, "core_held": 0}
WHY = "planted: this rank's core cannot start"
HOLD_S = 8.0  # far past every bound below: a rank that waits for it fails it
SHORT_TIMEOUT_S = 3.0  # where the others' own timeout is what fires
LONG_TIMEOUT_S = 10.0  # where the published failure must stop them long before
LATER_S = 0.3  # below the settle (fairring_pg.startup.SETTLE_S)
STARTED = "test/core_started"
# How a rank's error names the one whose Gloo connect held (process_groups.py).
STALLED = r"rank 1\b[^:]*came to connect it and left or stalled"
NOT_A_PEER = 3  # of the held rank 0: its own connects need nothing of rank 0
# Rank 3's own wait, or the wait in which it heard of another's failure (its error's
# first clause: what comes after names the other ranks' errors).
STARTED_ITS_OWN = "waiting for every rank to start"
BOUND_S = {
    "gloo_held": SHORT_TIMEOUT_S + 1.0,
    "core_fails": 3.0,
    "core_fails_late": 3.0,
    "core_held": SHORT_TIMEOUT_S + 1.0,
}


def _replace_core(make: Callable[[Any], Callable[..., Any]]) -> None:
    from fairring_pg._build import load_extension

    ext = load_extension()
    ext.FairringBackend = make(ext.FairringBackend)


def _fault(case: str, store: Any, world: int) -> float:
    """Puts this case's fault on this rank; returns the group's timeout."""
    import fairring_pg.process_groups as process_groups

    if case == "gloo_held":
        real_group = process_groups._gloo_group

        def held(*args: Any, **kwargs: Any) -> Any:
            time.sleep(HOLD_S)
            return real_group(*args, **kwargs)

        process_groups._gloo_group = held
        return SHORT_TIMEOUT_S

    def failing(real: Callable[..., Any]) -> Callable[..., Any]:
        def start(*args: Any, **kwargs: Any) -> Any:
            if case == "core_fails_late":
                real(*args, **kwargs)  # started, connected to all its peers: dropped
                # ...and fails only once every other rank's core has started too.
                keys = [f"{STARTED}/{r}" for r in range(1, world)]
                store.wait(keys, timedelta(seconds=LONG_TIMEOUT_S))
            elif case == "core_held":
                time.sleep(HOLD_S)
            raise RuntimeError(WHY)

        return start

    _replace_core(failing)
    return SHORT_TIMEOUT_S if case == "core_held" else LONG_TIMEOUT_S


def _say_started(store: Any, rank: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Marks in the store when this rank's core has started (core_fails_late)."""

    def wrap(real: Callable[..., Any]) -> Callable[..., Any]:
        def start(*args: Any, **kwargs: Any) -> Any:
            core = real(*args, **kwargs)
            store.set(f"{STARTED}/{rank}", "1")
            return core

        return start

    return wrap


def _later(real: Callable[..., Any]) -> Callable[..., Any]:
    """Rank 0's peers start their cores LATER_S after rank 3 does: rank 3 times out
    first, waiting for rank 1, and only what rank 1 says after names rank 0."""

    def start(*args: Any, **kwargs: Any) -> Any:
        time.sleep(LATER_S)
        return real(*args, **kwargs)

    return start


def _plant(case: str) -> None:
    """The bug each case is for."""
    import native_module

    import fairring_pg.backend as backend
    import fairring_pg.process_groups as process_groups

    if case == "gloo_held":  # Gloo's connect waited for, however long it takes
        process_groups.connect_watched = lambda make, *args: make()
    elif case == "core_fails":  # a failure after the verdict told to no one
        backend.publish_failure = lambda *args: None
    elif case == "core_fails_late":  # a rank returns its group once its peers are in
        backend.all_started = lambda *args: None
    elif case == "core_held":  # peers connected in order; a timeout names the next peer
        native_module.load().plants.arm("mesh_connects_in_order")
        backend.failures_of_others = lambda *args: []


def _time_from_the_verdict() -> dict[str, float]:
    """When this rank passed the ranks' verdict and began to connect its groups: the
    faults here come after it, and the bounds count from it."""
    import fairring_pg.backend as backend

    began: dict[str, float] = {}
    connect = backend._connect

    def timed(*args: Any, **kwargs: Any) -> Any:
        began["at"] = time.monotonic()
        return connect(*args, **kwargs)

    backend._connect = timed
    return began


def _start(rank: int, world: int, store: Any, case: str, planted: bool) -> dict[str, Any]:
    stream_mutants.arm_from_env()
    timeout_s = _fault(case, store, world) if rank == AT_FAULT[case] else None
    if case == "core_held" and rank in (1, 2):
        _replace_core(_later)
    if case == "core_fails_late" and rank != AT_FAULT[case]:
        _replace_core(_say_started(store, rank))
    if planted:
        _plant(case)
    if timeout_s is None:
        timeout_s = SHORT_TIMEOUT_S if case in ("gloo_held", "core_held") else LONG_TIMEOUT_S
    return timed_init(rank, world, store, timeout_s, since=_time_from_the_verdict())


def _problems(case: str, planted: bool) -> list[str]:
    outcomes = run_bare(_start, SHAPE, timeout_s=90, case=case, planted=planted)
    at_fault = AT_FAULT[case]
    problems = []
    for o in outcomes:
        if o.status != "ok":
            problems.append(o.describe())
            continue
        error, took = o.value["error"], o.value["took"]
        if error is None:
            problems.append(f"rank {o.rank}: init_process_group succeeded")
            continue
        print(f"{case} rank {o.rank} ({took:.2f} s): {error}")
        if o.rank != at_fault:
            if f"rank {at_fault} " not in error and f"rank {at_fault}:" not in error:
                problems.append(f"rank {o.rank}: rank {at_fault} not named: {error}")
            elif case == "gloo_held" and not re.search(STALLED, error):
                problems.append(f"rank {o.rank}: rank {at_fault} not named as stalled: {error}")
            elif case in ("core_fails", "core_fails_late") and WHY not in error:
                problems.append(f"rank {o.rank}: rank {at_fault}'s reason not said: {error}")
            elif case == "core_held" and o.rank == NOT_A_PEER and not _own_wait(error):
                problems.append(f"rank {o.rank}: held back connecting its own peers: {error}")
        if took > BOUND_S[case] and (o.rank != at_fault or case != "core_held"):
            problems.append(f"rank {o.rank}: raised after {took:.1f} s (bound {BOUND_S[case]} s)")
    return problems


def _own_wait(error: str) -> bool:
    """Rank NOT_A_PEER's error says its own wait was for every rank to start."""
    own = error.split(" (and other ranks failed to start")[0]
    return STARTED_ITS_OWN in re.sub(r": rank \d+: .*", "", own)


CASES = list(AT_FAULT)


@pytest.mark.parametrize("case", CASES)
def test_a_rank_whose_start_fails_is_named_on_every_rank_in_time(case: str) -> None:
    problems = _problems(case, planted=False)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("case", CASES)
def test_the_plant_fails_it(case: str) -> None:
    problems = _problems(case, planted=True)
    assert problems, f"{case}: every rank named the cause in time with the bug planted"
