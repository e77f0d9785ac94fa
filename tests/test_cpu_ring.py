"""Which path a CPU allreduce takes (FAIRRING_CPU_ALLREDUCE), and that it is right there.

With one rank per machine the engine's five steps send as many bytes per rank as Gloo's
ring, and on a shaped link the ring was faster from about 1 MiB (docs/design.md, "One
rank per machine"): there, under the model's rule (``model``; ``auto`` times both ways
first, tests/test_measured_choice.py), the program's allreduces of 1 MiB and more whose
dtype and op Gloo reduces go to Gloo's ring; smaller ones, those of other dtypes or ops,
those issued from callbacks, and every allreduce where machines have several ranks
stay on fairring's engine. Each case reads the backend's counters before and after, so
it asserts which path ran, and checks the result against a float64/int64 reference from
every rank's input (and, for floats, that every rank has the same bits).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from collective_forms import issue
from multiprocess import fairring_env
from values import compare, make_values, reference

MIB = 1 << 20
GLOO_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
ENGINE_DTYPES = ("int16", "bool")
OPS = ("SUM", "MIN", "MAX", "PRODUCT")


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    kind: str  # "plain", "view", "coalesced", "callback", "mixed"
    dtype: str = "float32"
    op: str = "SUM"
    nbytes: int = 2 * MIB
    path: str = "ring"  # where it must run: "ring" or "engine"


def _numel(case: Case) -> int:
    return max(1, case.nbytes // torch.empty(0, dtype=getattr(torch, case.dtype)).element_size())


def _stats() -> dict[str, int]:
    backend: Any = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.cpu_allreduce_stats()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def _plain(rank: int, world: int, case: Case) -> tuple[str | None, str]:
    n = _numel(case)
    kind = "small" if case.op == "PRODUCT" or case.dtype == "bool" else "wide"
    inputs = [make_values(case.id, r, case.op, case.dtype, n, world, kind) for r in range(world)]
    want, tolerance = reference(inputs, case.op, case.dtype)
    op = getattr(dist.ReduceOp, case.op)
    if case.kind == "plain":
        t = inputs[rank].clone()
        dist.all_reduce(t, op=op)
        return compare(t, want, tolerance, "result"), _digest(t)
    if case.kind == "view":
        # Every other element of a base twice the size: reduced through a dense copy,
        # written back into the view, the rest of the base untouched.
        base = torch.zeros(2 * n, dtype=inputs[rank].dtype)
        base[::2] = inputs[rank]
        dist.all_reduce(base[::2], op=op)
        return compare(base[::2], want, tolerance, "view") or compare(
            base[1::2], torch.zeros(n, dtype=base.dtype), None, "untouched half"
        ), _digest(base)
    raise ValueError(case.kind)


def _expected(case: Case) -> dict[str, int]:
    """Operations each path must have run for the case."""
    ring = int(case.path == "ring")
    if case.kind == "callback":
        return {"engine": 2, "ring": 0}  # the hooked allreduce, then the callback's
    if case.kind == "mixed":
        return {"engine": 3 - ring, "ring": ring}  # the big one, an all-gather, a reduce-scatter
    return {"engine": 1 - ring, "ring": ring}


def run_case(rank: int, world: int, case: Case) -> str | None:
    before = _stats()
    digest = ""
    if case.kind in ("plain", "view"):
        err, digest = _plain(rank, world, case)
    elif case.kind == "coalesced":
        op = issue("allreduce_coalesced", case.id, _numel(case))
        op.wait()
        err = op.check()
    elif case.kind == "callback":
        # From a callback of a fairring future (a comm hook's place): the callbacks'
        # engine, whatever the size, so that it never interleaves with the program's
        # own allreduces on Gloo differently on each rank.
        first = issue("allreduce", f"{case.id}/a", 10)
        nested = []

        def hook(fut: torch.futures.Future) -> None:
            op = issue("allreduce", f"{case.id}/b", _numel(case))
            op.wait()
            nested.append(op)

        first.work.get_future().then(hook).wait()
        err = first.check() or nested[0].check()
    elif case.kind == "mixed":
        # Ring and engine operations in flight together, one rank waiting on the ring's
        # before it issues the engine's (docs/design.md, "Message order across kinds").
        big = issue("allreduce", f"{case.id}/a", _numel(case))
        if rank == world - 1:
            big.wait()
        small = [issue(f, f"{case.id}/{f}", 1000) for f in ("all_gather", "reduce_scatter")]
        for op in [*small, big]:
            op.wait()
        err = next((e for e in (o.check() for o in (big, *small)) if e), None)
    else:
        raise ValueError(case.kind)
    after = _stats()
    ran = {path: after[path] - before[path] for path in ("engine", "ring")}
    if ran != _expected(case):
        err = (err + "; " if err else "") + f"ran {ran}, expected {_expected(case)}"
    if digest:
        # After the counters: all_gather_object runs collectives of its own.
        digests: list[str] = [""] * world
        dist.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            err = (err + "; " if err else "") + "ranks hold different bits"
    return err


def one_rank_per_machine_cases() -> list[Case]:
    cases = []
    for dtype in GLOO_DTYPES + ENGINE_DTYPES:
        for op in OPS:
            if dtype == "bool" and op == "PRODUCT":
                continue
            path = "ring" if dtype in GLOO_DTYPES else "engine"
            cases.append(Case(f"plain-{op}-{dtype}-2MiB", "plain", dtype, op, 2 * MIB, path))
    cases += [
        Case("plain-SUM-float32-1MiB", "plain", nbytes=MIB),
        Case("plain-SUM-float32-below-1MiB", "plain", nbytes=MIB - 4, path="engine"),
        Case("plain-SUM-float32-64KiB", "plain", nbytes=64 * 1024, path="engine"),
        # Gloo has no AVG: the engine's.
        Case("plain-AVG-float32-2MiB", "plain", op="AVG", path="engine"),
        Case("view-SUM-float32-2MiB", "view"),
        Case("view-MAX-int64-2MiB", "view", "int64", "MAX"),
        Case("coalesced-int64-2MiB", "coalesced", "int64"),
        Case("callback-int64-2MiB", "callback", "int64", path="engine"),
        Case("mixed-int64-2MiB", "mixed", "int64"),
    ]
    return cases


JOBS = {
    "2x1": CaseJob(
        "CPU path choice, 2 machines x 1 rank, the model's rule",
        run_case,
        one_rank_per_machine_cases(),
        ["m0", "m1"],
        env=fairring_env(FAIRRING_CPU_ALLREDUCE="model"),
        timeout_s=300,
        pg_timeout_s=60,
    ),
    "3x1": CaseJob(
        "CPU path choice, 3 machines x 1 rank, the model's rule",
        run_case,
        [c for c in one_rank_per_machine_cases() if c.dtype in ("float32", "int64", "int16")],
        ["m0", "m1", "m2"],
        env=fairring_env(FAIRRING_CPU_ALLREDUCE="model"),
        timeout_s=300,
        pg_timeout_s=60,
    ),
    "2x2": CaseJob(
        "CPU path choice, 2 machines x 2 ranks (the engine saves bytes: never the ring, "
        "never measured)",
        run_case,
        [
            Case("plain-SUM-float32-2MiB", "plain", path="engine"),
            Case("coalesced-int64-2MiB", "coalesced", "int64", path="engine"),
            Case("mixed-int64-2MiB", "mixed", "int64", path="engine"),
        ],
        ["m0", "m0", "m1", "m1"],
        timeout_s=300,
        pg_timeout_s=60,
    ),
    "3x1-engine": CaseJob(
        "FAIRRING_CPU_ALLREDUCE=engine at 3x1",
        run_case,
        [Case("plain-SUM-float32-2MiB", "plain", path="engine")],
        ["m0", "m1", "m2"],
        env=fairring_env(FAIRRING_CPU_ALLREDUCE="engine"),
        timeout_s=300,
        pg_timeout_s=60,
    ),
    "2x2-gloo": CaseJob(
        "FAIRRING_CPU_ALLREDUCE=gloo at 2x2",
        run_case,
        [
            Case("plain-SUM-float32-2MiB", "plain"),
            Case("plain-SUM-float32-64KiB", "plain", nbytes=64 * 1024),
            Case("plain-SUM-int16-64KiB", "plain", "int16", nbytes=64 * 1024, path="engine"),
        ],
        ["m0", "m0", "m1", "m1"],
        env=fairring_env(FAIRRING_CPU_ALLREDUCE="gloo"),
        timeout_s=300,
        pg_timeout_s=60,
    ),
}


@pytest.mark.parametrize(
    ("job", "case_id"),
    [pytest.param(j, i, id=f"{j}-{i}") for j, job in JOBS.items() for i in job.case_ids],
)
def test_cpu_allreduce_path(job: str, case_id: str) -> None:
    JOBS[job].check(case_id)
