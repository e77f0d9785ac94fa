"""The measured choice (``FAIRRING_*_ALLREDUCE=auto``; src/measured/, docs/design.md,
"The measured choice"), on CPU.

Under ``auto`` every size class the model is not sure of runs its first calls both ways,
in an order every rank follows (trial_order.h), timed; at the class's decision call the
ranks agree on the slowest rank's times and every rank runs the faster from there on.
The tests inject each timed call's seconds with the core's test-only clock (the test
module's ``measured.set_trial_seconds``), so that they say which way wins on each rank:

- fairring's engine against Gloo's ring at one rank per machine (2 x 1), the CPU side:
  the way of every call (the engine's and the ring's counters) follows the schedule, then
  the winner, each call exact; the ranks' decisions are the same and hold the slowest
  rank's times (ranks whose own timings disagree: the slowest rank's verdict); a rank that
  reaches the decision 1.5 s late holds the others there, and nothing hangs; a rank whose
  trial calls end 1.5 s late (the real clock) is waited for, and their time counts;
  calls from callbacks and calls Gloo cannot reduce count for no class; each decision is
  logged once;
- NCCL's own allreduce against the composition, the CUDA side's logic on the CPU sub-group
  path (FAIRRING_TEST_CPU_SUBGROUPS, Gloo groups standing in for NCCL), at 2 x 2;
- FAIRRING_PLAN_FILE: a job saves its decisions, a later job of the same shape runs them
  from the first call, one of another shape (or whose file names another torch) fails
  at init on every rank, naming why (each field of the shape: tests/test_plan_file_shape.py);
- the fixed modes and ``model`` make no trial.

The plants ``measured_own_times`` (each rank decides from its own times) and
``measured_fastest_rank`` (MIN instead of MAX) are caught by the disagreeing-ranks job
(tests/stream_mutants.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from functools import cache
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import fault_points
import pytest
import stream_mutants
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import fairring_env, launch, run_ranks

from fairring_pg import measured
from fairring_pg.config import Config, file_for_group
from fairring_pg.group_info import measured_choices
from fairring_pg.model import cpu_plan, cuda_plan
from fairring_pg.model.nodes import NODE_TYPES

KIB = 1024
MIB = 1 << 20
TWO_BY_ONE = ["m0", "m1"]
TWO_BY_TWO = ["m0", "m0", "m1", "m1"]
LATE_MS = 1500
# The composed path's trials at 2 x 2: rows of the sizes the cases use.
SUBGROUP_PLAN = (
    "0:nccl,4K:measure:2:reduce_scatter,64K:measure:3:alltoall,256K:measure:2:alltoall,"
    "1M:measure:2:alltoall"
)


@cache
def _testing() -> ModuleType:
    import native_module

    return native_module.load()


def schedule(winner: int, calls: int) -> list[int]:
    """The way of each of a class's first ``calls`` calls, ``winner`` deciding."""
    m = _testing().measured
    return [m.trial_call(i)[0] if i < m.decision_call else winner for i in range(calls)]


# --------------------------------------------------------------------- without processes


def test_the_trial_order_is_abba_blocks_each_first_call_untimed() -> None:
    m = _testing().measured
    calls = [m.trial_call(i) for i in range(m.decision_call)]
    # Blocks of three calls of one way, A B B A; the first of each block (a way's very
    # first call among them: it connects) is not timed.
    assert [way for way, _ in calls] == [0] * 3 + [1] * 6 + [0] * 3
    assert [timed for _, timed in calls] == [False, True, True] * 4
    timed = [way for way, is_timed in calls if is_timed]
    assert timed.count(0) == timed.count(1) == m.timed_calls == 4
    assert m.decision_call == measured.TRIAL_CALLS == 12


def test_the_cpu_plan_measures_where_the_model_is_not_sure() -> None:
    auto = Config()
    four_by_one = cpu_plan.plan_cpu_allreduce(auto, 4, 1)
    assert [r.from_bytes for r in four_by_one.rows] == list(cpu_plan.CLASS_STARTS)
    assert {r.path for r in four_by_one.rows} == {cpu_plan.MEASURE}
    assert cpu_plan.CLASS_STARTS[:3] == (0, 4 * KIB, 8 * KIB)
    assert cpu_plan.CLASS_STARTS[-1] == 1 << 30
    # Several ranks per machine: sure of the engine where its saving beats the error.
    for M, L in ((2, 2), (2, 3), (3, 2), (4, 2), (1, 4)):
        plan = cpu_plan.plan_cpu_allreduce(auto, M, L)
        assert [r.path for r in plan.rows] == [cpu_plan.ENGINE], (M, L)
    # 8 x 2: the engine sends 0.93x the ring's bytes, within the error.
    assert cpu_plan.plan_cpu_allreduce(auto, 8, 2).measures
    model = cpu_plan.plan_cpu_allreduce(Config(cpu_allreduce="model"), 4, 1)
    assert [(r.from_bytes, r.path) for r in model.rows] == [(0, "engine"), (MIB, "ring")]
    assert not model.measures
    for mode, path in (("engine", "engine"), ("gloo", "ring")):
        plan = cpu_plan.plan_cpu_allreduce(Config(cpu_allreduce=mode), 4, 1)
        assert [(r.from_bytes, r.path) for r in plan.rows] == [(0, path)]


def test_auto_measures_what_the_model_would_compose_or_is_unsure_of() -> None:
    node, M = NODE_TYPES["a100-4x200g"], 4
    model = cuda_plan.plan_allreduce(node, M, Config())
    auto = cuda_plan.plan_allreduce(node, M, Config(), measured=True)
    assert auto.measures and not model.measures
    margin = 1 + cuda_plan.COMPOSE_MARGIN
    for size in (2 * MIB, 3 * MIB, 4 * MIB, 25 * MIB, 100 * MIB, 1 << 30):
        theirs, ours = model.row_for(size), auto.row_for(size)
        if theirs.path == cuda_plan.COMPOSE:
            # Every size the model composes is measured, with the model's composition.
            assert ours.path == cuda_plan.MEASURE, size
            assert (ours.pieces, ours.exchange) == (theirs.pieces, theirs.exchange), size
    for row in auto.rows:
        if row.path == cuda_plan.MEASURE:
            predicted = float(row.reason.split("predicts ")[1].split("x")[0])
            assert predicted * margin >= 1, row
        else:
            assert row.path == cuda_plan.NCCL, row
    # Below FAIRRING_DIRECT_BELOW, latency rules: NCCL's, never measured.
    assert auto.row_for(MIB).path == cuda_plan.NCCL
    # One rank per machine: NCCL's everywhere, under auto as under model.
    one_gpu = dataclasses.replace(node, gpus=1)
    assert not cuda_plan.plan_allreduce(one_gpu, 8, Config(), measured=True).composes


def test_a_plan_file_of_another_job_is_refused_naming_what_differs(tmp_path: Path) -> None:
    auto = Config()
    plan = cpu_plan.plan_cpu_allreduce(auto, 2, 1)
    nccl_only = cuda_plan.only_nccl(2, 1, "unknown", "test")

    def shape(world: int, machines: int, local: int) -> dict[str, Any]:
        topo: Any = SimpleNamespace(world_size=world, num_machines=machines, local_size=local)
        return measured.job_shape(topo, auto, plan, nccl_only, [], "none", 0)

    path = tmp_path / "plan.json"
    assert measured.read_known(str(path), shape(2, 2, 1)) == []  # the first job makes it
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"FAIRRING_PLAN_FILE=.*is not a plan file"):
        measured.read_known(str(path), shape(2, 2, 1))
    saved = {"format": measured.FORMAT, "shape": shape(2, 2, 1), "decisions": [{"x": 1}]}
    path.write_text(json.dumps(saved))
    assert measured.read_known(str(path), shape(2, 2, 1)) == [{"x": 1}]
    with pytest.raises(ValueError, match=r"its world_size is 2, this job's is 4"):
        measured.read_known(str(path), shape(4, 4, 1))
    saved["shape"]["settings"]["lanes"] = 4
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"saved with lanes=4, this job has 2"):
        measured.read_known(str(path), shape(2, 2, 1))
    assert file_for_group("/d/plan.json", "0") == "/d/plan.json"
    assert file_for_group("/d/plan.json", "3") == "/d/plan.g3.json"


# ------------------------------------------------------------------------------ the trials


@dataclasses.dataclass(frozen=True)
class Trial:
    id: str
    nbytes: int  # a power of two from 4 KiB: a class of its own, starting there
    winner: str
    # rank (-1: every rank) -> way -> seconds each timed call is said to take; none: the clock
    times: tuple[tuple[int, tuple[tuple[str, float], ...]], ...] = ()
    # the slowest rank's mean seconds per way, as the decision must hold them
    seconds: tuple[float, float] | None = None
    late_decision_rank: int = -1  # reaches the agreement LATE_MS late
    late_trial: tuple[int, tuple[int, ...]] = (-1, ())  # rank, calls: they end LATE_MS late
    beside: bool = False  # calls that count for no class between the program's
    # every call issued before any is waited for: the decision call comes while trial
    # calls may still run
    asynchronous: bool = False
    calls: int = 14


@dataclasses.dataclass(frozen=True)
class LogCheck:
    id: str = "logged_once"


_log_lines: list[str] = []


class _Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _log_lines.append(record.getMessage())


def _listen_to_the_log() -> None:
    logger = logging.getLogger("fairring_pg")
    if not any(isinstance(h, _Lines) for h in logger.handlers):
        logger.addHandler(_Lines())
        logger.setLevel(logging.INFO)


def _set_clock(rank: int, case: Trial) -> None:
    m = _testing().measured
    m.clear_trial_seconds()
    fault_points.disarm()
    for who, ways in case.times:
        if who in (-1, rank):
            for way, seconds in ways:
                m.set_trial_seconds(way, case.nbytes, seconds)
    if case.late_decision_rank == rank:
        fault_points.arm("measured.decide", "delay", delay_ms=LATE_MS, key=case.nbytes)
    if case.late_trial[0] == rank:
        for call in case.late_trial[1]:
            fault_points.arm("measured.trial_done", "delay", delay_ms=LATE_MS, key=call)


@dataclasses.dataclass(frozen=True)
class Side:
    """What the runner reads on one side: the ways' names and how many calls each ran."""

    ways: tuple[str, str]
    device: str

    def counts(self) -> tuple[int, int]:
        backend: Any = dist.group.WORLD._get_backend(torch.device("cpu"))
        if self.device == "engine":
            s = backend.cpu_allreduce_stats()
            return int(s["engine"]), int(s["ring"])
        s = backend.subgroup_stats("cpu")
        return int(s["nccl_calls"]), int(s["composed_calls"])


ENGINE_SIDE = Side(("engine", "ring"), "engine")
SUBGROUP_SIDE = Side(("gloo", "composed"), "subgroups")


def _values(rank: int, n: int, call: int) -> torch.Tensor:
    # Whole numbers below 2**24: exact in float32 in any order of addition.
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + call


def _expected(world: int, n: int, call: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * sum(range(1, world + 1)) + world * call


def run_trial(rank: int, world: int, case: Trial | LogCheck, side: Side) -> str | None:
    stream_mutants.arm_from_env()
    _listen_to_the_log()
    if isinstance(case, LogCheck):
        return _check_the_log(rank)
    _set_clock(rank, case)
    n = case.nbytes // 4
    problems: list[str] = []
    ran: list[int] = []
    took: list[float] = []
    pending = []
    for call in range(case.calls):
        before = side.counts()
        t = _values(rank, n, call)
        start = time.monotonic()
        work = dist.all_reduce(t, async_op=True)
        if not case.asynchronous:
            work.wait()
        took.append(time.monotonic() - start)
        after = side.counts()  # counted as issued
        pending.append((work, t))
        delta = (after[0] - before[0], after[1] - before[1])
        ran.append(-1 if delta not in ((1, 0), (0, 1)) else delta.index(1))
        if case.beside:
            problems += _beside(rank, world, n, call, side)
    for call, (work, t) in enumerate(pending):
        work.wait()
        if not torch.equal(t, _expected(world, n, call)):
            problems.append(f"call {call}: wrong values")
    want = schedule(case.winner == side.ways[1], case.calls)
    if ran != want:
        problems.append(f"ways {ran}, expected {want} (0: {side.ways[0]}, 1: {side.ways[1]})")
    mine = [d for d in measured_choices() if d["from_bytes"] == case.nbytes]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if any(other != mine for other in everyone):
        problems.append(f"the ranks decided differently: {everyone}")
    if len(mine) != 1:
        return "; ".join([*problems, f"decisions for the class: {mine}"])
    decision = mine[0]
    if decision["winner"] != case.winner or decision["trial_calls"] != measured.TRIAL_CALLS:
        problems.append(f"decided {decision}, expected {case.winner}")
    if case.seconds is not None and decision["seconds"] != pytest.approx(case.seconds):
        problems.append(
            f"seconds {decision['seconds']}, expected the slowest rank's {case.seconds}"
        )
    # Two of four calls late: the median (the mean of the middle two) holds one of them.
    if case.late_trial[0] >= 0 and decision["seconds"][0] < LATE_MS / 1000 / 2:
        problems.append(f"the late calls did not count: {decision['seconds']}")
    decision_call = took[measured.TRIAL_CALLS]
    if case.late_decision_rank >= 0 and rank != case.late_decision_rank and decision_call < 1.0:
        problems.append(f"the decision call took {decision_call:.2f} s: it did not wait")
    _testing().measured.clear_trial_seconds()
    fault_points.disarm()
    return "; ".join(problems) or None


def _beside(rank: int, world: int, n: int, call: int, side: Side) -> list[str]:
    """Between a class's calls: one issued from a callback, and one Gloo cannot reduce
    (AVG), both of the class's size and neither counted: the engine runs both."""
    problems = []
    before = side.counts()
    first = torch.ones(8, dtype=torch.int16)  # Gloo reduces no int16: the engine, uncounted
    nested = _values(rank, n, call)

    def hook(fut: torch.futures.Future) -> Any:
        dist.all_reduce(nested)
        return fut.value()

    dist.all_reduce(first, async_op=True).get_future().then(hook).wait()
    avg = _values(rank, n, call).double()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG)
    after = side.counts()
    if not torch.equal(nested, _expected(world, n, call)):
        problems.append(f"call {call}: the callback's allreduce is wrong")
    if not torch.equal(avg, _expected(world, n, call).double() / world):
        problems.append(f"call {call}: the AVG is wrong")
    if (after[0] - before[0], after[1] - before[1]) != (3, 0):
        problems.append(f"call {call}: beside the class, {after} after {before}")
    return problems


def _check_the_log(rank: int) -> str | None:
    lines = [line for line in _log_lines if line.startswith("fairring: measured cpu")]
    decided = measured_choices()
    if rank != 0:
        return f"rank {rank} logged {lines}" if lines else None
    if len(lines) != len(decided):
        return f"{len(lines)} lines for {len(decided)} decisions: {lines}"
    for d in decided:
        span = f"allreduces of {d['from_bytes']}-{d['to_bytes'] - 1} B"
        said = f"{d['winner']} from call {measured.TRIAL_CALLS}"
        if not any(span in line and said in line for line in lines):
            return f"no line says {span} -> {d['winner']}: {lines}"
    return None


def run_engine_trial(rank: int, world: int, case: Trial | LogCheck) -> str | None:
    return run_trial(rank, world, case, ENGINE_SIDE)


def run_subgroup_trial(rank: int, world: int, case: Trial | LogCheck) -> str | None:
    return run_trial(rank, world, case, SUBGROUP_SIDE)


def _every(*ways: tuple[str, float]) -> tuple[tuple[int, tuple[tuple[str, float], ...]], ...]:
    return ((-1, ways),)


# Rank 0 finds the ring faster, rank 1 the engine; the slowest rank's times (engine 4 s,
# ring 3 s) make it the ring. Deciding from one's own times splits the ranks (a hang);
# from the fastest rank's (engine 1 s, ring 2 s), the engine.
DISAGREEING = ((0, (("engine", 4.0), ("ring", 2.0))), (1, (("engine", 1.0), ("ring", 3.0))))

ENGINE_CASES = [
    Trial("ring_wins", 64 * KIB, "ring", _every(("engine", 2.0), ("ring", 1.0)), (2.0, 1.0)),
    Trial("engine_wins", 128 * KIB, "engine", _every(("engine", 1.0), ("ring", 3.0)), (1.0, 3.0)),
    Trial("a_tie_is_the_rings", 8 * KIB, "ring", _every(("engine", 1.0), ("ring", 1.0))),
    # The engine replaces the ring only where faster by more than 5% (kMeasuredMargin).
    Trial(
        "within_the_margin_is_the_rings",
        32 * KIB,
        "ring",
        _every(("engine", 1.0), ("ring", 1.04)),
        (1.0, 1.04),
    ),
    Trial(
        "beyond_the_margin_is_the_engines",
        2 * MIB,
        "engine",
        _every(("engine", 1.0), ("ring", 1.06)),
        (1.0, 1.06),
    ),
    Trial("slowest_rank_counts", 256 * KIB, "ring", DISAGREEING, (4.0, 3.0)),
    Trial(
        "late_decision",
        512 * KIB,
        "engine",
        _every(("engine", 1.0), ("ring", 2.0)),
        late_decision_rank=1,
    ),
    # The real clock: rank 0's engine trial calls 2 and 11 (of 1, 2, 10, 11) end 1.5 s
    # late, every call issued at once: the decision (call 12) comes while they still run.
    Trial("late_trial_counts", MIB, "ring", late_trial=(0, (2, 11)), asynchronous=True),
    Trial(
        "beside_the_class", 16 * KIB, "ring", _every(("engine", 2.0), ("ring", 1.0)), beside=True
    ),
    LogCheck(),
]

ENGINE_JOB = CaseJob(
    "the measured choice, engine or ring, 2 x 1",
    run_engine_trial,
    ENGINE_CASES,
    TWO_BY_ONE,
    env=fairring_env(FAIRRING_CPU_ALLREDUCE="auto"),
    timeout_s=300,
    pg_timeout_s=60,
)


@pytest.mark.parametrize("case_id", ENGINE_JOB.case_ids)
def test_engine_or_ring(case_id: str) -> None:
    ENGINE_JOB.check(case_id)


SUBGROUP_CASES = [
    Trial(
        "composed_wins", 4 * KIB, "composed", _every(("gloo", 2.0), ("composed", 1.0)), (2.0, 1.0)
    ),
    Trial("delegate_wins", 64 * KIB, "gloo", _every(("gloo", 1.0), ("composed", 3.0)), (1.0, 3.0)),
    # The composition replaces the delegate only where faster by more than 5%.
    Trial(
        "within_the_margin_is_the_delegates",
        MIB,
        "gloo",
        _every(("gloo", 1.04), ("composed", 1.0)),
        (1.04, 1.0),
    ),
    Trial(
        "slowest_rank_counts",
        256 * KIB,
        "composed",
        (
            (0, (("gloo", 4.0), ("composed", 2.0))),
            (1, (("gloo", 1.0), ("composed", 3.0))),
            (2, (("gloo", 1.0), ("composed", 1.0))),
            (3, (("gloo", 1.0), ("composed", 1.0))),
        ),
        (4.0, 3.0),
    ),
]

SUBGROUP_JOB = CaseJob(
    "the measured choice, the delegate's or the composition, 2 x 2 (CPU sub-groups)",
    run_subgroup_trial,
    SUBGROUP_CASES,
    TWO_BY_TWO,
    env=fairring_env(
        FAIRRING_TEST_CPU_SUBGROUPS="on",
        FAIRRING_TEST_CUDA_PLAN=SUBGROUP_PLAN,
        FAIRRING_CUDA_ALLREDUCE="auto",
    ),
    timeout_s=300,
    pg_timeout_s=60,
)


@pytest.mark.parametrize("case_id", SUBGROUP_JOB.case_ids)
def test_delegate_or_composition(case_id: str) -> None:
    SUBGROUP_JOB.check(case_id)


# Alone, with a short timeout: where a plant splits the ranks, its calls hang until then.
DISAGREEING_JOB = CaseJob(
    "the measured choice where the ranks' own timings disagree, 2 x 1",
    run_engine_trial,
    [Trial("slowest_rank_counts", 256 * KIB, "ring", DISAGREEING, (4.0, 3.0))],
    TWO_BY_ONE,
    timeout_s=120,
    pg_timeout_s=20,
)


def test_the_slowest_ranks_times_decide_on_every_rank() -> None:
    DISAGREEING_JOB.check("slowest_rank_counts")


# --------------------------------------------------------------------------- the plan file


def _plan_file_job(rank: int, world: int, step: str) -> dict[str, Any]:
    """``save``: one class decided by trials (the ring, by the test clock). ``reuse``:
    that class runs the ring from its first call; another is measured and added."""
    m = _testing().measured
    m.clear_trial_seconds()
    m.set_trial_seconds("engine", -1, 2.0)
    m.set_trial_seconds("ring", -1, 1.0)
    n = 64 * KIB // 4
    ran = []
    calls = measured.TRIAL_CALLS + 1 if step == "save" else 3
    for call in range(calls):
        before = ENGINE_SIDE.counts()
        t = _values(rank, n, call)
        dist.all_reduce(t)
        assert torch.equal(t, _expected(world, n, call)), f"call {call}"
        after = ENGINE_SIDE.counts()
        ran.append(after[1] - before[1])
    if step == "reuse":
        m.set_trial_seconds("engine", -1, 1.0)
        m.set_trial_seconds("ring", -1, 2.0)
        for call in range(measured.TRIAL_CALLS + 1):
            t = _values(rank, 128 * KIB // 4, call)
            dist.all_reduce(t)
    return {"ring_calls": ran, "choices": measured_choices()}


def test_the_plan_file_is_saved_reused_and_refused_for_another_shape(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    env = fairring_env(FAIRRING_PLAN_FILE=str(path), FAIRRING_CPU_ALLREDUCE="auto")
    first = run_ranks(_plan_file_job, 2, TWO_BY_ONE, env=env, timeout_s=180, step="save")
    assert first[0]["ring_calls"] == [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1]
    saved = json.loads(path.read_text())
    assert saved["format"] == measured.FORMAT
    assert [(d["device"], d["from_bytes"], d["winner"]) for d in saved["decisions"]] == [
        ("cpu", 64 * KIB, "ring")
    ]
    again = run_ranks(_plan_file_job, 2, TWO_BY_ONE, env=env, timeout_s=180, step="reuse")
    for r, result in enumerate(again):
        assert result["ring_calls"] == [1, 1, 1], f"rank {r}: the saved winner from call 0"
        sources = {d["from_bytes"]: (d["source"], d["winner"]) for d in result["choices"]}
        assert sources == {
            64 * KIB: ("plan file", "ring"),
            128 * KIB: ("measured", "engine"),
        }, f"rank {r}"
    saved = json.loads(path.read_text())
    assert [(d["from_bytes"], d["winner"]) for d in saved["decisions"]] == [
        (64 * KIB, "ring"),
        (128 * KIB, "engine"),
    ]
    # Another shape (2 x 2: the engine is sure, so there is nothing measured either):
    # refused on every rank at init, naming the variable and what differs.
    outcomes = launch(_plan_file_job, 4, TWO_BY_TWO, env=env, timeout_s=120, step="save")
    for o in outcomes:
        assert o.status == "error", o.describe()
        assert "FAIRRING_PLAN_FILE=" in (o.error_message or ""), o.describe()
        assert "its world_size is 2, this job's is 4" in (o.error_message or ""), o.describe()
    # The same shape but for the torch it was saved under: refused on every rank alike.
    saved["shape"]["torch_version"] = "1.0.0"
    path.write_text(json.dumps(saved))
    outcomes = launch(_plan_file_job, 2, TWO_BY_ONE, env=env, timeout_s=120, step="reuse")
    named = f"its torch_version is '1.0.0', this job's is {str(torch.__version__)!r}"
    for o in outcomes:
        assert o.status == "error", o.describe()
        assert named in (o.error_message or ""), o.describe()


# ------------------------------------------------------------------------ no trial at all


def _no_trials(rank: int, world: int, nbytes: int) -> dict[str, Any]:
    before = ENGINE_SIDE.counts()
    for call in range(12):
        t = _values(rank, nbytes // 4, call)
        dist.all_reduce(t)
        assert torch.equal(t, _expected(world, nbytes // 4, call))
    after = ENGINE_SIDE.counts()
    return {"counts": (after[0] - before[0], after[1] - before[1]), "choices": measured_choices()}


@pytest.mark.parametrize(
    ("mode", "counts"), [("model", (0, 12)), ("engine", (12, 0)), ("gloo", (0, 12))]
)
def test_model_and_the_fixed_modes_make_no_trial(mode: str, counts: tuple[int, int]) -> None:
    env = fairring_env(FAIRRING_CPU_ALLREDUCE=mode)
    results = run_ranks(_no_trials, 2, TWO_BY_ONE, env=env, timeout_s=120, nbytes=2 * MIB)
    for r, result in enumerate(results):
        assert result == {"counts": counts, "choices": []}, f"rank {r}"
