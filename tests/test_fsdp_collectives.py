"""Exact reduce-scatter and all-gather results on simulated clusters (fairring's engine).

One job per cluster shape (2x2, 3x1, 1x3) runs every case on every rank
(multiprocess.CaseJob). Each rank's input is generated from (case, rank), so every rank
computes the exact expected result from all ranks' inputs, in float64/int64, then cast.
Values are wide enough to show the dtype's width and precision: int16 beyond int8's
range, int64 beyond int32's, floats with fractions (quarters), float64 beyond float32's
precision; every partial sum is exact in the dtype, so any order of reduction gives the
same bits and a wrong or missing term shows.

The jobs run with a 4 KiB slice, 64 KiB of staging and 1 KiB pipeline chunks, so parts of
a few thousand elements cross many slices and segments, and the largest cases are many
times the staging pool. Sizes per rank: 0, 1, 7 and 1001 (not divisible by L or M), 5000.

Bad input runs in one 2x2 job, each case on a fresh group: the group is unusable after a
refusal (every rank raises with the reason), so later cases must not share it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import SHAPES, fairring_env
from values import compare_exact, make_values

JOB_ENV = fairring_env(
    total_memory=64 * 1024,
    slice_size=4 * 1024,
    FAIRRING_SLICE_SCALING="off",
    FAIRRING_PIPELINE_CHUNK="1K",
)
JOB_TIMEOUT_S = 300

OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")
DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool",)
SIZES = (0, 1, 7, 1001, 5000)  # elements per rank


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    kind: str  # see run_case
    op: str = "SUM"
    dtype: str = "float32"
    numel: int = 7  # per rank


def build_cases() -> list[Case]:
    cases: list[Case] = []
    for dtype in DTYPES:
        for op in OPS:
            if op == "AVG" and dtype not in FLOAT_DTYPES:
                continue
            for n in SIZES:
                cases.append(Case(f"rs-{op}-{dtype}-n{n}", "rs", op, dtype, n))
        for n in SIZES:
            cases.append(Case(f"ag-{dtype}-n{n}", "ag", "SUM", dtype, n))
    for kind in ("rs_list", "rs_coalesced", "rs_strided", "rs_inplace", "rs_async"):
        for op, dtype in (("SUM", "float32"), ("MAX", "int16"), ("AVG", "float64")):
            cases.append(Case(f"{kind}-{op}-{dtype}", kind, op, dtype, 1001))
    for kind in ("ag_list", "ag_coalesced", "ag_strided", "ag_inplace", "ag_async"):
        for dtype in ("float32", "int16", "bfloat16"):
            cases.append(Case(f"{kind}-{dtype}", kind, "SUM", dtype, 1001))
    cases.append(Case("interleaved-in-flight", "interleaved", "SUM", "float32", 3000))
    cases.append(Case("avg_int_refused-int32", "avg_int", "AVG", "int32", 7))
    cases.append(Case("after-rs-SUM-float32", "rs", "SUM", "float32", 1001))
    return cases


# ----------------------------------------------------------------- inputs, references


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _exact(dtype: str) -> torch.dtype:
    """Where the reference reduces: float64 for floats, int64 for the rest."""
    return torch.float64 if dtype in FLOAT_DTYPES else torch.int64


def reduce_exact(inputs: list[torch.Tensor], op: str, dtype: str) -> torch.Tensor:
    """The reduction of wide inputs, cast to ``dtype``."""
    stacked = torch.stack(inputs)
    if dtype == "bool":
        out = stacked.amax(0) if op in ("SUM", "MAX") else stacked.amin(0)
        return out.to(torch.bool)
    if op == "SUM":
        out = stacked.sum(0)
    elif op == "AVG":
        out = stacked.sum(0) / len(inputs)
    elif op == "MIN":
        out = stacked.amin(0)
    elif op == "MAX":
        out = stacked.amax(0)
    else:
        out = stacked.prod(0)
    if dtype not in FLOAT_DTYPES and out.numel():
        info = torch.iinfo(_dtype(dtype))
        assert info.min <= int(out.min()) and int(out.max()) <= info.max, (op, dtype)
    if dtype in FLOAT_DTYPES:
        # A self-check of the test data: the reference is exact in the dtype.
        assert torch.equal(out.to(_dtype(dtype)).to(torch.float64), out), (op, dtype)
    return out.to(_dtype(dtype))


def big_inputs(case: Case, world: int, tag: str = "") -> list[torch.Tensor]:
    """Every rank's world x numel input of a reduce-scatter (wide)."""
    return [
        make_values(
            case.id + tag, r, case.op, case.dtype, world * case.numel, world, "fractions"
        ).to(_exact(case.dtype))
        for r in range(world)
    ]


def rs_expected(inputs: list[torch.Tensor], rank: int, case: Case) -> torch.Tensor:
    n = case.numel
    return reduce_exact([t[rank * n : (rank + 1) * n] for t in inputs], case.op, case.dtype)


def part_inputs(case: Case, world: int, tag: str = "") -> list[torch.Tensor]:
    """Every rank's numel input of an all-gather, in the dtype."""
    return [
        make_values(case.id + tag, r, "MAX", case.dtype, case.numel, world, "fractions")
        for r in range(world)
    ]


def _op(name: str) -> dist.ReduceOp.RedOpType:
    return getattr(dist.ReduceOp, name)


# ----------------------------------------------------------------- the rank side


def _reduce_scatter(rank: int, world: int, case: Case) -> str | None:
    dt = _dtype(case.dtype)
    n = case.numel
    op = _op(case.op)
    wide = big_inputs(case, world)
    expected = rs_expected(wide, rank, case)
    mine = wide[rank].to(dt)
    before = mine.clone()
    if case.kind in ("rs", "rs_async"):
        out = torch.full((n,), 3, dtype=dt)
        work = dist.reduce_scatter_single(out, mine, op=op, async_op=case.kind == "rs_async")
        if case.kind == "rs_async":
            assert work is not None
            doubled = work.get_future().then(lambda f: f.value()[0].to(torch.float64) * 2).wait()
            if not work.is_completed():
                return "work.is_completed() is False once its future is done"
            err = compare_exact(
                doubled, expected.to(torch.float64) * 2, "value of the chained future"
            )
            if err:
                return err
        return compare_exact(out, expected, "output") or compare_exact(
            mine, before, "input (must not change)"
        )
    if case.kind == "rs_list":
        out = torch.empty(n, dtype=dt)
        dist.reduce_scatter(out, list(mine.chunk(world)), op=op)
        return compare_exact(out, expected, "output")
    if case.kind == "rs_coalesced":
        # Two tensors of different sizes in one coalesced call.
        other = dataclasses.replace(case, numel=13)
        wide2 = big_inputs(other, world, "/2")
        outs = [torch.empty(n, dtype=dt), torch.empty(13, dtype=dt)]
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_single(outs[0], mine, op=op)
            dist.reduce_scatter_single(outs[1], wide2[rank].to(dt), op=op)
        cm.wait()
        return compare_exact(outs[0], expected, "output 0") or compare_exact(
            outs[1], rs_expected(wide2, rank, other), "output 1"
        )
    if case.kind == "rs_strided":
        # A strided input (every other element of a base) and a transposed output.
        base = torch.zeros(2 * world * n, dtype=dt)
        base[::2] = mine
        out_base = torch.full((n, 3), 7, dtype=dt)
        out = out_base[:, 1]
        dist.reduce_scatter_single(out, base[::2], op=op)
        untouched = torch.full((n, 3), 7, dtype=dt)
        untouched[:, 1] = expected
        return compare_exact(
            out_base, untouched, "output base (the view holds the result, the rest unchanged)"
        )
    if case.kind == "rs_inplace":
        # The output is this rank's own part of the input, as FSDP may pass it.
        buf = mine.clone()
        out = buf[rank * n : (rank + 1) * n]
        dist.reduce_scatter_single(out, buf, op=op)
        return compare_exact(out, expected, "output")
    raise ValueError(case.kind)


def _all_gather(rank: int, world: int, case: Case) -> str | None:
    dt = _dtype(case.dtype)
    n = case.numel
    parts = part_inputs(case, world)
    expected = torch.cat(parts)
    mine = parts[rank].clone()
    if case.kind in ("ag", "ag_async"):
        out = torch.full((world * n,), 3, dtype=dt)
        work = dist.all_gather_single(out, mine, async_op=case.kind == "ag_async")
        if case.kind == "ag_async":
            assert work is not None
            got = work.get_future().then(lambda f: f.value()[0].clone()).wait()
            err = compare_exact(got, expected, "value of the chained future")
            if err:
                return err
        return compare_exact(out, expected, "output") or compare_exact(
            mine, parts[rank], "input (must not change)"
        )
    if case.kind == "ag_list":
        outs = [torch.empty(n, dtype=dt) for _ in range(world)]
        dist.all_gather(outs, mine)
        return compare_exact(torch.cat(outs), expected, "outputs")
    if case.kind == "ag_coalesced":
        other = dataclasses.replace(case, numel=13)
        parts2 = part_inputs(other, world, "/2")
        outs = [torch.empty(world * n, dtype=dt), torch.empty(world * 13, dtype=dt)]
        with dist._coalescing_manager(async_ops=True) as cm:
            dist.all_gather_single(outs[0], mine)
            dist.all_gather_single(outs[1], parts2[rank].clone())
        cm.wait()
        return compare_exact(outs[0], expected, "output 0") or compare_exact(
            outs[1], torch.cat(parts2), "output 1"
        )
    if case.kind == "ag_strided":
        base = torch.zeros(3 * n, dtype=dt)
        base[1::3] = mine
        out_base = torch.full((world * n, 2), 7, dtype=dt)
        dist.all_gather_single(out_base[:, 0], base[1::3])
        want = torch.full((world * n, 2), 7, dtype=dt)
        want[:, 0] = expected
        return compare_exact(
            out_base, want, "output base (the view holds the result, the rest unchanged)"
        )
    if case.kind == "ag_inplace":
        out = torch.zeros(world * n, dtype=dt)
        out[rank * n : (rank + 1) * n] = mine
        dist.all_gather_single(out, out[rank * n : (rank + 1) * n])
        return compare_exact(out, expected, "output")
    raise ValueError(case.kind)


def _interleaved(rank: int, world: int, case: Case) -> str | None:
    dt = _dtype(case.dtype)
    n = case.numel
    # Reduce-scatters, all-gathers and allreduces in flight at once, more than the
    # staging holds: each must pair with the same operation on every rank.
    works, checks = [], []
    for i in range(6):
        sub = dataclasses.replace(case, id=f"{case.id}/{i}", numel=n + i)
        if i % 3 == 0:
            wide = big_inputs(sub, world)
            out = torch.empty(sub.numel, dtype=dt)
            works.append(dist.reduce_scatter_single(out, wide[rank].to(dt), async_op=True))
            checks.append((out, rs_expected(wide, rank, sub)))
        elif i % 3 == 1:
            parts = part_inputs(sub, world)
            out = torch.empty(world * sub.numel, dtype=dt)
            works.append(dist.all_gather_single(out, parts[rank].clone(), async_op=True))
            checks.append((out, torch.cat(parts)))
        else:
            wide = big_inputs(sub, world)
            t = wide[rank].to(dt)
            works.append(dist.all_reduce(t, async_op=True))
            checks.append((t, reduce_exact(wide, "SUM", case.dtype)))
    for w in works:
        w.wait()
    for i, (got, want) in enumerate(checks):
        err = compare_exact(got, want, f"operation {i}")
        if err:
            return err
    return None


def _avg_int(rank: int, world: int, case: Case) -> str | None:
    dt = _dtype(case.dtype)
    n = case.numel
    op = _op(case.op)
    # Refused at once, on the rank, as the allreduce refuses it; the group stays usable.
    try:
        dist.reduce_scatter_single(torch.empty(n, dtype=dt), torch.ones(world * n, dtype=dt), op=op)
    except Exception as exc:  # noqa: BLE001 - the message matters
        msg = str(exc)
        return (
            None
            if "AVG" in msg and case.dtype in msg
            else f"error does not name AVG and {case.dtype}: {msg}"
        )
    return "AVG of int32 did not raise"


def run_case(rank: int, world: int, case: Case) -> str | None:
    if case.kind.startswith("rs"):
        return _reduce_scatter(rank, world, case)
    if case.kind.startswith("ag"):
        return _all_gather(rank, world, case)
    if case.kind == "interleaved":
        return _interleaved(rank, world, case)
    if case.kind == "avg_int":
        return _avg_int(rank, world, case)
    raise ValueError(case.kind)


# ----------------------------------------------------------------- bad input

BAD_CASES = (
    "rs_not_world_x_output_all",
    "rs_not_world_x_output_rank2",
    "rs_sizes_differ",
    "ag_sizes_differ",
    "ag_dtypes_differ",
    "rs_list_length",
    "ag_coalesced_sizes",
)


DIFFERS = "differs between ranks"


@dataclasses.dataclass(frozen=True)
class BadCase:
    id: str


def _gather_coalesced(outs: list[torch.Tensor], ins: list[torch.Tensor], group: Any) -> None:
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        for out, inp in zip(outs, ins, strict=True):
            dist.all_gather_single(out, inp, group=group)
    cm.wait()


def _bad_call(
    rank: int, world: int, case_id: str, group: dist.ProcessGroup
) -> tuple[Callable[[], object], str]:
    """The call a bad case makes on this rank, and what every rank's error must say."""
    if case_id.startswith("rs_not_world_x_output"):
        extra = 1 if case_id.endswith("all") or rank == 2 else 0
        inp = torch.ones(world * 4 + extra)
        expect = "input has 17 elements, expected the world size (4) x the output's 4 = 16"
        return functools.partial(
            dist.reduce_scatter_single, torch.empty(4), inp, group=group
        ), expect
    if case_id == "rs_sizes_differ":
        n = 5 if rank == 0 else 4
        inp = torch.ones(world * n)
        return functools.partial(
            dist.reduce_scatter_single, torch.empty(n), inp, group=group
        ), DIFFERS
    if case_id == "ag_sizes_differ":
        n = 6 if rank == 3 else 4
        out = torch.empty(world * n)
        return functools.partial(dist.all_gather_single, out, torch.ones(n), group=group), DIFFERS
    if case_id == "ag_dtypes_differ":
        dt = torch.int32 if rank == 1 else torch.float32
        out, inp = torch.empty(world * 4, dtype=dt), torch.ones(4, dtype=dt)
        return functools.partial(dist.all_gather_single, out, inp, group=group), DIFFERS
    if case_id == "ag_coalesced_sizes":
        # Coalesced: the second output is one element short, on rank 1 only.
        outs = [torch.empty(world * 4), torch.empty(world * 3 - (1 if rank == 1 else 0))]
        ins = [torch.ones(4), torch.ones(3)]
        expect = "output 1 has 11 elements, expected the world size (4) x input 1's 3"
        return functools.partial(_gather_coalesced, outs, ins, group), expect
    assert case_id == "rs_list_length", case_id
    inputs = [torch.ones(4) for _ in range(world - 1 if rank == 3 else world)]
    expect = "the input list has 3 tensors, expected the world size 4"
    return functools.partial(dist.reduce_scatter, torch.empty(4), inputs, group=group), expect


def run_bad_case(rank: int, world: int, case: BadCase) -> str | None:
    """Each case on a fresh group: a refusal fails the group on every rank."""
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=30))
    call, expect = _bad_call(rank, world, case.id, group)
    try:
        call()
        # A rank whose own call went out learns the verdict at its next operation.
        dist.reduce_scatter_single(torch.empty(1), torch.ones(world), group=group)
        return "did not raise"
    except Exception as exc:  # noqa: BLE001 - the message matters
        msg = str(exc)
        if expect not in msg:
            return f"error does not say {expect!r}: {type(exc).__name__}: {msg}"
        return None
    finally:
        dist.destroy_process_group(group)


# ----------------------------------------------------------------- the pytest side

JOB_SHAPES = ("2x2", "3x1", "1x3")
JOBS = {
    shape: CaseJob(
        f"fsdp collectives {shape}",
        run_case,
        build_cases(),
        SHAPES[shape],
        env=JOB_ENV,
        timeout_s=JOB_TIMEOUT_S,
    )
    for shape in JOB_SHAPES
}
BAD_JOB = CaseJob(
    "fsdp bad input 2x2",
    run_bad_case,
    [BadCase(i) for i in BAD_CASES],
    SHAPES["2x2"],
    env=JOB_ENV,
    timeout_s=120,
)


@pytest.mark.parametrize(
    ("shape", "case_id"),
    [pytest.param(s, i, id=f"{s}-{i}") for s, job in JOBS.items() for i in job.case_ids],
)
def test_fsdp_collectives(shape: str, case_id: str) -> None:
    JOBS[shape].check(case_id)


@pytest.mark.parametrize("case_id", BAD_CASES)
def test_bad_input(case_id: str) -> None:
    BAD_JOB.check(case_id)
