"""The verdict on one chaos job (scripts/chaos.py): what every rank reported
(tests/chaos_rank.py), held to the failure rules of docs/design.md ("Failure") and the
README's bounds. Pure: outcomes in, problems and figures out, so that the rules
themselves are tested on made-up outcomes (tests/test_chaos.py).

The rules, by fault (absolute bounds: Gloo's time in the same job is reported beside,
never a bound):

- none, a delay (fired or not), a slow rank, a partition that heals before the timeout,
  the death of the store's host, a cut that never fired: every call exact on every rank.
- a bad call on rank b at call k: every call before k exact on every rank; call k and
  every later call of the engine raise on every rank naming rank b, within TOLD_S of
  the last rank's call k; broadcasts (Gloo's) complete.
- a kill of rank v at call k, or v leaving there (SIGTERM, handled or not; its program
  ending early): on every survivor each call is exact or raises naming v (a call on
  Gloo's ring may carry Gloo's error, which names an address); calls after k raise (but
  a broadcast, Gloo's, which a live root may still bring to a rank); every call of
  fairring's that raises does so within KILL_S of the later of the fault and its own
  posting (each raise, not only the first). v ends as its fault ends a process: -SIGKILL,
  -SIGTERM, SystemExit (exit status 1) or a clean return; a machine-mate by SIGKILL
  after its stamp, not before.
- a kill of rank v while its group starts: every survivor's group creation or calls
  raise naming v, within the group's timeout and FREEZE_SLACK_S of the later of the
  kill and its start; something raises on each survivor where the kill fell before its
  group was ready.
- a freeze of rank v at call k: every survivor raises "timed out" naming v, not before
  the group's timeout has run out for the earliest call in flight and within
  FREEZE_SLACK_S after it has for the calls at k.
- a cut (the connection from rank p breaks under a body rank c reads): each call exact
  or raising, naming c and p on c and p, either elsewhere, within TOLD_S of the later of
  the fault point's firing and its posting; no call completes after an earlier one of
  its rank raised; rank c raises.
- a call rank s skips at k: calls before k exact; from k on each call completes (its
  values unchecked: the calls pair in the ranks' own orders) or raises naming s within
  the group's timeout and FREEZE_SLACK_S of its posting.
- always: no survivor hangs or crashes; destroying the group takes at most
  DESTROY_FAST_S (nothing waits), or DESTROY_BOUND_S with a frozen peer; no thread,
  socket or listening port of the group's is left once the group object is gone, and
  the group object itself goes (where Gloo may still run a call for nobody, the rank
  waits up to Gloo's timeout for them first); DDP's set-up steps are exact; a fault
  point armed to close or to hold an abort fired; where ranks died or left, the
  survivors' new group is exact and destroyed fast; allreduce results are the same
  bytes on every rank.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import signal
from collections.abc import Callable
from typing import Any

from chaos_plan import MATE_AFTER_S, Job

# A killed peer's connections close at its death: each survivor's calls that need it
# raise within this, on a 2-core machine running the job's 4-6 ranks beside Gloo's.
KILL_S = 1.0
# A bad call or a cut: every rank is told (the reason travels ahead of the close); the
# group's timeout plays no part.
TOLD_S = 1.0
FREEZE_SLACK_S = 1.0  # the watchdog looks every 100 ms
DESTROY_FAST_S = 1.0  # where nothing waits: a regression that sits out a 2 s grace fails
DESTROY_BOUND_S = 4.0  # README: whatever the peers do
EARLY_S = 0.1
DELEGATED = ("broadcast",)


@dataclasses.dataclass
class Verdict:
    problems: list[str]
    outcome: str  # what happened, for the summary
    raise_s: float | None = None  # the worst time to raise (by the fault's measure)
    gloo_raise_s: float | None = None
    destroy_s: float = 0.0


def _names(message: str | None, ranks: set[int]) -> bool:
    return message is not None and any(re.search(rf"\brank {r}\b", message) for r in ranks)


def _ring(job: Job, call_index: int) -> bool:
    """Whether fairring hands this call to Gloo's ring (one rank per machine, 1 MiB and
    more, FAIRRING_CPU_ALLREDUCE=auto)."""
    call = job.calls[call_index]
    env = dict(job.env)
    sizes = {"float64": 8, "int64": 8, "float32": 4, "int32": 4}
    big = call.numel * sizes.get(call.dtype, 2) >= 1 << 20
    return (
        call.kind == "allreduce"
        and job.shape == "3x1"
        and env["FAIRRING_CPU_ALLREDUCE"] == "auto"
        and big
    )


def _fairring(value: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(
        (r for r in value.get("records", []) if r["group"] == "fairring"),
        key=lambda r: r["index"],
    )


def _first_raise(records: list[dict[str, Any]]) -> float | None:
    times = [r["ended_at"] for r in records if r["error"] is not None]
    return min(times) if times else None


def _delegated(job: Job, record: dict[str, Any]) -> bool:
    return job.calls[record["index"]].kind in DELEGATED


def _what(job: Job, record: dict[str, Any]) -> str:
    return job.calls[record["index"]].describe()


def judge(job: Job, outcomes: list[Any], files: dict[str, float]) -> Verdict:
    """``outcomes``: the launcher's RankOutcome per rank; ``files``: kill_at /
    freeze_at, where the fault wrote them."""
    fault = job.fault
    problems: list[str] = []
    dead = job.dead()
    for o in outcomes:
        if o.rank in dead:
            problems += _died_as_planned(job, o, files)
        elif not o.ok:
            head = o.describe().splitlines()
            problems.append(" | ".join(head[:2]) if head else f"rank {o.rank}: {o.status}")
    survivors = {o.rank: o.value for o in outcomes if o.rank not in dead and o.ok}
    if len(survivors) < job.world - len(dead):
        return Verdict(problems, "FAILED")
    ran = {rank: v for rank, v in survivors.items() if "destroy_s" in v}
    destroy = max((v["destroy_s"] for v in ran.values()), default=0.0)
    destroy_bound = DESTROY_BOUND_S if fault.kind == "freeze" else DESTROY_FAST_S
    for rank, v in survivors.items():
        problems += _regrouped(rank, v)
        if "start_error" in v and fault.kind != "start_kill":
            problems.append(f"rank {rank}: the group's start raised: {v['start_error']['error']}")
        if rank not in ran:
            continue
        problems += [f"rank {rank}: DDP set-up: {e}" for e in v.get("setup_errors", [])]
        if v["destroy_s"] > destroy_bound:
            problems.append(
                f"rank {rank}: destroy took {v['destroy_s']:.2f} s (bound {destroy_bound} s)"
            )
        problems += _left_behind(rank, v)
    rules = {
        "kill": _killed,
        "leave": _left,
        "start_kill": _start_killed,
        "freeze": _frozen,
        "cut": _cut,
        "bad_call": _bad_call,
        "skip": _skipped,
    }
    fired = survivors.get(fault.rank, {}).get("fired", {}).get(fault.point, 0) if fault.point else 0
    if fault.kind in rules and not (fault.kind == "cut" and not fired):
        verdict = rules[fault.kind](job, survivors, files, problems)
    else:
        verdict = _clean(job, survivors, problems)
        if fault.kind == "cut":
            verdict.outcome = "cut never fired: exact"
        elif fault.kind == "delay":
            verdict.outcome = (
                f"delay fired x{fired}: exact" if fired else "delay never fired: exact"
            )
        elif fault.kind == "slow":
            verdict.outcome = "waited for the slow rank: exact"
        elif fault.kind == "partition":
            verdict.outcome = "partition healed: exact" if fired else "partition never met: exact"
        elif fault.kind == "store_death":
            # Nothing a started group runs needs the store; only its long-wait notes,
            # which are best effort, would.
            verdict.outcome = "the store's host died: exact"
            if "store_dead_at" not in files:
                verdict = _no_time(fault.rank, "the store's death", verdict.problems)
    verdict.problems += _not_bit_identical(job, survivors)
    verdict.destroy_s = destroy
    if verdict.problems and not verdict.outcome.startswith("FAILED"):
        verdict.outcome = "FAILED"
    return verdict


def _not_bit_identical(job: Job, survivors: dict[int, Any]) -> list[str]:
    """An allreduce that completed on several ranks gave each the same bytes."""
    digests: dict[int, dict[int, int]] = {}
    for rank, v in survivors.items():
        for r in _fairring(v):
            if r.get("digest") is not None:
                digests.setdefault(r["index"], {})[rank] = r["digest"]
    return [
        f"{job.calls[index].describe()}: the ranks' results differ in their bytes: {by_rank}"
        for index, by_rank in sorted(digests.items())
        if len(set(by_rank.values())) > 1
    ]


def _died_as_planned(job: Job, o: Any, files: dict[str, float]) -> list[str]:
    """A dead rank died of the fault's SIGKILL (the victim's own, a frozen rank's from
    the harness, a mate's once it stamped its death), not of a crash of its own; a
    leaving rank as its way of leaving ends a process."""
    if job.fault.kind == "leave":
        return _left_as_planned(job, o)
    if o.status != "crashed":
        return [f"rank {o.rank} should have died, but: {o.status}"]
    if o.exitcode != -signal.SIGKILL:
        return [f"rank {o.rank} died of exit status {o.exitcode}, not the fault's SIGKILL"]
    if job.fault.kind == "kill" and o.rank != job.fault.rank:
        mate_at, killed_at = files.get(f"mate_at_{o.rank}"), files.get("kill_at")
        if mate_at is None or killed_at is None or mate_at < killed_at + MATE_AFTER_S - EARLY_S:
            return [f"rank {o.rank}, the dead rank's machine-mate, died before its time"]
    return []


def _left_as_planned(job: Job, o: Any) -> list[str]:
    how = job.fault.how
    if how == "sigterm":
        ok = o.status == "crashed" and o.exitcode == -signal.SIGTERM
    elif how == "sigterm_handled":
        ok = o.status == "error" and o.error_type == "SystemExit" and o.exitcode == 1
    else:
        ok = o.status == "ok" and o.value == {"left": True} and o.exitcode == 0
    return [] if ok else [f"rank {o.rank} should have left by {how}, but: {o.describe()}"]


def _regrouped(rank: int, v: dict[str, Any]) -> list[str]:
    """The survivors' new group (tests/chaos_rank.py, _regroup) worked and went."""
    new = v.get("regroup")
    if new is None:
        return []
    if new["error"] is not None:
        return [f"rank {rank}: the survivors' new group failed: {new['error']}"]
    out = [f"rank {rank}: {new['check']}"] if new["check"] is not None else []
    if new["destroy_s"] > DESTROY_FAST_S:
        took = new["destroy_s"]
        out.append(f"rank {rank}: destroying the survivors' new group took {took:.2f} s")
    return out


def _fairring_threads(resources: dict[str, Any]) -> int:
    return sum(t.startswith("fairring") for t in resources["threads"])


def _left_behind(rank: int, v: dict[str, Any]) -> list[str]:
    before, after = v["before"], v["after"]
    if _fairring_threads(after) > _fairring_threads(before):
        return [f"rank {rank}: fairring threads left: {before['threads']} -> {after['threads']}"]
    if not v.get("group_freed", True):
        held = v.get("group_held_by", [])
        return [f"rank {rank}: the group object outlived its destroy, held by {held}"]
    out = []
    if len(after["threads"]) > len(before["threads"]):
        extra = collections.Counter(after["threads"]) - collections.Counter(before["threads"])
        out.append(f"rank {rank}: threads left: {dict(extra)} (of {after['threads']})")
    if ports := sorted(set(after["listening"]) - set(before["listening"])):
        out.append(f"rank {rank}: ports left listening: {ports}")
    if left := set(after["sockets"]) - set(before["sockets"]):
        out.append(f"rank {rank}: {len(left)} sockets left (of {len(after['sockets'])})")
    return out


def _clean(job: Job, survivors: dict[int, Any], problems: list[str]) -> Verdict:
    for rank, v in survivors.items():
        for r in _fairring(v):
            if r["error"] is not None:
                problems.append(f"rank {rank}: {_what(job, r)} raised: {r['error']}")
            elif r["check"] is not None:
                problems.append(f"rank {rank}: {r['check']}")
    return Verdict(problems, "exact")


def _exact_or(rank: int, job: Job, r: dict[str, Any], ok_error: Any, problems: list[str]) -> None:
    if r["error"] is None:
        if r["check"] is not None:
            problems.append(f"rank {rank}: {r['check']}")
    elif not ok_error(r):
        problems.append(
            f"rank {rank}: {_what(job, r)} raised without naming the fault: {r['error']}"
        )


def _bad_call(
    job: Job, survivors: dict[int, Any], files: dict[str, float], problems: list[str]
) -> Verdict:
    fault = job.fault
    k = fault.turn
    last_post = max(
        r["posted_at"] for v in survivors.values() for r in _fairring(v) if r["index"] == k
    )
    worst = 0.0
    for rank, v in survivors.items():
        for r in _fairring(v):
            # A delegated collective takes its turn too (src/cpu/gloo_calls.h).
            if r["index"] < k:
                _exact_or(rank, job, r, lambda _: False, problems)
                continue
            if r.get("after_ddp_failure") and r["error"] is not None:
                continue  # DDP itself refuses a step after a failed one
            if not _names(r["error"], {fault.rank}):
                problems.append(
                    f"rank {rank}: {_what(job, r)} at or after the bad call did not raise naming "
                    f"rank {fault.rank}: {r['error'] or 'it completed'}"
                )
                continue
            took = _raised_within(
                rank, job, r, last_post, TOLD_S, "it was posted everywhere", problems
            )
            worst = max(worst, took)
    holder = (fault.rank + 1) % job.world
    if fault.held_abort_ms and survivors[holder]["fired"].get("mesh.send.first", 0) == 0:
        problems.append(
            f"rank {holder}: mesh.send.first was armed to hold its aborts but never fired"
        )
    return Verdict(problems, "raised naming the bad call", raise_s=worst)


def _raised_within(
    rank: int,
    job: Job,
    r: dict[str, Any],
    since: float,
    bound: float,
    after: str,
    problems: list[str],
) -> float:
    """Seconds from the later of ``since`` and the call's posting to its raise; a problem
    past ``bound``."""
    took = r["ended_at"] - max(since, r["posted_at"])
    if took > bound:
        problems.append(
            f"rank {rank}: {_what(job, r)} raised {took:.3f} s after {after} (bound {bound} s)"
        )
    return took


def _no_time(rank: int, event: str, problems: list[str]) -> Verdict:
    problems.append(f"rank {rank} left no time of {event}")
    return Verdict(problems, "FAILED")


def _naming_the_faults_rank(job: Job) -> Callable[[dict[str, Any]], bool]:
    """Whether a failed call's error names the fault's rank (or is another's error)."""

    def named(r: dict[str, Any]) -> bool:
        return _not_fairrings_error(job, r) or _names(r["error"], {job.fault.rank})

    return named


def _not_fairrings_error(job: Job, r: dict[str, Any]) -> bool:
    """Whether a failed call's error is another's: Gloo's own (a delegated collective's,
    naming an address; or an allreduce on Gloo's ring), or DDP's refusal after a failure."""
    if job.calls[r["index"]].kind in DELEGATED or r.get("after_ddp_failure"):
        return True
    return bool(_ring(job, r["index"]) and "on Gloo's ring" in r["error"])


def _completed_after(
    rank: int, job: Job, r: dict[str, Any], first: int, fault: str, problems: list[str]
) -> None:
    """A problem where call ``r``, from index ``first`` on, completed despite the fault."""
    # A broadcast is Gloo's: from a root that lives it may still reach this rank.
    if r["index"] >= first and r["error"] is None and not _delegated(job, r):
        problems.append(f"rank {rank}: {_what(job, r)}, {fault}, completed")


def _first_unmet(job: Job) -> int:
    """The first call a killed (or leaving) rank never took part in: its turn's, where
    that call is synchronous (a barrier, a DDP step: it dies before posting it)."""
    turn = job.fault.turn
    return turn if job.calls[turn].kind in ("barrier", "ddp") else turn + 1


def _killed(
    job: Job, survivors: dict[int, Any], files: dict[str, float], problems: list[str]
) -> Verdict:
    fault = job.fault
    if "kill_at" not in files:
        return _no_time(fault.rank, "death", problems)
    killed_at = files["kill_at"]
    gloo_times = []
    for v in survivors.values():
        # Gloo raises only where a later call of its needs the dead rank (a broadcast
        # from a live root, an empty reduce-scatter do not): no yardstick there.
        first = _first_raise([r for r in v["records"] if r["group"] == "gloo"])
        if first is not None:
            gloo_times.append(first - killed_at)
    gloo_worst = max(gloo_times) if gloo_times else None
    worst = 0.0

    named = _naming_the_faults_rank(job)
    for rank, v in survivors.items():
        for r in _fairring(v):
            _completed_after(
                rank, job, r, _first_unmet(job), f"after rank {fault.rank} died", problems
            )
            _exact_or(rank, job, r, named, problems)
            if r["error"] is None or _delegated(job, r):
                continue  # a broadcast's time is Gloo's
            if r["ended_at"] < killed_at - EARLY_S:
                problems.append(
                    f"rank {rank}: {_what(job, r)} raised before the kill: {r['error']}"
                )
                continue
            gloo = "none" if gloo_worst is None else f"{gloo_worst:.3f} s"
            after = f"the kill or its posting, whichever was later (Gloo's slowest: {gloo})"
            worst = max(worst, _raised_within(rank, job, r, killed_at, KILL_S, after, problems))
    return Verdict(
        problems, "raised naming the killed rank", raise_s=worst, gloo_raise_s=gloo_worst
    )


def _frozen(
    job: Job, survivors: dict[int, Any], files: dict[str, float], problems: list[str]
) -> Verdict:
    fault = job.fault
    if "freeze_at" not in files:
        return _no_time(fault.rank, "freezing", problems)
    frozen_at = files["freeze_at"]
    timeout = job.group_timeout_s
    errored = [r for v in survivors.values() for r in _fairring(v) if r["error"] is not None]
    earliest = min((r["posted_at"] for r in errored), default=frozen_at)
    worst = 0.0
    gloo_times = []

    def named(r: dict[str, Any]) -> bool:
        if _not_fairrings_error(job, r):
            return True
        return "timed out" in r["error"] and _names(r["error"], {fault.rank})

    for rank, v in survivors.items():
        records = _fairring(v)
        for r in records:
            _completed_after(rank, job, r, fault.turn, f"with rank {fault.rank} frozen", problems)
            _exact_or(rank, job, r, named, problems)
            if r["error"] is not None and not _delegated(job, r):
                after = "the freeze or its posting, whichever was later"
                bound = timeout + FREEZE_SLACK_S
                _raised_within(rank, job, r, frozen_at, bound, after, problems)
        first = _first_raise(records)
        if first is not None:
            worst = max(worst, first - frozen_at)
            if first < earliest + timeout - EARLY_S:
                problems.append(
                    f"rank {rank}: raised {first - earliest:.2f} s after its call, before the "
                    "timeout"
                )
            if first > frozen_at + timeout + FREEZE_SLACK_S:
                problems.append(
                    f"rank {rank}: raised {first - frozen_at:.2f} s after the freeze "
                    f"(timeout {timeout} s)"
                )
        gloo_first = _first_raise([r for r in v["records"] if r["group"] == "gloo"])
        if gloo_first is not None:
            gloo_times.append(gloo_first - frozen_at)
    return Verdict(
        problems,
        "timed out naming the frozen rank",
        raise_s=worst,
        gloo_raise_s=max(gloo_times) if gloo_times else None,
    )


def _cut(
    job: Job, survivors: dict[int, Any], files: dict[str, float], problems: list[str]
) -> Verdict:
    """The connection from rank p breaks under a body rank c reads (at the fault point's
    last use on c): each call exact or raising, its error naming both ends on c and p
    and either elsewhere; every call of fairring's that raises does so within TOLD_S of
    the later of the cut and its posting; no call completes that was posted after an
    earlier one of its rank raised; rank c raises."""
    fault = job.fault
    culprits = {fault.rank, fault.peer}
    cut_at = survivors[fault.rank]["fired_at"].get(fault.point, 0.0)
    if not cut_at:
        return _no_time(fault.rank, "the cut", problems)
    worst = 0.0
    for rank, v in survivors.items():
        ends = culprits if rank in culprits else set()

        def named(r: dict[str, Any], ends: set[int] = ends) -> bool:
            if _not_fairrings_error(job, r):
                return True
            if ends:
                return all(_names(r["error"], {end}) for end in ends)
            return _names(r["error"], culprits)

        records = [r for r in _fairring(v) if not _delegated(job, r)]
        first = _first_raise(records)
        for r in records:
            _exact_or(rank, job, r, named, problems)
            # Once this rank knew (its first error), every call it posted raises.
            if first is not None and r["error"] is None and r["posted_at"] > first:
                problems.append(
                    f"rank {rank}: {_what(job, r)} completed, posted after an earlier call raised"
                )
            if r["error"] is not None:
                if r["ended_at"] < cut_at - EARLY_S:
                    problems.append(f"rank {rank}: {_what(job, r)} raised before the cut")
                    continue
                after = "the cut or its posting, whichever was later"
                took = _raised_within(rank, job, r, cut_at, TOLD_S, after, problems)
                worst = max(worst, took)
        if rank == fault.rank and first is None:
            problems.append(
                f"rank {rank}: its connection from rank {fault.peer} broke, yet it raised nothing"
            )
    return Verdict(problems, "raised naming the cut", raise_s=worst)


def _start_killed(
    job: Job, survivors: dict[int, Any], files: dict[str, float], problems: list[str]
) -> Verdict:
    """Rank v killed while the group starts: every survivor's group creation or calls
    raise naming v, each within the group's timeout (and FREEZE_SLACK_S) of the later of
    the kill and its start: a rank that never connected is told by nothing sooner."""
    fault = job.fault
    if "kill_at" not in files:
        return _no_time(fault.rank, "death", problems)
    killed_at = files["kill_at"]
    bound = job.group_timeout_s + FREEZE_SLACK_S
    worst = 0.0

    named = _naming_the_faults_rank(job)
    for rank, v in survivors.items():
        records = [v["start_error"]] if "start_error" in v else _fairring(v)
        if "start_error" in v and not _names(v["start_error"]["error"], {fault.rank}):
            problems.append(
                f"rank {rank}: {v['start_error'].get('what', 'creating the group')} raised "
                f"without naming rank {fault.rank}: "
                f"{v['start_error']['error']}"
            )
        during_start = "start_s" not in v or killed_at < v["start_s"][1]
        if during_start and not any(r["error"] is not None for r in records):
            problems.append(
                f"rank {rank}: nothing raised, though rank {fault.rank} died while it started"
            )
        for r in records:
            if "index" in r:
                _exact_or(rank, job, r, named, problems)
            if r["error"] is not None:
                took = r["ended_at"] - max(killed_at, r["posted_at"])
                worst = max(worst, took)
                if took > bound:
                    what = _what(job, r) if "index" in r else r.get("what", "creating the group")
                    problems.append(
                        f"rank {rank}: {what} raised {took:.3f} s after the kill (bound {bound} s)"
                    )
    return Verdict(problems, "raised naming the rank killed at start-up", raise_s=worst)


def _skipped(
    job: Job, survivors: dict[int, Any], files: dict[str, float], problems: list[str]
) -> Verdict:
    """Rank s skipped call k: calls before k exact; from k on, each call of each rank
    completes (with values nobody can check: the calls pair in the ranks' orders) or
    raises naming s or the difference, within the group's timeout (and FREEZE_SLACK_S)
    of its posting; no rank hangs."""
    fault = job.fault
    bound = job.group_timeout_s + FREEZE_SLACK_S
    worst = 0.0

    named = _naming_the_faults_rank(job)
    for rank, v in survivors.items():
        for r in _fairring(v):
            if r["index"] < fault.turn:
                _exact_or(rank, job, r, lambda _: False, problems)
                continue
            if r["error"] is None:
                continue
            if not named(r):
                problems.append(
                    f"rank {rank}: {_what(job, r)} raised without naming rank {fault.rank}: "
                    f"{r['error']}"
                )
            took = _raised_within(rank, job, r, r["posted_at"], bound, "its posting", problems)
            worst = max(worst, took)
    return Verdict(problems, "raised or completed after the skipped call", raise_s=worst)


def _left(
    job: Job, survivors: dict[int, Any], files: dict[str, float], problems: list[str]
) -> Verdict:
    """A rank that leaves (SIGTERM, handled or not, or its program ending early) is held
    to a kill's rules: its peers learn of it from its closes, or its aborts."""
    verdict = _killed(job, survivors, files, problems)
    if verdict.outcome != "FAILED":
        verdict.outcome = f"raised naming the rank that left ({job.fault.how})"
    return verdict
