"""The measured choice's agreement (src/measured/agreement.h) where something goes wrong,
and where calls of two devices decide from two threads.

- A rank that cannot time its trial calls (the test-only fault point
  ``measured.trial_done`` armed to throw: its timers fail): every rank keeps the
  program's own way for the class, says why, and no call raises.
- A rank that cannot take part in the agreement (``measured.decide`` armed to throw):
  the decision call raises on every rank at once, naming that rank, not at the timeout;
  later calls of the class raise alike, and other sizes still run.
- ``abort()`` while a rank waits in the agreement (its peer held at ``measured.decide``):
  the wait ends at once on that rank, and the peer fails its call when it arrives.
- CPU allreduces (engine or Gloo's ring) from one thread and stream-vehicle allreduces
  (the delegate's or the composition) from another, each rank deciding its two classes
  in another order: every rank decides both alike. The plant ``agreement_by_order``
  (agreements that pair by their order on each rank, as calls on one group pair) splits
  them.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from typing import Any

import fault_points
import stream_mutants
import stream_vehicle
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import fairring_env, run_ranks
from test_measured_choice import (
    ENGINE_SIDE,
    KIB,
    TWO_BY_ONE,
    _expected,
    _listen_to_the_log,
    _log_lines,
    _testing,
    _values,
    schedule,
)
from test_stream_corners import MEASURED_PLAN
from test_stream_order import MACHINES, vehicle_env

from fairring_pg import measured
from fairring_pg.group_info import measured_choices

DEVICE = stream_vehicle.DEVICE
RING = 1  # the CPU side's ways: ("engine", "ring"); the ring is the program's own


@dataclasses.dataclass(frozen=True)
class Broken:
    id: str
    nbytes: int
    point: str  # the fault point armed to throw on rank 1


def _problems_of_the_kept_class(rank: int, world: int, case: Broken) -> list[str]:
    """Every call exact, the trial schedule then the ring, one 'kept' decision alike."""
    n = case.nbytes // 4
    problems, ran = [], []
    for call in range(measured.TRIAL_CALLS + 2):
        before = ENGINE_SIDE.counts()
        t = _values(rank, n, call)
        dist.all_reduce(t)
        after = ENGINE_SIDE.counts()
        ran.append((after[0] - before[0], after[1] - before[1]).index(1))
        if not torch.equal(t, _expected(world, n, call)):
            problems.append(f"call {call}: wrong values")
    if ran != schedule(RING, measured.TRIAL_CALLS + 2):
        problems.append(f"ways {ran}")
    mine = [d for d in measured_choices() if d["from_bytes"] == case.nbytes]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if any(other != mine for other in everyone):
        problems.append(f"the ranks decided differently: {everyone}")
    if len(mine) != 1 or mine[0]["source"] != "kept" or mine[0]["winner"] != "ring":
        return [*problems, f"decisions: {mine}"]
    if "rank 1 could not time its trial calls (its timer failed" not in mine[0]["reason"]:
        problems.append(f"the reason: {mine[0]['reason']!r}")
    said = [line for line in _log_lines if "could not compare the ways" in line]
    if len(said) != (1 if rank == 0 else 0) or (said and "rank 1 could not time" not in said[0]):
        problems.append(f"logged {said}")
    return problems


def _problems_of_the_failed_agreement(rank: int, world: int, case: Broken) -> list[str]:
    """Calls 0-11 exact; call 12 (the decision) raises at once naming rank 1; call 13
    raises alike; a call of another size is exact."""
    n = case.nbytes // 4
    problems = []
    for call in range(measured.TRIAL_CALLS):
        t = _values(rank, n, call)
        dist.all_reduce(t)
        if not torch.equal(t, _expected(world, n, call)):
            problems.append(f"call {call}: wrong values")
    for call in (measured.TRIAL_CALLS, measured.TRIAL_CALLS + 1):
        start = time.monotonic()
        try:
            dist.all_reduce(_values(rank, n, call))
            problems.append(f"call {call} did not raise")
        except Exception as exc:  # noqa: BLE001 - its message is the check
            took = time.monotonic() - start
            if "rank 1 could not take part" not in str(exc) or took > 10:
                problems.append(f"call {call} raised after {took:.1f} s: {exc}")
    t = torch.full((1000,), float(rank + 1), dtype=torch.float64)  # 8 KB: another class
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((1000,), world * (world + 1) / 2, dtype=torch.float64)):
        problems.append("a call of another size is wrong after the failure")
    return problems


def run_broken(rank: int, world: int, case: Broken) -> str | None:
    stream_mutants.arm_from_env()
    _listen_to_the_log()
    _testing().measured.clear_trial_seconds()
    fault_points.disarm()
    if rank == 1:
        key = -1 if case.point == "measured.trial_done" else case.nbytes
        fault_points.arm(case.point, "throw", times=100, key=key)
    try:
        if case.point == "measured.trial_done":
            problems = _problems_of_the_kept_class(rank, world, case)
        else:
            problems = _problems_of_the_failed_agreement(rank, world, case)
    finally:
        fault_points.disarm()
    return "; ".join(problems) or None


BROKEN_JOB = CaseJob(
    "the measured choice where a rank cannot time or cannot agree, 2 x 1",
    run_broken,
    [
        Broken("untimed_trials_keep_the_programs_way", 128 * KIB, "measured.trial_done"),
        Broken("a_rank_that_cannot_agree_fails_the_call_everywhere", 256 * KIB, "measured.decide"),
    ],
    TWO_BY_ONE,
    env=fairring_env(FAIRRING_CPU_ALLREDUCE="auto"),
    timeout_s=240,
    pg_timeout_s=60,
)


def test_untimed_trials_keep_the_programs_way_on_every_rank() -> None:
    BROKEN_JOB.check("untimed_trials_keep_the_programs_way")


def test_a_rank_that_cannot_agree_fails_the_call_on_every_rank_at_once() -> None:
    BROKEN_JOB.check("a_rank_that_cannot_agree_fails_the_call_everywhere")


# ------------------------------------------------------------------ abort in the agreement

STOP_BYTES = 64 * KIB
HELD_MS = 6000


def abort_in_the_agreement(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 reaches the agreement HELD_MS late; rank 0 aborts its group 1 s into its
    wait. What each rank's decision call raised, and when."""
    n = STOP_BYTES // 4
    if rank == 1:
        fault_points.arm("measured.decide", "delay", delay_ms=HELD_MS, key=STOP_BYTES)
    for call in range(measured.TRIAL_CALLS):
        dist.all_reduce(_values(rank, n, call))
    got: dict[str, Any] = {}

    def decision_call() -> None:
        start = time.monotonic()
        try:
            dist.all_reduce(_values(rank, n, measured.TRIAL_CALLS))
            got["error"] = None
        except Exception as exc:  # noqa: BLE001 - reported
            got["error"] = str(exc)
        got["ended"] = time.monotonic()
        got["took"] = got["ended"] - start

    thread = threading.Thread(target=decision_call)
    thread.start()
    if rank == 0:
        time.sleep(1.0)
        got["aborted"] = time.monotonic()
        dist.group.WORLD._get_backend(torch.device("cpu")).abort()
    thread.join(timeout=60)
    got["joined"] = not thread.is_alive()
    fault_points.disarm()
    return got


def test_abort_ends_the_agreements_wait() -> None:
    env = fairring_env(FAIRRING_CPU_ALLREDUCE="auto")
    zero, one = run_ranks(
        abort_in_the_agreement, 2, TWO_BY_ONE, env=env, timeout_s=120, pg_timeout_s=60
    )
    assert zero["joined"] and one["joined"], (zero, one)
    assert "rank 0 could not take part: its process group was shut down" in (zero["error"] or ""), (
        zero
    )
    assert zero["ended"] - zero["aborted"] < 2.0, zero
    # Rank 1 arrives HELD_MS late and reads rank 0's reason: no timeout's wait.
    assert "rank 0 could not take part: its process group was shut down" in (one["error"] or ""), (
        one
    )
    assert one["took"] < HELD_MS / 1000 + 5, one


# ------------------------------------------------------- two devices, two threads, two orders

CPU_BYTES = 64 * KIB  # a class of the CPU plan at 3 x 1 under auto
VEHICLE_N = 256  # 2 KiB of float64: MEASURED_PLAN's measured class
VEHICLE_CLASS = 1024  # where that class starts
LATE_AGREEMENT_MS = 5000
# Each way's time per rank: the engine beats the ring, the composition the delegate; an
# agreement that pairs one device's figures with the other's finds ties, and ties keep
# each program's own way (the ring, the delegate).
CPU_TIMES = (("engine", 1.0), ("ring", 3.0))
VEHICLE_TIMES = (("nccl", 3.0), ("composed", 1.0))


def two_devices_two_threads(rank: int, world: int) -> dict[str, Any]:
    stream_mutants.arm_from_env()
    stream_vehicle.init_fairring(timeout=timedelta(seconds=60))
    m = _testing().measured
    m.clear_trial_seconds()
    for way, seconds in CPU_TIMES:
        m.set_trial_seconds(way, CPU_BYTES, seconds)
    for way, seconds in VEHICLE_TIMES:
        m.set_trial_seconds(way, VEHICLE_CLASS, seconds)
    errors: list[str] = []

    def cpu() -> None:
        n = CPU_BYTES // 4
        for call in range(measured.TRIAL_CALLS + 2):
            t = _values(rank, n, call)
            dist.all_reduce(t)
            if not torch.equal(t, _expected(world, n, call)):
                errors.append(f"cpu call {call}: wrong values")

    def vehicle() -> None:
        for call in range(measured.TRIAL_CALLS + 2):
            t = (torch.arange(VEHICLE_N, dtype=torch.float64) + rank + call).to(DEVICE)
            dist.all_reduce(t)
            want = torch.arange(VEHICLE_N, dtype=torch.float64) * world + world * call + 3
            if not torch.equal(t.cpu(), want):
                errors.append(f"vehicle call {call}: wrong values")

    # Rank 0 reaches its vehicle class's agreement late, rank 1 its CPU class's: each
    # rank's first agreement is of another device (rank 2's as it comes).
    late = {0: VEHICLE_CLASS, 1: CPU_BYTES}.get(rank)
    if late is not None:
        fault_points.arm("measured.decide", "delay", delay_ms=LATE_AGREEMENT_MS, key=late)
    threads = [threading.Thread(target=cpu), threading.Thread(target=vehicle)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    decided = {d["device"]: d["winner"] for d in measured.decisions_of(backend, ("cpu", DEVICE))}
    m.clear_trial_seconds()
    fault_points.disarm()
    stream_vehicle.finish()
    return {"errors": errors, "decided": decided, "alive": [t.is_alive() for t in threads]}


def test_two_devices_deciding_from_two_threads_in_other_orders_agree() -> None:
    stream_vehicle.ensure_built()
    env = {**vehicle_env(), "FAIRRING_TEST_CUDA_PLAN": MEASURED_PLAN}
    env["FAIRRING_CPU_ALLREDUCE"] = "auto"
    env["FAIRRING_CUDA_ALLREDUCE"] = "auto"
    got = run_ranks(
        two_devices_two_threads, 3, MACHINES["3x1"], env=env, timeout_s=240, init_group=False
    )
    for rank, r in enumerate(got):
        assert r["errors"] == [] and r["alive"] == [False, False], (rank, r)
        assert r["decided"] == {"cpu": "engine", DEVICE: "composed"}, (rank, r)
