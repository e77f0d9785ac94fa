"""GroupFailure (src/failure/group_failure.*) on its own, rule by rule (docs/design.md,
"Failure"), through the test-only module: no engine, no connection, time given in
milliseconds. The multi-rank tests (test_failure_semantics.py, test_faults.py) show the
rules carried out; these show the rules themselves, each case a row."""

from __future__ import annotations

from typing import Any

import native_module
import pytest


def _failure() -> Any:
    return native_module.load().GroupFailure()


NONE = 2**64 - 1  # GroupFailure::kNone: the turn "failed" while healthy


def test_the_none_turn_is_the_modules() -> None:
    assert native_module.load().GroupFailure.NONE == NONE


# ------------------------------------------------------------ first reason wins

# Each row: the fail() calls in order (message, from turn), then what each returned,
# the reason, and the turn failed from.
FAILS = [
    ("one call", [("A", 5)], [NONE], "A", 5),
    ("a later turn changes nothing", [("A", 5), ("B", 7)], [NONE, None], "A", 5),
    ("the same turn changes nothing", [("A", 5), ("B", 5)], [NONE, None], "A", 5),
    # An earlier turn widens what fails, but the first error stays the reason.
    ("an earlier turn widens, the reason stays", [("A", 5), ("B", 2)], [NONE, 5], "A", 2),
    ("a lost peer (turn 0) after a refusal", [("A", 5), ("B", 0)], [NONE, 5], "A", 0),
    ("three calls", [("A", 9), ("B", 4), ("C", 6)], [NONE, 9, None], "A", 4),
]


@pytest.mark.parametrize(("calls", "returned", "reason", "turn"), [r[1:] for r in FAILS],
                         ids=[r[0] for r in FAILS])  # fmt: skip
def test_the_first_reason_wins(
    calls: list[tuple[str, int]], returned: list[int | None], reason: str, turn: int
) -> None:
    f = _failure()
    assert not f.failed() and f.reason() == "" and f.fail_seq() == NONE
    assert [f.fail(message, seq) for message, seq in calls] == returned
    assert f.failed()
    assert f.reason() == reason
    assert f.fail_seq() == turn
    assert f.refusal() == f"{reason} (this process group failed earlier and cannot be used)"


# -------------------------------------------------------- the failed turn onward


@pytest.mark.parametrize(
    ("fail_from", "fails", "runs"),
    [
        (None, [], [0, 1, 1000, NONE - 1]),  # healthy: nothing fails
        (0, [0, 1, 1000], []),  # a lost peer: everything
        (3, [3, 4, 1000], [0, 1, 2]),  # a refused call: its turn onward, earlier turns run
    ],
)
def test_operations_from_the_failed_turn_on_fail_and_earlier_ones_run(
    fail_from: int | None, fails: list[int], runs: list[int]
) -> None:
    f = _failure()
    if fail_from is not None:
        f.fail("refused", fail_from)
    assert [s for s in fails + runs if f.fails(s)] == fails


# ------------------------------------------------ aborts held until connected


def test_an_abort_before_connecting_is_held_until_connected() -> None:
    f = _failure()
    f.fail("refused on rank 3", 4)
    assert f.abort_due(stopping=False) is None  # held: a peer not reached yet would miss it
    assert f.connected() == ("refused on rank 3", 4)
    assert f.connected() is None  # handed over once


def test_a_held_abort_carries_the_widest_failed_turn() -> None:
    f = _failure()
    f.fail("refused on rank 3", 4)
    assert f.abort_due(stopping=False) is None
    f.fail("lost rank 1", 0)
    assert f.abort_due(stopping=False) is None
    assert f.connected() == ("refused on rank 3", 0)


@pytest.mark.parametrize(
    ("connected_first", "stopping", "due", "on_connect"),
    [
        (True, False, ("why", 2), None),  # connected: due at once, nothing held
        (True, True, None, None),  # stopping: the close tells the peers
        (False, True, None, None),  # stopping before connecting: nothing held either
        (False, False, None, ("why", 2)),  # held, handed over on connecting
    ],
)
def test_when_an_abort_is_due(
    connected_first: bool,
    stopping: bool,
    due: tuple[str, int] | None,
    on_connect: tuple[str, int] | None,
) -> None:
    f = _failure()
    if connected_first:
        assert f.connected() is None  # nothing failed yet: nothing held
    f.fail("why", 2)
    assert f.abort_due(stopping=stopping) == due
    assert f.connected() == on_connect


# --------------------------------------------------------------- a lost peer


def test_a_lost_peer_an_operation_needs_fails_the_group_at_once() -> None:
    f = _failure()
    assert f.peer_lost("rank 2 closed", needed=True) == "rank 2 closed"
    assert f.departed() is None  # the caller fails the group with it now


def test_a_lost_peer_nothing_needs_fails_only_the_next_operation() -> None:
    f = _failure()
    assert f.peer_lost("rank 2 left", needed=False) is None
    assert not f.failed()  # nothing in flight waited on it
    assert f.departed() == "rank 2 left"
    assert f.peer_lost("rank 1 left", needed=False) is None
    assert f.departed() == "rank 2 left"  # the first one stays the reason
    assert f.peer_lost("rank 1 closed", needed=True) == "rank 1 closed"


# ---------------------------------------------- the aborts' grace and the close

GRACE = 2000


def test_the_grace_is_the_documented_two_seconds() -> None:
    assert native_module.load().GroupFailure.ABORT_GRACE_MS == GRACE


@pytest.mark.parametrize(
    ("peers", "left", "at", "may_close"),
    [
        ((), (), 0, True),  # no abort out: close at once
        ((1, 2, 3), (), 100, False),  # aborts not out, within the grace
        ((1, 2, 3), (1, 2), 100, False),  # rank 3 has none yet
        ((1, 2, 3), (1, 2, 3), 100, True),  # every peer has one
        ((1, 2, 3), (1, 1, 2, 2), 100, False),  # both tracks of two peers: not the third
        ((1, 2, 3), (), 100 + GRACE, False),  # exactly the grace: not yet
        (
            (1, 2, 3),
            (),
            101 + GRACE,
            True,
        ),  # past the grace: a peer that reads none is not waited for
    ],
)
def test_the_connections_close_once_every_peer_has_an_abort_or_the_grace_is_over(
    peers: tuple[int, ...], left: tuple[int, ...], at: int, may_close: bool
) -> None:
    """One abort per peer is enough (chaos seed 74: a rail writer held at one peer's
    parked reduce track held both peers' reduce-track aborts, and the close, for the
    whole grace, though their gather-track aborts had left in 2 ms)."""
    f = _failure()
    f.fail("why", 0)
    if peers:
        round_ = f.aborts_queued(list(peers), at_ms=100)
        for peer in left:
            f.abort_left(peer, round_)
    assert f.may_close(at_ms=at) is may_close


def test_an_earlier_rounds_abort_does_not_tell_a_peer_the_later_one() -> None:
    f = _failure()
    f.fail("why", 5)
    first = f.aborts_queued([1], at_ms=100)
    f.fail("why", 2)  # an earlier turn fails too: a second round of aborts
    second = f.aborts_queued([1], at_ms=110)
    f.abort_left(1, first)
    assert not f.may_close(at_ms=120)
    f.abort_left(1, second)
    assert f.may_close(at_ms=120)


def test_a_shutdown_waits_for_the_aborts_until_the_grace_ends() -> None:
    f = _failure()
    assert f.aborts_deadline(at_ms=50) == 50  # nothing out: no wait
    round_ = f.aborts_queued([1, 2], at_ms=100)
    assert f.aborts_deadline(at_ms=150) == 100 + GRACE
    f.abort_left(1, round_)
    assert f.aborts_deadline(at_ms=150) == 100 + GRACE
    f.abort_left(2, round_)
    assert f.aborts_deadline(at_ms=150) == 150


def test_a_forwarded_reason_says_who_reported_it() -> None:
    got = native_module.load().GroupFailure.forwarded("rank 3 died", "rank 0", "rank 1")
    assert got == "rank 3 died (reported to rank 0 by rank 1)"
