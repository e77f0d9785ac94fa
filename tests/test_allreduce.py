"""Exact allreduce results on simulated clusters.

One job per cluster shape runs the whole case list on every rank (multiprocess.CaseJob)
and each case is then its own pytest item. Inputs are small
integers generated from (case, rank), so every rank computes the exact expected result
from all ranks' inputs (in float64/int64, then cast) and float16/bfloat16 sums are exact.

The jobs run with a 4 KiB slice and 64 KiB of staging memory, so anything above a few
thousand elements crosses many slices, and the largest cases are ~100x the staging pool.
The 2x2 and 3x1 jobs cut each slice into pipeline chunks of 1 KiB per local rank
(FAIRRING_PIPELINE_CHUNK), rounded to whole elements per rank, so a slice moves as
several chunks; one machine (1x3) never chunks, and the interleaved job keeps the
default (one chunk per slice there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import warnings
import zlib
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import DEFAULT_BACKEND, SHAPES, fairring_env, run_ranks
from values import (
    FLOAT_DTYPES,
    INT_DTYPES,
    compare,
    compare_exact,
    make_values,
    reduce_op,
    reference,
)

BACKEND = DEFAULT_BACKEND
SLICE_SIZE = 4 * 1024
TOTAL_MEMORY = 64 * 1024
# Slice scaling would grow the slice to 32 KiB here; off, sizes mean what they say.
JOB_ENV = fairring_env(
    total_memory=TOTAL_MEMORY,
    slice_size=SLICE_SIZE,
    FAIRRING_SLICE_SCALING="off",
    FAIRRING_PIPELINE_CHUNK="1K",
)
# The interleaved job keeps the default (scaling on).
SCALED_ENV = fairring_env(total_memory=TOTAL_MEMORY, slice_size=SLICE_SIZE)
JOB_TIMEOUT_S = 300

OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool",)
# Empty, one element, fewer elements than ranks, not divisible by M*L, many slices.
SIZES = (0, 1, 2, 7, 1001, 10_000)
# Views: (base shape from numel, view of the base). The allreduce must write its result
# through the view and leave the rest of the base alone.
VIEW_KINDS = (
    "multidim",
    "transposed",
    "strided",
    "offset",
    "column_block",
    "channels_last",
)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    kind: str  # see run_case
    op: str = "SUM"
    dtype: str = "float32"
    numel: int = 7
    values: str = "small"  # tests/values.py: small, wide or limits


def wide_cases(
    dtypes: tuple[str, ...] = FLOAT_DTYPES + INT_DTYPES, numel: int = 1001
) -> list[Case]:
    """Values that see width and precision (integers also at the ends of their range,
    wrapping around). 1001 elements are a few slices of every dtype at the suite's
    4 KiB slices, and a tail; the many-slice cases are the plain ones of 10,000."""
    cases = []
    for dtype in dtypes:
        ops = OPS if dtype in FLOAT_DTYPES else tuple(o for o in OPS if o != "AVG")
        kinds = ("wide",) if dtype in FLOAT_DTYPES else ("wide", "limits")
        for op, kind in itertools.product(ops, kinds):
            cases.append(Case(f"{kind}-{op}-{dtype}-n{numel}", "plain", op, dtype, numel, kind))
    return cases


def build_cases(shape: str, big_numel: tuple[int, int] = (1_500_000, 600_000)) -> list[Case]:
    """The case list of one job. Cases that must raise come last, followed by one
    allreduce that checks the process group still works after them. ``big_numel``: the
    float32 and int64 sizes of the cases far larger than the staging memory."""
    cases: list[Case] = []
    if shape == "2x3":
        # L != M: every op and a few dtypes through the plans, small and wide values.
        for op, dtype, n in itertools.product(OPS, ("float32", "bfloat16", "int16"), (7, 1001)):
            if not (op == "AVG" and dtype not in FLOAT_DTYPES):
                cases.append(Case(f"{op}-{dtype}-n{n}", "plain", op, dtype, n))
        cases += wide_cases(("float64", "float16", "int16", "int64"))
        n = big_numel[0] // 5
        cases.append(Case(f"big-SUM-float32-n{n}", "plain", "SUM", "float32", n))
        return cases
    if shape == "interleaved":
        combos = [
            (op, dtype, n)
            for op in ("SUM", "MAX", "PRODUCT")
            for dtype in ("float32", "bfloat16", "int32", "bool")
            for n in (2, 7, 1001, 10_000)
        ]
        view_dtypes = [("SUM", "float32")]
        big = [("SUM", "float32", 1_500_000)]
    else:
        combos = [
            (op, dtype, n)
            for op in OPS
            for dtype in DTYPES
            if not (op == "AVG" and dtype not in FLOAT_DTYPES)
            for n in SIZES
        ]
        view_dtypes = [("SUM", "float32"), ("MAX", "int32"), ("SUM", "bfloat16")]
        # Several MB, ~100x the staging memory.
        big = [("SUM", "float32", big_numel[0]), ("MAX", "int64", big_numel[1])]
    for op, dtype, n in combos:
        cases.append(Case(f"{op}-{dtype}-n{n}", "plain", op, dtype, n))
    for op, dtype in view_dtypes:
        for kind in VIEW_KINDS:
            cases.append(Case(f"{kind}-{op}-{dtype}", kind, op, dtype, 0))
    for op, dtype, n in big:
        cases.append(Case(f"big-{op}-{dtype}-n{n}", "plain", op, dtype, n))
    if shape != "interleaved":
        cases += wide_cases()
    cases += [
        Case("async-SUM-float32", "async", "SUM", "float32", 1001),
        Case("async-MAX-int64", "async", "MAX", "int64", 10_000),
        Case("future_then-SUM-float32", "future_then", "SUM", "float32", 1001),
        Case("coalesced-SUM-float32", "coalesced", "SUM", "float32", 0),
        Case("coalesced-MAX-int32", "coalesced", "MAX", "int32", 0),
        Case("complex_sum-complex64", "complex_sum", "SUM", "complex64", 7),
    ]
    if shape != "interleaved":
        cases += [
            Case("avg_fraction-float32", "avg_fraction", "AVG", "float32", 1001),
            Case("avg_fraction-float64", "avg_fraction", "AVG", "float64", 1001),
        ]
        cases += [
            Case(f"avg_error-{dtype}", "avg_error", "AVG", dtype, 7)
            for dtype in INT_DTYPES + ("bool",)
        ]
        cases += [
            Case("unsupported-SUM-complex64", "unsupported", "SUM", "complex64", 7),
            Case("unsupported-MAX-complex64", "unsupported", "MAX", "complex64", 7),
        ]
    cases.append(Case("after_errors-SUM-float32", "plain", "SUM", "float32", 1001))
    return cases


# ----------------------------------------------------------------- inputs, references


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def make_input(rank: int, case: Case, numel: int, world: int) -> torch.Tensor:
    return make_values(case.id, rank, case.op, case.dtype, numel, world, case.values)


def reduce_exact(inputs: list[torch.Tensor], op: str, dtype: str) -> torch.Tensor:
    """The exact reduction of small-integer inputs (tests/values.py's reference)."""
    expected, tolerance = reference(inputs, op, dtype)
    assert tolerance is None or not bool(tolerance.any()), "not exact: use values.reference"
    return expected


def _view_of(
    kind: str, base_numel_hint: int
) -> tuple[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]]:
    """Base shape and the view of it that the allreduce gets."""
    n = base_numel_hint
    if kind == "plain":
        return (n,), lambda b: b
    if kind == "multidim":
        return (3, 5, 7), lambda b: b
    if kind == "transposed":
        return (13, 11), lambda b: b.t()
    if kind == "strided":
        return (2 * 1001,), lambda b: b[::2]
    if kind == "offset":
        return (1001 + 10,), lambda b: b[5 : 5 + 1001]
    if kind == "column_block":
        return (10, 12), lambda b: b[:, 2:7]
    if kind == "channels_last":
        # Dense but not contiguous in the default sense.
        return (2, 3, 4, 5), lambda b: b
    raise ValueError(kind)


def _make_base(rank: int, case: Case, world: int, shape: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for d in shape:
        numel *= d
    base = make_input(rank, case, numel, world).reshape(shape)
    if case.kind == "channels_last":
        base = base.contiguous(memory_format=torch.channels_last)
    return base


# ----------------------------------------------------------------- the rank side


def _plain_or_view(rank: int, world: int, case: Case) -> str | None:
    shape, view_of = _view_of(case.kind, case.numel)
    bases = [_make_base(r, case, world, shape) for r in range(world)]
    base = bases[rank].clone(memory_format=torch.preserve_format)
    view = view_of(base)
    dist.all_reduce(view, op=reduce_op(case.op))
    expected, tolerance = reference([view_of(b) for b in bases], case.op, case.dtype)
    if err := compare(view, expected, tolerance, "result"):
        return err
    # Elements outside the view must not change.
    expected_base = bases[rank].clone(memory_format=torch.preserve_format)
    view_of(expected_base).copy_(view)
    return compare_exact(base, expected_base, "base tensor (elements outside the view)")


def _async_or_future(rank: int, world: int, case: Case) -> str | None:
    inputs = [make_input(r, case, case.numel, world) for r in range(world)]
    expected = reduce_exact(inputs, case.op, case.dtype)
    tensor = inputs[rank].clone()
    work = dist.all_reduce(tensor, op=reduce_op(case.op), async_op=True)
    assert work is not None
    if case.kind == "async":
        work.wait()
        if not work.is_completed():
            return "work.is_completed() is False after wait()"
        return compare_exact(tensor, expected, "result")
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    doubled = fut.wait()
    return compare_exact(doubled, expected * 2, "value of the chained future") or compare_exact(
        tensor, expected, "result"
    )


def _coalesced(rank: int, world: int, case: Case) -> str | None:
    sizes = (5, 1, 1001, 3000)
    all_inputs = [
        [
            make_input(r, dataclasses.replace(case, id=f"{case.id}/{i}"), n, world)
            for i, n in enumerate(sizes)
        ]
        for r in range(world)
    ]
    tensors = [t.clone() for t in all_inputs[rank]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still there
        dist.all_reduce_coalesced(tensors, op=reduce_op(case.op))
    for i, tensor in enumerate(tensors):
        expected = reduce_exact([ins[i] for ins in all_inputs], case.op, case.dtype)
        err = compare_exact(tensor, expected, f"tensor {i} of {len(sizes)}")
        if err:
            return err
    return None


def _complex_sum(rank: int, world: int, case: Case) -> str | None:
    # torch hands complex SUM to the backend as a float view (view_as_real).
    def complex_input(r: int) -> torch.Tensor:
        real = make_values(case.id + "/re", r, "SUM", "float32", case.numel, world)
        imag = make_values(case.id + "/im", r, "SUM", "float32", case.numel, world)
        return torch.complex(real.float(), imag.float())

    inputs = [complex_input(r) for r in range(world)]
    tensor = inputs[rank].clone()
    dist.all_reduce(tensor)
    expected = torch.stack([t.to(torch.complex128) for t in inputs]).sum(0)
    return compare_exact(tensor, expected.to(torch.complex64), "result")


def _avg_fraction(rank: int, world: int, case: Case) -> str | None:
    # Averages that are not integers: compare within a rounding error.
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.id}/{rank}".encode()))
    mine = torch.randint(-50, 51, (case.numel,), generator=gen).to(_dtype(case.dtype))
    inputs = []
    for r in range(world):
        g = torch.Generator().manual_seed(zlib.crc32(f"{case.id}/{r}".encode()))
        inputs.append(torch.randint(-50, 51, (case.numel,), generator=g).to(torch.float64))
    expected = (torch.stack(inputs).sum(0) / world).to(_dtype(case.dtype))
    dist.all_reduce(mine, op=dist.ReduceOp.AVG)
    try:
        torch.testing.assert_close(mine, expected)
    except AssertionError as exc:
        return f"AVG off by more than rounding: {exc}"
    return None


def _avg_error(rank: int, world: int, case: Case) -> str | None:
    tensor = make_input(rank, dataclasses.replace(case, op="SUM"), case.numel, world)
    try:
        work = dist.all_reduce(tensor, op=dist.ReduceOp.AVG, async_op=True)
        assert work is not None
        work.wait()
    except Exception as exc:  # noqa: BLE001 - any error type, the message matters
        msg = str(exc)
        # The dtype as Python users spell it: "int8", not c10's "Char".
        if "AVG" in msg and case.dtype in msg:
            return None
        return f"error does not name 'AVG' and '{case.dtype}': {type(exc).__name__}: {msg}"
    return f"AVG on {case.dtype} did not raise"


def _unsupported(rank: int, world: int, case: Case) -> str | None:
    # Straight to the process group: dist.all_reduce would hand the backend a float
    # view of a complex tensor (and refuse MAX on it itself). A complex SUM may be
    # supported (Gloo does it) but must then be exact; MAX has no meaning on
    # complex numbers and must raise. Either error must name the dtype as Python
    # users know it ("complex64", not c10's "ComplexFloat").
    inputs = [
        torch.complex(
            make_values(case.id, r, "SUM", "float32", case.numel, world).float(),
            make_values(case.id + "/im", r, "SUM", "float32", case.numel, world).float(),
        )
        for r in range(world)
    ]
    tensor = inputs[rank].clone()
    pg = dist.distributed_c10d._get_default_group()
    try:
        pg.allreduce([tensor], reduce_op(case.op)).wait()
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        if case.dtype in msg:
            return None
        return f"error does not name the dtype {case.dtype}: {type(exc).__name__}: {msg}"
    if case.op != "SUM":
        return f"allreduce {case.op} of {case.dtype} did not raise"
    expected = torch.stack([t.to(torch.complex128) for t in inputs]).sum(0)
    return compare_exact(tensor, expected.to(torch.complex64), "result of a complex SUM")


def run_case(rank: int, world: int, case: Case) -> str | None:
    """Run one case on this rank; None if it passed, else what went wrong."""
    if case.kind in ("plain",) + VIEW_KINDS:
        return _plain_or_view(rank, world, case)
    if case.kind in ("async", "future_then"):
        return _async_or_future(rank, world, case)
    if case.kind == "coalesced":
        return _coalesced(rank, world, case)
    if case.kind == "complex_sum":
        return _complex_sum(rank, world, case)
    if case.kind == "avg_fraction":
        return _avg_fraction(rank, world, case)
    if case.kind == "avg_error":
        return _avg_error(rank, world, case)
    if case.kind == "unsupported":
        return _unsupported(rank, world, case)
    raise ValueError(f"unknown case kind {case.kind}")


# ----------------------------------------------------------------- the pytest side

JOB_SHAPES = ("2x2", "3x1", "1x3", "interleaved", "2x3")
JOBS = {
    shape: CaseJob(
        f"allreduce {shape}",
        run_case,
        build_cases(shape),
        SHAPES[shape],
        backend=BACKEND,
        env=SCALED_ENV if shape == "interleaved" else JOB_ENV,
        timeout_s=JOB_TIMEOUT_S,
    )
    for shape in JOB_SHAPES
}


@pytest.mark.parametrize(
    ("shape", "case_id"),
    [pytest.param(s, i, id=f"{s}-{i}") for s, job in JOBS.items() for i in job.case_ids],
)
def test_allreduce(shape: str, case_id: str) -> None:
    JOBS[shape].check(case_id)


# ----------------------------------------------------------------- the same bits every run


def reduced_bits(rank: int, world: int) -> list[str]:
    """Digests of non-integer float allreduces (where the order of summation shows in
    the last bits), each reduced twice in this job."""
    digests = []
    for dtype, op in itertools.product(FLOAT_DTYPES, ("SUM", "AVG", "PRODUCT")):
        inputs = [
            make_values(f"bits-{op}-{dtype}", r, op, dtype, 20_000, world, "wide")
            for r in range(world)
        ]
        for _ in range(2):
            tensor = inputs[rank].clone()
            dist.all_reduce(tensor, op=reduce_op(op))
            raw = tensor.view(torch.uint8).numpy().tobytes()
            digests.append(f"{op}-{dtype}:{hashlib.sha256(raw).hexdigest()[:16]}")
    return digests


def test_same_bits_on_every_rank_and_in_every_run() -> None:
    """README: every rank gets the same bits, and so does every run. Two jobs, each
    reducing the same non-integer inputs twice: all digests of a case are equal."""
    shape = SHAPES["2x2"]
    runs = [
        run_ranks(reduced_bits, len(shape), shape, BACKEND, JOB_ENV, timeout_s=JOB_TIMEOUT_S)
        for _ in range(2)
    ]
    first = runs[0][0]
    for job, per_rank in enumerate(runs):
        for rank, digests in enumerate(per_rank):
            assert digests[0::2] == digests[1::2], f"job {job} rank {rank}: twice in one job"
            assert digests == first, f"job {job} rank {rank} differs from job 0 rank 0"
