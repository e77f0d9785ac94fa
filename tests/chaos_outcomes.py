"""Made-up outcomes of chaos jobs (tests/test_chaos.py): for each fault, the ranks'
records as a job that keeps the rules would leave them, and BREAKS, each the same
outcomes with one thing wrong and the words the verdict must say about it."""

from __future__ import annotations

import copy
import dataclasses
import signal
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from chaos_plan import MATE_AFTER_S, Call, Fault, Job, machines_of
from chaos_verdict import DESTROY_FAST_S, KILL_S, TOLD_S

T0 = 1_000_000.0
CALLS = (
    Call(0, "allreduce", 10),
    Call(1, "allreduce", 10),
    Call(2, "broadcast", 10),
    Call(3, "allreduce", 10),
    Call(4, "allreduce", 10),
)
RESOURCES = {"threads": ["fairring-watch", "python"], "sockets": [11, 12], "listening": []}


def _job(fault: Fault, timeout_s: float = 30.0) -> Job:
    return Job(
        seed=0,
        shape="2x2",
        machines=machines_of("2x2"),
        calls=CALLS,
        fault=fault,
        env=(("FAIRRING_CPU_ALLREDUCE", "auto"),),
        group_timeout_s=timeout_s,
        mirror_gloo=fault.kind in ("kill", "freeze"),
    )


def _record(
    index: int, group: str = "fairring", error: str | None = None, at: float = 0.0
) -> dict[str, Any]:
    return {
        "index": index,
        "group": group,
        "posted_at": T0 + index * 0.001,
        "ended_at": T0 + at,
        "done": error is None,
        "error": error,
        "check": None,
    }


def _value(
    records: list[dict[str, Any]],
    fired: dict[str, int] | None = None,
    fired_at: dict[str, float] | None = None,
) -> dict[str, Any]:
    return {
        "records": records,
        "setup_errors": [],
        "destroy_s": 0.01,
        "before": copy.deepcopy(RESOURCES),
        "after": copy.deepcopy(RESOURCES),
        "fired": fired or {},
        "fired_at": fired_at or {},
        "ring_abandoned": 0,
        "start_s": (T0 - 1.0, T0 - 0.5),
    }


def _outcome(rank: int, value: dict[str, Any] | None, status: str = "ok") -> SimpleNamespace:
    return SimpleNamespace(
        rank=rank,
        status=status,
        ok=status == "ok",
        value=value,
        exitcode=-signal.SIGKILL if status == "crashed" else 0,
        describe=lambda: f"rank {rank}: {status}",
    )


def clean_job() -> tuple[Job, list[Any], dict[str, float]]:
    records = [_record(c.index, at=0.01) for c in CALLS]
    return _job(Fault()), [_outcome(r, _value(copy.deepcopy(records))) for r in range(4)], {}


def _bad_call() -> tuple[Job, list[Any], dict[str, float]]:
    """Rank 2 gets call 1 wrong: call 0 completes; 1, 2 (a broadcast, which takes its
    turn too), 3 and 4 raise."""
    why = "fairring: allreduce #1 differs between ranks: rank 2 (host m1) has 11 elements"
    outcomes = []
    for rank in range(4):
        records = [
            _record(0, at=0.01),
            _record(1, error=why, at=0.05),
            _record(2, error=why, at=0.06),
            _record(3, error=why, at=0.06),
            _record(4, error=why, at=0.06),
        ]
        outcomes.append(_outcome(rank, _value(records)))
    return _job(Fault("bad_call", rank=2, turn=1, variant="size")), outcomes, {}


def killed_job() -> tuple[Job, list[Any], dict[str, float]]:
    """Rank 3 dies at call 1; its mate, rank 2, 0.15 s later; ranks 0 and 1 raise."""
    why = "fairring: receiving from rank 3 (host m1) failed on rank 0 (host m0): closed"
    outcomes = [_outcome(2, None, "crashed"), _outcome(3, None, "crashed")]
    for rank in (0, 1):
        records = [_record(0, at=0.01)]
        records += [_record(i, error=why, at=0.05) for i in (1, 3, 4)]
        records += [_record(2, error="Connection closed by peer [127.0.0.1]:1234", at=0.05)]
        records += [
            _record(i, "gloo", error="Connection closed by peer", at=0.06) for i in range(5)
        ]
        outcomes.append(_outcome(rank, _value(records)))
    job = _job(Fault("kill", rank=3, turn=1, mates_die=True))
    files = {"kill_at": T0 + 0.02, "mate_at_2": T0 + 0.02 + MATE_AFTER_S}
    return job, sorted(outcomes, key=lambda o: o.rank), files


def _frozen() -> tuple[Job, list[Any], dict[str, float]]:
    """Rank 1 stops at call 1 (group timeout 3 s); the others time out naming it."""
    why = "fairring: allreduce #1 timed out after 3000 ms on rank 0: waiting for rank 1's collect"
    outcomes = [_outcome(1, None, "crashed")]
    for rank in (0, 2, 3):
        records = [_record(0, at=0.01)]
        records += [_record(i, error=why, at=3.1) for i in (1, 3, 4)]
        records += [_record(2, error="Timed out", at=3.1)]
        records += [_record(i, "gloo", error="Timed out", at=3.05) for i in range(5)]
        outcomes.append(_outcome(rank, _value(records)))
    job = _job(Fault("freeze", rank=1, turn=1), timeout_s=3.0)
    return job, sorted(outcomes, key=lambda o: o.rank), {"freeze_at": T0 + 0.02}


def _cut() -> tuple[Job, list[Any], dict[str, float]]:
    """The connection from rank 2 breaks under a body rank 0 reads, in call 3."""
    why = (
        "fairring: receiving from rank 2 (host m1) failed on rank 0 (host m0): the connection broke"
    )
    outcomes = []
    for rank in range(4):
        records = [_record(i, at=0.01) for i in range(3)]
        records += [_record(i, error=why, at=0.05 + rank * 0.001) for i in (3, 4)]
        fired, fired_at = (
            ({"mesh.read.close": 1}, {"mesh.read.close": T0 + 0.04}) if rank == 0 else ({}, {})
        )
        outcomes.append(_outcome(rank, _value(records, fired, fired_at)))
    return _job(Fault("cut", rank=0, turn=2, point="mesh.read.close", peer=2)), outcomes, {}


def _left(how: str) -> Callable[[], tuple[Job, list[Any], dict[str, float]]]:
    """Rank 3 leaves at call 1 (SIGTERM, handled or not, or its program's early end)."""

    def scenario() -> tuple[Job, list[Any], dict[str, float]]:
        job, outcomes, files = killed_job()
        job = dataclasses.replace(job, fault=Fault("leave", rank=3, turn=1, how=how))
        left = {
            "sigterm": _outcome(3, None, "crashed"),
            "sigterm_handled": _outcome(3, None, "error"),
            "exit": _outcome(3, {"left": True}),
        }[how]
        if how == "sigterm":
            left.exitcode = -signal.SIGTERM
        if how == "sigterm_handled":
            left.exitcode, left.error_type = 1, "SystemExit"
        # Rank 2 lives on: a leaving rank's machine-mates stay.
        outcomes[2] = copy.deepcopy(outcomes[0])
        outcomes[2].rank = 2
        outcomes[3] = left
        files.pop("mate_at_2")
        return job, outcomes, files

    return scenario


def _start_killed() -> tuple[Job, list[Any], dict[str, float]]:
    """Rank 1 dies while the group starts: rank 0 cannot create the group, ranks 2 and 3
    created it and raise at their first call, all naming rank 1 after the 3 s timeout."""
    why = "fairring: rank 0 could not connect Gloo's group '1': rank 1 never came to connect it"
    job = dataclasses.replace(_job(Fault("start_kill", rank=1, after_ms=50)), group_timeout_s=3.0)
    outcomes = [_outcome(1, None, "crashed")]
    start_error = {"error": why, "posted_at": T0 - 1.0, "ended_at": T0 + 2.0}
    outcomes.append(_outcome(0, {"start_error": start_error, "ring_abandoned": 0}))
    for rank in (2, 3):
        records = [_record(i, error=f"timed out waiting for rank 1: {i}", at=3.0) for i in range(5)]
        value = _value(records)
        value["start_s"] = (T0 - 1.0, T0 + 0.5)
        outcomes.append(_outcome(rank, value))
    return job, sorted(outcomes, key=lambda o: o.rank), {"kill_at": T0 - 0.95}


def _skipped() -> tuple[Job, list[Any], dict[str, float]]:
    """Rank 2 skips call 1: its call 3 pairs with the others' call 1 (alike: completes
    with values nobody can check), the others' last call raises once rank 2 is gone."""
    why = "fairring: rank 2 (host m1) closed its connection to rank 0 (host m0)"
    outcomes = []
    for rank in range(4):
        indices = [0, 3, 4] if rank == 2 else [0, 1, 3, 4]
        records = [_record(i, at=0.01) for i in indices if i != 4]
        records[-1]["check"] = "wrong values"  # calls paired in the ranks' own orders
        if rank != 2:
            records.append(_record(4, error=why, at=0.5))
        else:
            records.append(_record(4, at=0.02))
        outcomes.append(_outcome(rank, _value(records)))
    job = dataclasses.replace(_job(Fault("skip", rank=2, turn=1)), group_timeout_s=3.0)
    return job, outcomes, {}


SCENARIOS: dict[str, Callable[[], tuple[Job, list[Any], dict[str, float]]]] = {
    "clean": clean_job,
    "bad_call": _bad_call,
    "kill": killed_job,
    "freeze": _frozen,
    "cut": _cut,
    "leave_sigterm": _left("sigterm"),
    "leave_sigterm_handled": _left("sigterm_handled"),
    "leave_exit": _left("exit"),
    "start_kill": _start_killed,
    "skip": _skipped,
}


def record_of(
    outcomes: list[Any], rank: int, index: int, group: str = "fairring"
) -> dict[str, Any]:
    return next(
        r for r in outcomes[rank].value["records"] if r["index"] == index and r["group"] == group
    )


def _set(
    outcomes: list[Any], rank: int, index: int, group: str = "fairring", **fields: Any
) -> None:
    record_of(outcomes, rank, index, group).update(fields)


# (scenario, what goes wrong (changing the outcomes, or returning another job), the words
# the verdict must say)
BREAKS: list[tuple[str, str, Callable[[Job, list[Any], dict[str, float]], Any], str]] = [
    (
        "clean",
        "a wrong result",
        lambda j, o, f: _set(o, 1, 3, check="2 of 10 elements differ"),
        "2 of 10 elements differ",
    ),
    (
        "clean",
        "a call raised",
        lambda j, o, f: _set(o, 0, 2, error="boom", done=False),
        "raised: boom",
    ),
    (
        "clean",
        "a rank hung",
        lambda j, o, f: o.__setitem__(1, _outcome(1, None, "killed")),
        "killed",
    ),
    (
        "clean",
        "destroy sat out a grace",
        lambda j, o, f: o[2].value.__setitem__("destroy_s", DESTROY_FAST_S + 1.0),
        "destroy took",
    ),
    (
        "clean",
        "a fairring thread left",
        lambda j, o, f: o[0].value["after"]["threads"].append("fairring-cb"),
        "threads left",
    ),
    (
        "clean",
        "a port left listening",
        lambda j, o, f: o[0].value["after"]["listening"].append(("127.0.0.1", 4000)),
        "listening",
    ),
    (
        "clean",
        "a socket left",
        lambda j, o, f: o[3].value["after"]["sockets"].append(13),
        "sockets left",
    ),
    (
        "bad_call",
        "an earlier call failed",
        lambda j, o, f: _set(o, 0, 0, error="differs between ranks: rank 2", done=False),
        "allreduce 10 float32 SUM raised",
    ),
    (
        "bad_call",
        "a later call completed",
        lambda j, o, f: _set(o, 1, 4, error=None, done=True),
        "did not raise naming rank 2",
    ),
    (
        "bad_call",
        "a broadcast after it completed (handed to Gloo past a failed turn)",
        lambda j, o, f: _set(o, 2, 2, error=None, done=True),
        "did not raise naming rank 2",
    ),
    (
        "bad_call",
        "the bad rank not named",
        lambda j, o, f: _set(o, 3, 1, error="something failed"),
        "did not raise naming rank 2",
    ),
    (
        "bad_call",
        "told late",
        lambda j, o, f: _set(o, 0, 1, ended_at=T0 + 0.01 + TOLD_S + 0.5),
        "after it was posted",
    ),
    ("bad_call", "a held abort that never fired", lambda j, o, f: _held_abort(j), "never fired"),
    (
        "clean",
        "one rank's bytes differ from the others'",
        lambda j, o, f: [_set(o, r, 3, digest=7 if r == 2 else 5) for r in range(4)],
        "differ in their bytes",
    ),
    (
        "kill",
        "the machine-mate crashed",
        lambda j, o, f: setattr(o[2], "exitcode", -signal.SIGSEGV),
        "not the fault's SIGKILL",
    ),
    (
        "kill",
        "the machine-mate died early (no stamp of its planned death)",
        lambda j, o, f: f.pop("mate_at_2"),
        "died before its time",
    ),
    (
        "kill",
        "raised after the bound",
        lambda j, o, f: errors_at(o, 0, "fairring", T0 + 0.02 + KILL_S + 0.05),
        "after the kill",
    ),
    (
        "kill",
        "a later call raised late, the first in time",
        lambda j, o, f: _set(o, 1, 4, ended_at=T0 + 0.02 + KILL_S + 0.05),
        "allreduce",
    ),
    (
        "kill",
        "a call after the kill completed",
        lambda j, o, f: _set(o, 0, 4, error=None, done=True),
        "completed",
    ),
    (
        "kill",
        "a barrier the dead rank never posted completed",
        lambda j, o, f: (
            _set(o, 0, 1, error=None, done=True),
            dataclasses.replace(j, calls=(CALLS[0], Call(1, "barrier"), *CALLS[2:])),
        )[-1],
        "completed",
    ),
    (
        "kill",
        "the mate named instead",
        lambda j, o, f: _set(o, 1, 3, error="lost rank 2 (host m1)"),
        "without naming the fault",
    ),
    (
        "kill",
        "raised before the kill",
        lambda j, o, f: _set(o, 1, 0, error="rank 3 lost", ended_at=T0 - 1),
        "before the kill",
    ),
    (
        "freeze",
        "raised before the timeout",
        lambda j, o, f: errors_at(o, 2, "fairring", T0 + 1.0),
        "before the timeout",
    ),
    (
        "freeze",
        "raised long after the timeout",
        lambda j, o, f: errors_at(o, 2, "fairring", T0 + 6.0),
        "after the freeze",
    ),
    (
        "freeze",
        "a later call raised late, the first in time",
        lambda j, o, f: _set(o, 0, 4, ended_at=T0 + 0.02 + 3.0 + 1.5),
        "after the freeze or its posting",
    ),
    (
        "freeze",
        "no timeout in the message",
        lambda j, o, f: _set(o, 3, 3, error="rank 1 failed"),
        "without naming the fault",
    ),
    (
        "freeze",
        "no rank named",
        lambda j, o, f: _set(o, 3, 3, error="fairring: allreduce #3 timed out"),
        "without naming the fault",
    ),
    (
        "cut",
        "the cutting rank raised nothing",
        lambda j, o, f: [_set(o, 0, i, error=None, done=True) for i in (3, 4)],
        "raised nothing",
    ),
    (
        "cut",
        "a rank told late",
        lambda j, o, f: errors_at(o, 3, "fairring", T0 + TOLD_S + 1.0),
        "after the cut",
    ),
    (
        "cut",
        "an end names only itself",
        lambda j, o, f: _set(o, 2, 4, error="fairring: sending failed on rank 2 (host m1)"),
        "without naming the fault",
    ),
    (
        "cut",
        "no time of the cut",
        lambda j, o, f: o[0].value["fired_at"].clear(),
        "no time of the cut",
    ),
    (
        "leave_sigterm",
        "the leaving rank crashed instead",
        lambda j, o, f: setattr(o[3], "exitcode", -signal.SIGSEGV),
        "should have left by sigterm",
    ),
    (
        "leave_sigterm_handled",
        "the handled SIGTERM ended in another error",
        lambda j, o, f: setattr(o[3], "error_type", "RuntimeError"),
        "should have left by sigterm_handled",
    ),
    (
        "leave_exit",
        "the early end did not end the program",
        lambda j, o, f: setattr(o[3], "value", {"records": []}),
        "should have left by exit",
    ),
    (
        "leave_exit",
        "a survivor told late",
        lambda j, o, f: errors_at(o, 1, "fairring", T0 + 0.02 + KILL_S + 0.05),
        "after the kill",
    ),
    (
        "start_kill",
        "the group's creation raised without naming the rank",
        lambda j, o, f: o[0].value["start_error"].update(error="wait timeout, keys: /0/1"),
        "without naming rank 1",
    ),
    (
        "start_kill",
        "raised long after the timeout",
        lambda j, o, f: errors_at(o, 2, "fairring", T0 + 5.0),
        "after the kill",
    ),
    (
        "start_kill",
        "nothing raised though the kill fell while the group started",
        lambda j, o, f: [_set(o, 3, i, error=None, done=True) for i in range(5)],
        "nothing raised",
    ),
    (
        "skip",
        "a call before the skipped one failed",
        lambda j, o, f: _set(o, 1, 0, error="boom", done=False),
        "raised without naming the fault: boom",
    ),
    (
        "skip",
        "a raise that does not name the skipping rank",
        lambda j, o, f: _set(o, 0, 4, error="fairring: something failed"),
        "without naming rank 2",
    ),
    (
        "skip",
        "a raise after the timeout",
        lambda j, o, f: _set(o, 0, 4, ended_at=T0 + 5.0),
        "after its posting",
    ),
    (
        "kill",
        "the survivors' new group failed",
        lambda j, o, f: o[0].value.__setitem__(
            "regroup", {"error": "timed out", "check": None, "destroy_s": 0.0}
        ),
        "new group failed",
    ),
    (
        "kill",
        "the survivors' new group gave a wrong sum",
        lambda j, o, f: o[1].value.__setitem__(
            "regroup", {"error": None, "check": "gave [1.0], not 3.0", "destroy_s": 0.0}
        ),
        "not 3.0",
    ),
    (
        "clean",
        "the store's host died and a call raised",
        lambda j, o, f: (
            f.__setitem__("store_dead_at", T0),
            _set(o, 0, 3, error="fairring: the store is gone", done=False),
            dataclasses.replace(j, fault=Fault("store_death", rank=1, turn=2)),
        )[-1],
        "raised: fairring: the store is gone",
    ),
    (
        "clean",
        "the store's host died with no stamp",
        lambda j, o, f: dataclasses.replace(j, fault=Fault("store_death", rank=1, turn=2)),
        "no time of the store's death",
    ),
    (
        "clean",
        "a group that could not start in a job with no start-up fault",
        lambda j, o, f: o[1].value.__setitem__("start_error", {"error": "x", "posted_at": T0}),
        "the group's start raised",
    ),
]


def errors_at(outcomes: list[Any], rank: int, group: str, at: float) -> None:
    """Every error of ``rank`` on ``group`` moved to ``at``."""
    for r in outcomes[rank].value["records"]:
        if r["group"] == group and r["error"] is not None:
            r["ended_at"] = at


def _held_abort(job: Job) -> Job:
    """The same job, rank 3 (the bad rank's next) armed to hold its aborts: none fired."""
    return dataclasses.replace(job, fault=dataclasses.replace(job.fault, held_abort_ms=300))
