"""The sub-group allreduce (src/subgroups/, the CUDA path's orchestration) on CPU.

On CUDA tensors fairring composes each allreduce of NCCL sub-group collectives
(reduce-scatter inside the machine, all-to-all and all-gather along the rail on one of
several lanes, a reduction of the shards, all-gather inside the machine). The test
switch FAIRRING_TEST_CPU_SUBGROUPS=on makes CPU tensors take that same code over Gloo
sub-groups, so everything but the CUDA streams is checked here, without a GPU: slicing,
lanes, the direct path for small tensors and slice tails, every op and dtype (int16
widened, bool as bytes), views, coalescing, and order across many calls.

The case list and the references are test_allreduce's (tests/values.py): every rank
computes the expected result from all ranks' known inputs. The 2x2, 3x1 and 2x3 jobs
(2x3: L = 3 local ranks, M = 2 machines, so a mix-up of L and M shows) take the five
steps for every tensor of L*M elements or more (FAIRRING_DIRECT_BELOW=0, and
FAIRRING_CUDA_ALLREDUCE=lanes, without which one rank per machine takes the direct
path); the 1x3 job is one machine, which planUnits sends down the direct path whatever
the threshold (one allreduce on the world group: there is no rail to shard across), and
checks that path. Which path each allreduce took is checked, per shape, mode and size,
from the path's counters (``fairring_pg.group_info.subgroup_stats``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import SHAPES, fairring_env, run_ranks
from test_allreduce import (
    DTYPES,
    FLOAT_DTYPES,
    OPS,
    VIEW_KINDS,
    Case,
    build_cases,
    make_input,
    reduce_exact,
    run_case,
    wide_cases,
)
from values import compare_exact, reduce_op

from fairring_pg.group_info import subgroup_stats

SLICE_SIZE = 4 * 1024
TOTAL_MEMORY = 64 * 1024
TIMEOUT_S = 300


# Pieces of at most 4 KiB; below 4 KiB the all-to-all exchange with at least three
# pieces per call, from 4 KiB NCCL's reduce-scatter and all-gather on the rail with at
# least two: every case of 257 elements takes the first, every one of 4099 the second.
FORCED_PLAN = "0:compose:3:alltoall,4K:compose:2:reduce_scatter"


def subgroup_env(**extra: str | int | None) -> dict[str, str | None]:
    """The switch on, small pieces (many per tensor), and no direct path unless asked:
    every tensor of L*M elements or more is composed, at one rank per machine too, with
    the plan of FAIRRING_CUDA_ALLREDUCE=lanes (one piece per 4 KiB, all-to-all)."""
    env = fairring_env(
        total_memory=TOTAL_MEMORY,
        slice_size=SLICE_SIZE,
        FAIRRING_SLICE_SCALING="off",
        FAIRRING_TEST_CPU_SUBGROUPS="on",
        FAIRRING_LANES=2,
        FAIRRING_DIRECT_BELOW=0,
        FAIRRING_CUDA_ALLREDUCE="lanes",
    )
    env.update({k: None if v is None else str(v) for k, v in extra.items()})
    return env


def forced_cases() -> list[Case]:
    """Every op and dtype at an odd size through each rail exchange (257 and 4099
    elements, and 7: a piece and a tail where L*M <= 7), views, coalesced, async, AVG's
    fractions, values that see width and precision, and one tensor of many pieces."""
    cases = [
        Case(f"{op}-{dtype}-n{n}", "plain", op, dtype, n)
        for op, dtype, n in itertools.product(OPS, DTYPES, (7, 257, 4099))
        if not (op == "AVG" and dtype not in FLOAT_DTYPES)
    ]
    cases += [Case(f"{kind}-SUM-float32", kind, "SUM", "float32", 0) for kind in VIEW_KINDS]
    cases += wide_cases(("float64", "bfloat16", "int16", "int64"))
    cases += [
        Case("async-MAX-int64", "async", "MAX", "int64", 4099),
        Case("future_then-SUM-float32", "future_then", "SUM", "float32", 257),
        Case("coalesced-SUM-float32", "coalesced", "SUM", "float32", 0),
        Case("coalesced-MAX-int32", "coalesced", "MAX", "int32", 0),
        Case("avg_fraction-float64", "avg_fraction", "AVG", "float64", 4099),
        Case("big-SUM-float32-n40000", "plain", "SUM", "float32", 40_000),
    ]
    return cases


# ----------------------------------------------------- exact results, pieces and exchanges

# What the composition reduces (src/ops/reduce_kind.cpp's checkReducible); anything else
# is the delegate's own call (test_what_the_composition_does_not_take_is_the_delegates).
COMPOSED_DTYPES = FLOAT_DTYPES + ("int8", "int16", "int32", "int64", "uint8", "bool")
ELEM_SIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "int16": 4, "float16": 2}
ELEM_SIZE.update(bfloat16=2, int8=1, uint8=1, bool=1)  # int16 travels as int32


def composes(case: Case, local: int, machines: int) -> bool:
    """Whether the composition takes this case's call: a dtype and op it reduces, and for
    a plain tensor at least one group of L·M x 16 bytes (src/subgroups/call_cut.h);
    the other kinds are sized to compose (the job checks each did)."""
    refused = case.kind in ("avg_error", "unsupported", "complex_sum")
    if refused or case.dtype not in COMPOSED_DTYPES:
        return False
    if case.op == "AVG" and case.dtype not in FLOAT_DTYPES:
        return False
    if case.kind == "plain":
        return case.numel >= local * machines * max(1, 16 // ELEM_SIZE[case.dtype])
    return True


def run_composed_case(rank: int, world: int, case: Case) -> str | None:
    """run_case, and the call went through the composition (not to the delegate)."""
    before = subgroup_stats(None, "cpu")
    err = run_case(rank, world, case)
    after = subgroup_stats(None, "cpu")
    assert before is not None and after is not None
    delegated = after["nccl_calls"] - before["nccl_calls"]
    if err is None and (delegated or after["composed_calls"] == before["composed_calls"]):
        return f"{case.id} went to the delegate, not through the composition"
    return err


# M machines of L ranks: 2x2; L != M both ways (2x3, 3x2); 4x2 (eight ranks); one rank
# per machine (3x1: the rail alone). One machine composes nothing (1x3: every call the
# delegate's own, test_what_the_composition_does_not_take_is_the_delegates).
MACHINES = {
    **SHAPES,
    "3x2": ["m0", "m0", "m1", "m1", "m2", "m2"],
    "4x2": ["m0", "m0", "m1", "m1", "m2", "m2", "m3", "m3"],
}
JOB_SHAPES = ("2x2", "2x3", "3x2", "4x2", "3x1")


def _job_cases(shape: str) -> list[Case]:
    if shape in ("2x2", "3x1"):
        # A fortieth of the engine's big cases: still more than the staging memory,
        # dozens of pieces through every lane, where the full size cost 16 s of Gloo steps.
        cases = build_cases(shape, big_numel=(40_000, 16_000))
    else:
        cases = forced_cases()
    machines = len(set(MACHINES[shape]))
    local = len(MACHINES[shape]) // machines
    return [c for c in cases if composes(c, local, machines)]


JOBS = {
    shape: CaseJob(
        f"subgroups {shape}",
        run_composed_case,
        _job_cases(shape),
        MACHINES[shape],
        env=subgroup_env(FAIRRING_TEST_CUDA_PLAN=FORCED_PLAN),
        timeout_s=TIMEOUT_S,
    )
    for shape in JOB_SHAPES
}


@pytest.mark.parametrize(
    ("shape", "case_id"),
    [pytest.param(s, i, id=f"{s}-{i}") for s, job in JOBS.items() for i in job.case_ids],
)
def test_subgroup_allreduce(shape: str, case_id: str) -> None:
    JOBS[shape].check(case_id)


def delegated_like_gloo(rank: int, world: int) -> list[dict[str, Any]]:
    """Calls the composition does not take (too small for a group, a dtype or op it does
    not reduce, and every call where the plan composes nothing) are the delegate's own:
    each ends exactly as the same call on a plain Gloo group of the same ranks (the same
    values, or the same error), never with an error of fairring's."""
    gloo = dist.new_group(backend="gloo")
    calls: list[tuple[str, torch.dtype, int, Any, bool]] = [
        ("int16-SUM-n7", torch.int16, 7, dist.ReduceOp.SUM, False),
        ("int32-AVG-n4099", torch.int32, 4099, dist.ReduceOp.AVG, False),
        ("uint16-MAX-n4099", torch.uint16, 4099, dist.ReduceOp.MAX, False),
        ("bool-MAX-n3", torch.bool, 3, dist.ReduceOp.MAX, False),
        ("float32-SUM-n0", torch.float32, 0, dist.ReduceOp.SUM, False),
        ("float64-SUM-n7-strided", torch.float64, 7, dist.ReduceOp.SUM, True),
        ("float32-PREMUL_SUM-n4099", torch.float32, 4099, "premul", False),
    ]
    out = []
    for name, dtype, n, op, strided in calls:
        ends = []
        for group in (None, gloo):
            values = (torch.arange(2 * n, dtype=torch.float64) % 5 + rank).to(dtype)
            tensor = values[::2] if strided else values[:n].clone()
            reduce = dist._make_nccl_premul_sum(0.5) if op == "premul" else op
            try:
                dist.all_reduce(tensor, op=reduce, group=group)
                ends.append(("ok", tensor.clone()))
            except Exception as exc:  # noqa: BLE001 - compared with Gloo's own
                ends.append(("error", f"{type(exc).__name__}: {exc}"))
        ok = ends[0][0] == "ok"
        same = ends[0][0] == ends[1][0] and (
            torch.equal(ends[0][1], ends[1][1]) if ok else ends[0][1] == ends[1][1]
        )
        out.append({"call": name, "fairring": ends[0], "gloo": ends[1], "same": same})
    return out


@pytest.mark.parametrize("shape", ["2x2", "1x3"])
def test_what_the_composition_does_not_take_is_the_delegates(shape: str) -> None:
    results = run_ranks(
        delegated_like_gloo,
        len(MACHINES[shape]),
        MACHINES[shape],
        env=subgroup_env(FAIRRING_TEST_CUDA_PLAN=FORCED_PLAN if shape == "2x2" else None),
        timeout_s=TIMEOUT_S,
    )
    for rank, rows in enumerate(results):
        for row in rows:
            assert row["same"], (rank, row)


def views_of_one_buffer(rank: int, world: int) -> list[str | None]:
    """Allreduces of views of one buffer in flight together: disjoint halves (DDP's
    buckets), then two that overlap (the second reduces the first's result where they
    meet), each through the composition."""
    n = 4000

    def mine() -> torch.Tensor:
        return torch.arange(2 * n, dtype=torch.float64) * 0.25 + rank * 1000.5

    total = sum(torch.arange(2 * n, dtype=torch.float64) * 0.25 + r * 1000.5 for r in range(world))
    buf = mine()
    works = [dist.all_reduce(buf[:n], async_op=True), dist.all_reduce(buf[n:], async_op=True)]
    for w in works:
        w.wait()
    disjoint = compare_exact(buf.clone(), total, "disjoint halves")
    buf = mine()
    w1 = dist.all_reduce(buf[:n], async_op=True)
    w2 = dist.all_reduce(buf[n // 2 : n + n // 2], async_op=True)
    w1.wait()
    w2.wait()
    want = mine()
    want[: n // 2] = total[: n // 2]
    want[n // 2 : n] = world * total[n // 2 : n]
    want[n : n + n // 2] = total[n : n + n // 2]
    return [disjoint, compare_exact(buf, want, "overlapping views")]


@pytest.mark.parametrize("shape", ["2x3"])
def test_views_of_one_buffer(shape: str) -> None:
    results = run_ranks(
        views_of_one_buffer,
        len(MACHINES[shape]),
        MACHINES[shape],
        env=subgroup_env(FAIRRING_TEST_CUDA_PLAN=FORCED_PLAN),
        timeout_s=TIMEOUT_S,
    )
    assert results == [[None, None]] * len(MACHINES[shape])


# ------------------------------------------------- lanes, the direct path, slice tails


@dataclasses.dataclass(frozen=True)
class SizeCase:
    id: str
    op: str
    dtype: str
    numel: int


def _size_cases() -> list[SizeCase]:
    # 2x2: L*M = 4. Slices of 4 KiB: 1024 float32, 512 float64, 4096 int8 elements.
    sizes = (3, 4, 5, 1023, 1024, 1025, 4099, 20_003)
    return [
        SizeCase(f"{op}-{dtype}-n{n}", op, dtype, n)
        for n in sizes
        for op, dtype in (("SUM", "float32"), ("PRODUCT", "int8"), ("MAX", "float64"))
    ]


SIZE_CASES = _size_cases()


def run_size_case(rank: int, world: int, case: SizeCase) -> str | None:
    c = Case(case.id, "plain", case.op, case.dtype, case.numel)
    inputs = [make_input(r, c, case.numel, world) for r in range(world)]
    tensor = inputs[rank].clone()
    dist.all_reduce(tensor, op=reduce_op(case.op))
    return compare_exact(tensor, reduce_exact(inputs, case.op, case.dtype), "result")


# Lanes from one to three; a direct threshold above some sizes and below others.
LANE_JOBS = {
    name: CaseJob(
        f"subgroups 2x2 {name}",
        run_size_case,
        SIZE_CASES,
        SHAPES["2x2"],
        env=subgroup_env(**extra),
        timeout_s=TIMEOUT_S,
    )
    for name, extra in {
        "lanes1": {"FAIRRING_LANES": 1},
        "lanes3": {"FAIRRING_LANES": 3},
        "direct16K": {"FAIRRING_DIRECT_BELOW": "16K"},
    }.items()
}


@pytest.mark.parametrize(
    ("job", "case_id"),
    [pytest.param(j, c.id, id=f"{j}-{c.id}") for j in LANE_JOBS for c in SIZE_CASES],
)
def test_lanes_and_direct(job: str, case_id: str) -> None:
    LANE_JOBS[job].check(case_id)


# ------------------------------------------------------------------ many calls in order


def many_async(rank: int, world: int, count: int) -> list[str]:
    """`count` allreduces of varied sizes, ops and dtypes issued async, waited in
    reverse order: every one exact."""
    errors = []
    pending = []
    for i in range(count):
        op = OPS[i % len(OPS)]
        dtype = DTYPES[(i * 7) % len(DTYPES)]
        if op == "AVG" and dtype not in FLOAT_DTYPES:
            op = "SUM"
        numel = (i * 997) % 5000
        case = Case(f"many/{i}", "plain", op, dtype, numel)
        inputs = [make_input(r, case, numel, world) for r in range(world)]
        tensor = inputs[rank].clone()
        work = dist.all_reduce(tensor, op=reduce_op(op), async_op=True)
        pending.append((work, tensor, reduce_exact(inputs, op, dtype), case.id))
    for work, tensor, expected, name in reversed(pending):
        work.wait()
        err = compare_exact(tensor, expected, name)
        if err:
            errors.append(err)
    return errors


@pytest.mark.parametrize("shape", ["2x2", "3x1"])
def test_many_async_waited_in_reverse(shape: str) -> None:
    results = run_ranks(
        many_async,
        len(SHAPES[shape]),
        SHAPES[shape],
        env=subgroup_env(),
        timeout_s=TIMEOUT_S,
        count=60,
    )
    assert results == [[]] * len(SHAPES[shape])
