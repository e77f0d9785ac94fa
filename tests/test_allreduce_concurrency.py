"""Many allreduces in flight over a staging pool far smaller than the data.

DESIGN.md's deadlock hazard: a pipe delivers in order, so a receiver that stalls it
waiting for a staging slot only a later message would free never wakes up. These jobs
give fairring one staging slot (or a few) and put megabytes of allreduces in flight at
once, waited in reverse and in (per-rank) random order, mixed with delegated
collectives. Every result must be exact, and nothing may hang (the harness kills a job
at its deadline and names the case each rank was in).

Collectives are issued in the same order on every rank, from one thread.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import DEFAULT_BACKEND, SHAPES, fairring_env
from test_allreduce import reduce_exact
from values import compare_exact, make_values

BACKEND = DEFAULT_BACKEND
SLICE_SIZE = 4 * 1024
# One staging slot of a 4 KiB slice on 2x2 is 3136 bytes (fairring_pg.config.
# staging_slot_bytes); 4 KiB holds one slot, 10 KiB three. On 3x1 a slot is 2816
# bytes: 6 KiB holds two.
ONE_SLOT = 4 * 1024
THREE_SLOTS = 10 * 1024
TWO_SLOTS_3X1 = 6 * 1024
# The one-slot and 3x1 jobs cut each slice into pipeline chunks (about 4 per slice), so
# the chunks of a slice share its slot while many allreduces wait for one; the
# three-slot jobs keep one chunk per slice.
CHUNK = "1K"
JOB_TIMEOUT_S = 150

SIZES = (0, 1, 7, 100, 1000, 3000, 10_000, 30_000)
MIXES = (("SUM", "float32"), ("MAX", "int64"), ("SUM", "bfloat16"), ("PRODUCT", "int32"))


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    kind: str
    count: int = 100
    numel: int = 0  # for "big"


@dataclasses.dataclass(frozen=True)
class _Op:
    """One allreduce of a batch: an input id for make_values, op, dtype, size."""

    key: str
    op: str
    dtype: str
    numel: int


def _batch(case: Case) -> list[_Op]:
    """The same assorted allreduces on every rank (seeded by the case only)."""
    rng = random.Random(case.id)
    out = []
    for i in range(case.count):
        op, dtype = rng.choice(MIXES)
        out.append(_Op(f"{case.id}/{i}", op, dtype, rng.choice(SIZES)))
    return out


def _inputs(op: _Op, world: int) -> list[torch.Tensor]:
    dtype = getattr(torch, op.dtype)
    return [
        make_values(op.key, r, op.op, op.dtype, op.numel, world).to(dtype) for r in range(world)
    ]


def _check(i: int, op: _Op, got: torch.Tensor, inputs: list[torch.Tensor]) -> str | None:
    expected = reduce_exact(inputs, op.op, op.dtype)
    return compare_exact(got, expected, f"allreduce #{i} ({op.op} {op.dtype} x{op.numel})")


def _issue_all(rank: int, world: int, batch: list[_Op]) -> tuple[list, list, list]:
    tensors, works, inputs = [], [], []
    for op in batch:
        ins = _inputs(op, world)
        t = ins[rank].clone()
        works.append(dist.all_reduce(t, op=getattr(dist.ReduceOp, op.op), async_op=True))
        tensors.append(t)
        inputs.append(ins)
    return tensors, works, inputs


def _batch_in_order(rank: int, world: int, case: Case) -> str | None:
    batch = _batch(case)
    tensors, works, inputs = _issue_all(rank, world, batch)
    order = list(range(len(batch)))[::-1]
    if case.kind == "random":
        # A different order on every rank.
        random.Random(f"{case.id}/{rank}").shuffle(order)
    if case.kind == "wait_all_futures":
        torch.futures.wait_all([w.get_future() for w in works])
    else:
        for i in order:
            works[i].wait()
    errors = [_check(i, batch[i], tensors[i], inputs[i]) for i in order]
    errors = [e for e in errors if e]
    return None if not errors else f"{len(errors)} wrong: " + "; ".join(errors[:5])


def _big(rank: int, world: int, case: Case) -> str | None:
    # Far larger than the staging pool, alone.
    op = _Op(case.id, "SUM", "float32", case.numel)
    inputs = _inputs(op, world)
    t = inputs[rank].clone()
    dist.all_reduce(t)
    return _check(0, op, t, inputs)


def _big_and_small(rank: int, world: int, case: Case) -> str | None:
    # Big tensors in flight with small ones queued behind and between them.
    batch = [
        _Op(f"{case.id}/{i}", "SUM", "float32", 300_000 if i % 10 == 0 else 50)
        for i in range(case.count)
    ]
    tensors, works, inputs = _issue_all(rank, world, batch)
    for i in reversed(range(len(batch))):
        works[i].wait()
    errors = [_check(i, batch[i], tensors[i], inputs[i]) for i in range(len(batch))]
    errors = [e for e in errors if e]
    return None if not errors else f"{len(errors)} wrong: " + "; ".join(errors[:5])


def _with_delegated(rank: int, world: int, case: Case) -> str | None:
    # Allreduces (fairring's own path) and delegated collectives in flight together.
    batch = _batch(case)
    tensors, works, inputs = [], [], []
    others = []
    for i, op in enumerate(batch):
        ins = _inputs(op, world)
        t = ins[rank].clone()
        works.append(dist.all_reduce(t, op=getattr(dist.ReduceOp, op.op), async_op=True))
        tensors.append(t)
        inputs.append(ins)
        if i % 5 == 0:
            src = i % world
            b = torch.full((257,), float(rank))
            others.append(("broadcast", src, b, dist.broadcast(b, src=src, async_op=True)))
            g = [torch.empty(3, dtype=torch.int64) for _ in range(world)]
            mine = torch.full((3,), rank * 1000 + i, dtype=torch.int64)
            others.append(("all_gather", i, g, dist.all_gather(g, mine, async_op=True)))
    errors = []
    for kind, arg, out, work in reversed(others):
        work.wait()
        if kind == "broadcast" and not torch.equal(out, torch.full((257,), float(arg))):
            errors.append(f"broadcast from {arg} wrong")
        if kind == "all_gather":
            want = [torch.full((3,), r * 1000 + arg, dtype=torch.int64) for r in range(world)]
            if not all(torch.equal(a, b) for a, b in zip(out, want, strict=True)):
                errors.append(f"all_gather #{arg} wrong")
    for i in reversed(range(len(batch))):
        works[i].wait()
        err = _check(i, batch[i], tensors[i], inputs[i])
        if err:
            errors.append(err)
    return None if not errors else f"{len(errors)} wrong: " + "; ".join(errors[:5])


def _repeated_batches(rank: int, world: int, case: Case) -> str | None:
    # Back-to-back batches: slots must be reusable after everything was waited.
    for rep in range(5):
        sub = dataclasses.replace(case, id=f"{case.id}/{rep}", kind="reverse", count=20)
        err = run_case(rank, world, sub)
        if err:
            return f"batch {rep}: {err}"
    return None


def run_case(rank: int, world: int, case: Case) -> str | None:
    if case.kind in ("reverse", "random", "wait_all_futures"):
        return _batch_in_order(rank, world, case)
    if case.kind == "big":
        return _big(rank, world, case)
    if case.kind == "big_and_small":
        return _big_and_small(rank, world, case)
    if case.kind == "with_delegated":
        return _with_delegated(rank, world, case)
    if case.kind == "repeated_batches":
        return _repeated_batches(rank, world, case)
    raise ValueError(case.kind)


CASES = [
    Case("reverse-100", "reverse"),
    Case("random_order-100", "random"),
    Case("wait_all_futures-100", "wait_all_futures"),
    Case("big-2M-float32", "big", numel=2_000_000),
    Case("big_and_small-40", "big_and_small", count=40),
    Case("with_delegated-100", "with_delegated"),
    Case("repeated_batches", "repeated_batches"),
]

JOBS = {
    "2x2-one_slot": CaseJob(
        "concurrency 2x2, one staging slot",
        run_case,
        CASES,
        SHAPES["2x2"],
        backend=BACKEND,
        env=fairring_env(
            total_memory=ONE_SLOT,
            slice_size=SLICE_SIZE,
            FAIRRING_SLICE_SCALING="off",
            FAIRRING_PIPELINE_CHUNK=CHUNK,
        ),
        timeout_s=JOB_TIMEOUT_S,
    ),
    "2x2-three_slots": CaseJob(
        "concurrency 2x2, three staging slots",
        run_case,
        CASES,
        SHAPES["2x2"],
        backend=BACKEND,
        env=fairring_env(
            total_memory=THREE_SLOTS, slice_size=SLICE_SIZE, FAIRRING_SLICE_SCALING="off"
        ),
        timeout_s=JOB_TIMEOUT_S,
    ),
    "interleaved-three_slots": CaseJob(
        "concurrency interleaved, three staging slots",
        run_case,
        [c for c in CASES if c.kind in ("random", "with_delegated")],
        SHAPES["interleaved"],
        backend=BACKEND,
        env=fairring_env(
            total_memory=THREE_SLOTS, slice_size=SLICE_SIZE, FAIRRING_SLICE_SCALING="off"
        ),
        timeout_s=JOB_TIMEOUT_S,
    ),
    "3x1-two_slots": CaseJob(
        "concurrency 3x1, two staging slots",
        run_case,
        [c for c in CASES if c.kind in ("random", "with_delegated", "big_and_small")],
        SHAPES["3x1"],
        backend=BACKEND,
        env=fairring_env(
            total_memory=TWO_SLOTS_3X1,
            slice_size=SLICE_SIZE,
            FAIRRING_SLICE_SCALING="off",
            FAIRRING_PIPELINE_CHUNK=CHUNK,
        ),
        timeout_s=JOB_TIMEOUT_S,
    ),
}


@pytest.mark.parametrize(
    ("job", "case_id"),
    [pytest.param(j, i, id=f"{j}-{i}") for j, job in JOBS.items() for i in job.case_ids],
)
def test_concurrent_allreduce(job: str, case_id: str) -> None:
    JOBS[job].check(case_id)
