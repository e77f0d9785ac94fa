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
import functools
import itertools
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import SHAPES, fairring_env, launch, run_ranks
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

from fairring_pg.config import Config, lane_staging_bytes
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
    a plain tensor at least one group of L·M x 16 bytes (src/subgroups/call_plan.h);
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


# ------------------------------------------------- which path, per shape, mode and size

# A multiple of 16*L*M bytes for every shape below (32, 64, 64, 48, 96), so that a slice
# is the same 1200 four-byte (600 float64, 2400 bfloat16) elements everywhere.
PATH_SLICE = 4800
PATH_DIRECT_BELOW = 16 * 1024  # bytes
PATH_SHAPES = {
    "2x1": ["m0", "m1"],
    "4x1": ["m0", "m1", "m2", "m3"],
    "2x2": SHAPES["2x2"],
    "1x3": SHAPES["1x3"],
    "2x3": SHAPES["2x3"],
}
PATH_MODES = ("auto", "lanes", "direct")
# (op, dtype, bytes per element as the sub-groups reduce it: int16 travels as int32)
PATH_KINDS = (
    ("SUM", "float32", 4),
    ("MAX", "float64", 8),
    ("SUM", "bfloat16", 2),
    ("PRODUCT", "int16", 4),
)
# Empty; fewer elements than ranks; under PATH_DIRECT_BELOW in every dtype; over it in
# every dtype, with and without a tail of fewer elements than a group.
PATH_SIZES = (0, 2, 1000, 8400, 20_003)


def expected_route(
    mode: str, machines: int, local: int, numel: int, elem: int
) -> tuple[str, tuple[int, int]]:
    """Where an allreduce should go, from the rule as documented, and its (direct tail,
    pieces) units where it composes: a plan composes only with several machines, where
    FAIRRING_CUDA_ALLREDUCE=lanes asks for it (auto composes only where the model
    predicts a win, from the node's facts, which this job declares unknown:
    FAIRRING_NODE=none), and then "composed" from PATH_DIRECT_BELOW and one group of L·M
    x 16 bytes, in as many pieces as keep each under the largest (FAIRRING_SLICE_SIZE),
    the rest of a group a direct tail; a call of a plan that composes is otherwise the
    delegate's ("delegated"), and every call of one that composes nothing
    ("delegate-only": no sub-group path at all)."""
    if machines == 1 or mode != "lanes":
        return "delegate-only", (0, 0)
    group = local * machines * max(1, 16 // elem)
    if numel * elem < PATH_DIRECT_BELOW or numel < group:
        return "delegated", (0, 0)
    groups, tail = divmod(numel, group)
    fit = max(1, PATH_SLICE // (elem * group))
    return "composed", (int(tail != 0), -(-groups // fit))


def paths_taken(rank: int, world: int, device: str = "cpu") -> list[dict[str, Any]]:
    """One fairring group per mode; every size and kind once on each, with the path's
    counters read around it and the result checked exactly (or the delegate's error
    kept). ``device`` "cuda" runs the same on the GPU (tests/test_cuda.py)."""
    import os

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    records = []
    for mode in PATH_MODES:
        os.environ["FAIRRING_CUDA_ALLREDUCE"] = mode
        group = dist.new_group(backend="fairring")
        for op, dtype, elem in PATH_KINDS:
            for numel in PATH_SIZES:
                case = Case(f"path/{mode}/{op}-{dtype}-n{numel}", "plain", op, dtype, numel)
                inputs = [make_input(r, case, numel, world) for r in range(world)]
                tensor = inputs[rank].clone().to(dev)
                before = subgroup_stats(group, device)
                try:
                    dist.all_reduce(tensor, op=reduce_op(op), group=group)
                    error = compare_exact(tensor.cpu(), reduce_exact(inputs, op, dtype), "result")
                    raised = None
                except Exception as exc:  # noqa: BLE001 - the delegate's refusal is kept
                    error, raised = None, f"{type(exc).__name__}: {exc}"
                after = subgroup_stats(group, device)
                if before is None or after is None:
                    route, units = "delegate-only", (0, 0)
                else:
                    delegated = after["nccl_calls"] - before["nccl_calls"]
                    route = "delegated" if delegated else "composed"
                    units = (
                        after["direct_units"] - before["direct_units"],
                        after["sliced_units"] - before["sliced_units"],
                    )
                records.append(
                    {
                        "mode": mode,
                        "case": case.id,
                        "dtype": dtype,
                        "numel": numel,
                        "elem": elem,
                        "error": error,
                        "raised": raised,
                        "route": route,
                        "units": units,
                    }
                )
    return records


def path_env(**extra: str | int | None) -> dict[str, str | None]:
    """The paths job's settings: PATH_SLICE, PATH_DIRECT_BELOW, each group's mode set by
    the job."""
    return {
        **subgroup_env(
            FAIRRING_SLICE_SIZE=PATH_SLICE,
            FAIRRING_DIRECT_BELOW=PATH_DIRECT_BELOW,
            FAIRRING_CUDA_ALLREDUCE=None,
            FAIRRING_NODE="none",
        ),
        **{k: None if v is None else str(v) for k, v in extra.items()},
    }


def check_paths(shape: str, machine_ids: list[str], per_rank: list[list[dict[str, Any]]]) -> None:
    """Every call where the rule sends it, with the units it says; composed calls
    exact; the delegate's exact too, but for int16, which neither Gloo nor NCCL reduces
    (they refuse it, and so does fairring there)."""
    machines = len(set(machine_ids))
    local = len(machine_ids) // machines
    for rank, records in enumerate(per_rank):
        assert len(records) == len(PATH_MODES) * len(PATH_KINDS) * len(PATH_SIZES)
        for r in records:
            where = f"rank {rank}, {shape}, {r['case']}"
            route, units = expected_route(r["mode"], machines, local, r["numel"], r["elem"])
            assert r["route"] == route, f"{where}: went {r['route']}, want {route}"
            if route == "composed":
                assert r["units"] == units, f"{where}: (direct, sliced) {r['units']}, want {units}"
            assert r["error"] is None, f"{where}: {r['error']}"
            refused = route != "composed" and r["dtype"] == "int16"
            assert (r["raised"] is not None) == refused, f"{where}: raised {r['raised']}"
    composed = {r["mode"] for r in per_rank[0] if r["route"] == "composed"}
    assert composed == (set() if machines == 1 else {"lanes"}), shape


@pytest.mark.parametrize("shape", list(PATH_SHAPES))
def test_path_per_shape_mode_and_size(shape: str) -> None:
    """With the node's facts unknown, `auto` leaves every size to the delegate's own
    allreduce, as `direct` does; `lanes` composes from FAIRRING_DIRECT_BELOW up on
    several machines, at one rank per machine (2x1, 4x1) too; one machine (1x3) never
    does. The same on every rank, and every result exact."""
    ids = PATH_SHAPES[shape]
    per_rank = run_ranks(paths_taken, len(ids), ids, env=path_env(), timeout_s=TIMEOUT_S)
    check_paths(shape, ids, per_rank)


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


# ------------------------------------------------------------------ slice arithmetic


@pytest.mark.parametrize(("machines", "local"), [(2, 2), (3, 1), (4, 8), (16, 8)])
@pytest.mark.parametrize("lanes", [1, 4])
def test_subgroup_slice_fits_staging(machines: int, local: int, lanes: int) -> None:
    config = Config(lanes=lanes, cuda_allreduce="lanes")
    size = config.subgroup_slice_size(machines, local)
    unit = 16 * machines * local
    assert size % unit == 0 and size >= unit
    assert lanes * lane_staging_bytes(size, machines, local) <= config.total_memory
    # The largest such size: one more unit would not fit, or would exceed the wish.
    wanted = max(config.slice_size, 1024 * 1024 * machines * local)
    assert (
        size + unit > wanted
        or lanes * lane_staging_bytes(size + unit, machines, local) > config.total_memory
    )


def test_subgroup_slice_refuses_tiny_staging() -> None:
    with pytest.raises(ValueError, match="FAIRRING_TOTAL_MEMORY=1000 .*FAIRRING_LANES=4"):
        Config(total_memory=1000, lanes=4).subgroup_slice_size(4, 2)
    # Without slices there are no lanes to stage for, at any staging size.
    for config, machines, local in [
        (Config(total_memory=1000, lanes=4), 4, 1),
        (Config(total_memory=1000, lanes=4, cuda_allreduce="direct"), 4, 2),
        (Config(total_memory=1000, lanes=4), 1, 8),
    ]:
        assert config.subgroup_slice_size(machines, local) % (16 * machines * local) == 0


@pytest.mark.parametrize(
    ("path", "machines", "local", "slices"),
    [
        ("auto", 2, 1, False),  # one rank per machine: as many bytes as a ring
        ("auto", 4, 1, False),
        ("auto", 2, 2, True),  # the hierarchy saves bytes between machines
        ("auto", 16, 8, True),
        ("auto", 1, 8, False),  # one machine: no rail
        ("lanes", 4, 1, True),
        ("lanes", 1, 3, False),
        ("direct", 2, 2, False),
        ("direct", 4, 1, False),
    ],
)
def test_which_shapes_slice(path: str, machines: int, local: int, slices: bool) -> None:
    assert Config(cuda_allreduce=path).slices_allreduces(machines, local) is slices


def test_config_variables_are_validated() -> None:
    for raw in ("0", "17", "x", "-1", "2.5"):
        with pytest.raises(ValueError, match="FAIRRING_LANES"):
            Config.from_env({"FAIRRING_LANES": raw})
    assert Config.from_env({"FAIRRING_LANES": "3"}).lanes == 3
    assert Config.from_env({"FAIRRING_DIRECT_BELOW": "0"}).direct_below == 0
    assert Config.from_env({"FAIRRING_DIRECT_BELOW": "1M"}).direct_below == 1 << 20
    with pytest.raises(ValueError, match="FAIRRING_DIRECT_BELOW"):
        Config.from_env({"FAIRRING_DIRECT_BELOW": "-5"})
    for name in ("FAIRRING_TEST_CPU_SUBGROUPS", "FAIRRING_TEST_LOCAL_GLOO"):
        with pytest.raises(ValueError, match=name):
            Config.from_env({name: "yes"})
    assert Config().cuda_allreduce == "auto"
    for raw, want in (
        ("auto", "auto"),
        ("Model", "model"),
        (" Lanes ", "lanes"),
        ("DIRECT", "direct"),
    ):
        assert Config.from_env({"FAIRRING_CUDA_ALLREDUCE": raw}).cuda_allreduce == want
    for raw in ("", "ring", "nccl", "1"):
        with pytest.raises(
            ValueError, match="FAIRRING_CUDA_ALLREDUCE=.*auto, model, lanes, direct"
        ):
            Config.from_env({"FAIRRING_CUDA_ALLREDUCE": raw})


def test_lanes_must_agree_across_ranks() -> None:
    outcomes = run_ranks_expecting_failure({0: {"FAIRRING_LANES": "2"}, 1: {"FAIRRING_LANES": "3"}})
    for message in outcomes:
        assert "FAIRRING_LANES differs across ranks" in message, message


def test_path_must_agree_across_ranks() -> None:
    outcomes = run_ranks_expecting_failure(
        {0: {"FAIRRING_CUDA_ALLREDUCE": "auto"}, 1: {"FAIRRING_CUDA_ALLREDUCE": "lanes"}}
    )
    for message in outcomes:
        assert "FAIRRING_CUDA_ALLREDUCE differs across ranks" in message, message


def _init_only(rank: int, world: int) -> None:
    t = torch.ones(3)
    dist.all_reduce(t)


def run_ranks_expecting_failure(rank_env: dict[int, dict[str, str]]) -> list[str]:
    outcomes = launch(
        _init_only,
        2,
        ["m0", "m1"],
        env=subgroup_env(),
        timeout_s=60,
        rank_env=rank_env,
    )
    assert all(not o.ok for o in outcomes), [o.describe() for o in outcomes]
    return [f"{o.error_type}: {o.error_message}" for o in outcomes]


# ------------------------------------------------------------------ size mismatch

MISMATCH_TIMEOUT_S = 10


def mismatched_sizes(rank: int, world: int) -> str:
    """Rank 1 reduces one element more than rank 0 (an extra slice tail), then both
    reduce 10 elements."""
    t = torch.ones(1000 + rank)
    dist.all_reduce(t)
    u = torch.ones(10)
    dist.all_reduce(u)
    return f"passed with {t[:2].tolist()} and {u[:2].tolist()}"


@pytest.mark.parametrize("debug", ["off", "DETAIL"])
def test_size_mismatch_never_passes(debug: str) -> None:
    """NCCL does not compare sizes, and neither do the sub-groups: ranks that disagree
    issue different collectives and wait for each other until the group's timeout
    (NCCL's watchdog on CUDA). TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch wrap fairring
    as it wraps NCCL, comparing every collective's shapes first: a clear error at once."""
    env = subgroup_env()
    if debug == "DETAIL":
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    start = time.monotonic()
    outcomes = launch(
        mismatched_sizes,
        2,
        ["m0", "m1"],
        env=env,
        timeout_s=MISMATCH_TIMEOUT_S + 60,
        pg_timeout_s=MISMATCH_TIMEOUT_S,
        abort_grace_s=None,
    )
    elapsed = time.monotonic() - start
    for o in outcomes:
        assert o.status == "error", o.describe()
        if debug == "DETAIL":
            assert "mismatch" in (o.error_message or "").lower(), o.describe()
            assert "1000" in o.error_message and "1001" in o.error_message, o.describe()
        else:
            # The ranks start together (the launcher's start gate): the timeout is the
            # mismatched allreduces' (raised from one of them), not one from start-up.
            assert o.phase == "fn", o.describe()
            assert "in mismatched_sizes" in (o.remote_traceback or ""), o.describe()
            message = (o.error_message or "").lower()
            assert "timed out" in message or "timeout" in message, o.describe()
    assert elapsed < MISMATCH_TIMEOUT_S + 45, elapsed


# ------------------------------------------------------------------ DDP comm hooks


def _chained_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
    """Two allreduces in a chain: the callback of the first issues the second and waits
    on it (as PowerSGD does), on buckets of different sizes."""
    tensor = bucket.buffer()
    world = dist.get_world_size()

    def second(fut: Any) -> torch.Tensor:
        summed = fut.value()[0]
        again = summed.clone()
        dist.all_reduce(again, async_op=True).get_future().wait()  # world * summed
        return again / world / world

    return dist.all_reduce(tensor, async_op=True).get_future().then(second)


def train_with_hook(
    rank: int, world: int, hooks: tuple[str, ...], steps: int, reference: bool
) -> dict[str, dict[str, torch.Tensor]]:
    """Train the same small model once per hook, in one process group; the reference
    (Gloo) runs the same hooks with every allreduce completed before it returns
    (reference.inline_collectives), so their callbacks run inline, never on Gloo's
    threads."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    if reference:
        from reference import inline_collectives

        inline_collectives()
    finals = {}
    for hook in hooks:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(24, 40),
            torch.nn.ReLU(),
            torch.nn.Linear(40, 30),
            torch.nn.Linear(30, 5),
        )
        # A few buckets of different sizes: callbacks of concurrent buckets chain.
        ddp = DDP(model, bucket_cap_mb=0.004)
        if hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            state = powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2
            )
            ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        elif hook == "chained":
            ddp.register_comm_hook(None, _chained_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(16, 24, generator=gen)
            y = torch.randn(16, 5, generator=gen)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        finals[hook] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return finals


HOOKS = ("allreduce", "fp16", "powersgd", "chained")


@functools.cache
def _hook_runs(backend: str) -> list[dict[str, dict[str, torch.Tensor]]]:
    """One job per backend trains with every hook (2 jobs, not one per hook and backend)."""
    shape = SHAPES["2x2"]
    return run_ranks(
        train_with_hook,
        len(shape),
        shape,
        backend=backend,
        env=subgroup_env(),
        timeout_s=TIMEOUT_S,
        hooks=HOOKS,
        steps=6,
        reference=backend == "gloo",
    )


@pytest.mark.parametrize("hook", HOOKS)
def test_ddp_comm_hooks_match_gloo(hook: str) -> None:
    """The futures complete before allreduce returns, as NCCL's do: hooks that chain
    and block in their callbacks run in program order on every rank."""
    fairring = [r[hook] for r in _hook_runs("fairring")]
    gloo = [r[hook] for r in _hook_runs("gloo")]
    for rank in range(1, len(fairring)):
        for name, value in fairring[rank].items():
            assert torch.equal(value, fairring[0][name]), f"rank {rank} differs in {name}"
    # The same hook on the same buckets on both: only the order of summation differs
    # from Gloo's, a few ulps of float32 in the weights (as test_ddp_hooks holds them).
    # fp16 sums 4 ranks' gradients (|g| < 0.2 here) in fp16: another order can round
    # each sum one fp16 ulp (2**-11 relative) apart, which moves a weight by at most
    # steps * lr * 2**-11 * 0.2 = 6 * 0.05 * 1e-4 = 3e-5 (measured: 1e-5).
    rtol, atol = (0.0, 3e-5) if hook == "fp16" else (1e-5, 1e-6)
    for name, value in fairring[0].items():
        torch.testing.assert_close(value, gloo[0][name], rtol=rtol, atol=atol, msg=name)


# ------------------------------------------------------------------ a killed peer

KILL_TIMEOUT_S = 10


def killed_peer(rank: int, world: int) -> dict[str, Any]:
    """Rank 3 dies (SIGKILL) after a warm-up; the others reduce until they fail, then
    call once more."""
    import os
    import signal

    t = torch.ones(100_000)
    dist.all_reduce(t)
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    first = None
    for _ in range(1000):
        try:
            dist.all_reduce(t)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            first = str(exc)
            break
    failed_after = time.monotonic() - start
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10))
        again = None
    except Exception as exc:  # noqa: BLE001
        again = str(exc)
    return {
        "first": first,
        "failed_after": failed_after,
        "again": again,
        "again_s": time.monotonic() - start,
    }


def test_killed_peer_fails_every_survivor() -> None:
    outcomes = launch(
        killed_peer,
        4,
        SHAPES["2x2"],
        env=subgroup_env(),
        timeout_s=KILL_TIMEOUT_S + 60,
        pg_timeout_s=KILL_TIMEOUT_S,
        abort_grace_s=None,
    )
    assert outcomes[3].status == "crashed", outcomes[3].describe()
    for o in outcomes[:3]:
        assert o.ok, o.describe()
        v = o.value
        assert v["first"] is not None, f"rank {o.rank}: 1000 allreduces passed without rank 3"
        assert v["failed_after"] < KILL_TIMEOUT_S + 5, v
        # Every later call fails at once, with the first error.
        assert v["again"] is not None and "failed earlier" in v["again"], v
        assert v["again_s"] < 1, v
