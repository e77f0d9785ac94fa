"""Every valid program completes: collectives of every kind in flight together, whatever
each rank waits on before it issues the next one (docs/design.md, "Message order across
kinds").

c10d asks only that every rank issues the same collectives in the same order; a rank
may wait on any earlier result before it issues more. A rank that has not issued an
operation yet cannot take its messages, so a peer's message for a later operation must
never stand in front of one for an earlier operation on a connection. Gloo and NCCL
complete every such program, so must fairring.

Each case issues a pair of collectives (any two of allreduce, reduce-scatter and
all-gather, in tensor, list and coalesced forms): every rank issues the first
asynchronously; one rank (each rank in turn) waits for it before it issues the second;
the others issue the second at once and wait for both, the later first. Sizes: a big
first operation (many slices and pipeline chunks) and a small second one, and both big.
Staging: the default pool and a single slot. The group's timeout is short, so a hang
fails its case in seconds (and, the group having failed, the cases after it at once)
instead of stopping the job; results must be exact.

Also here: barrier() waits for earlier operations (as Gloo's does), collectives of
another kind issued from a callback, and random programs (seeded sequences of every
form with per-rank waits, sizes and sync/async calls).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from collective_forms import FORMS, Issued, issue
from multiprocess import SHAPES, fairring_env

from fairring_pg.sizing import staging_slot_bytes

KINDS = ("allreduce", "reduce_scatter", "all_gather")
SLICE = 64 * 1024
CHUNK = 8 * 1024
# Elements per rank (int64): "big" spans many 64 KiB slices and 8 KiB pipeline chunks.
BIG = 20_000
SMALL = 100
GROUP_TIMEOUT_S = 20
JOB_TIMEOUT_S = 400


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    kind: str  # "pair", "barrier", "callback", "random"
    first: str = ""
    second: str = ""
    waiter: int = -1
    sizes: tuple[int, int] = (BIG, SMALL)
    seed: int = 0


def pair_cases(world: int, forms: bool) -> list[Case]:
    cases = []
    pairs = [(a, b) for a in KINDS for b in KINDS]
    if forms:
        # Each list and coalesced form once first (before an all-gather, which sends
        # along the rail at once) and once second (after an allreduce).
        others = [f for f in FORMS if f not in KINDS]
        pairs += [(f, "all_gather") for f in others] + [("allreduce", f) for f in others]
    for first, second in pairs:
        for waiter in range(world):
            base = first in KINDS and second in KINDS
            size_sets = [(BIG, SMALL), (BIG, BIG)] if base else [(BIG, SMALL)]
            for sizes in size_sets:
                tag = "big_small" if sizes[1] == SMALL else "equal"
                cases.append(
                    Case(
                        f"{first}-then-{second}-waiter{waiter}-{tag}",
                        "pair",
                        first,
                        second,
                        waiter,
                        sizes,
                    )
                )
    return cases


def extra_cases(world: int) -> list[Case]:
    cases = [
        Case(f"barrier-after-{k}-waiter{w}", "barrier", k, waiter=w)
        for k in FORMS
        for w in (-1, world - 1)
    ]
    cases += [Case(f"callback-{a}-issues-{b}", "callback", a, b) for a in KINDS for b in KINDS]
    cases += [Case(f"random-program-{s}", "random", seed=s) for s in range(3)]
    return cases


def _finish(ops: list[Issued]) -> str | None:
    errors = []
    for op in ops:
        op.wait()
    for op in ops:
        err = op.check()
        if err:
            errors.append(err)
    return "; ".join(errors) or None


def _pair(rank: int, case: Case) -> str | None:
    first = issue(case.first, f"{case.id}/a", case.sizes[0])
    if rank == case.waiter:
        first.wait()
        err = first.check()
        if err:
            return f"before the second was issued: {err}"
    second = issue(case.second, f"{case.id}/b", case.sizes[1])
    second.wait()
    return _finish([first, second])


def _barrier(rank: int, case: Case) -> str | None:
    # An operation in flight, then barrier(): past it the operation is done and its
    # result in place on every rank, as after Gloo's barrier, before anyone waits on it.
    op = issue(case.first, case.id, BIG)
    if rank == case.waiter:
        op.wait()
    dist.barrier()
    if op.work is not None and hasattr(op.work, "is_completed") and not op.work.is_completed():
        return "Work.is_completed() is False after barrier()"
    err = op.check()
    op.wait()
    return f"after barrier(), before wait(): {err}" if err else None


def _callback(rank: int, case: Case) -> str | None:
    # A callback of the first operation issues a collective of another kind (as comm
    # hooks do), while the program issues more of its own.
    first = issue(case.first, f"{case.id}/a", BIG)
    nested: list[Issued] = []

    def hook(fut: torch.futures.Future) -> int:
        op = issue(case.second, f"{case.id}/b", SMALL)
        op.wait()
        nested.append(op)
        return 1

    chained = first.work.get_future().then(hook)
    third = issue(case.second, f"{case.id}/c", BIG)
    chained.wait()
    return _finish([first, third, *nested])


def _random_program(rank: int, world: int, case: Case) -> str | None:
    # The same sequence of collectives on every rank (seeded by the case); each rank
    # decides on its own when to wait on what, and which calls are synchronous.
    program = random.Random(f"{case.id}")
    mine = random.Random(f"{case.id}/{rank}")
    pending: list[Issued] = []
    done: list[Issued] = []
    for i in range(30):
        form = program.choice(FORMS)
        numel = program.choice((1, 7, 100, 1001, BIG))
        op = issue(form, f"{case.id}/{i}", numel)
        if mine.random() < 0.2:
            op.wait()  # a synchronous call
        pending.append(op)
        while pending and mine.random() < 0.3:
            waited = pending.pop(mine.randrange(len(pending)))
            waited.wait()
            done.append(waited)
    mine.shuffle(pending)
    return _finish(done + pending)


def run_case(rank: int, world: int, case: Case) -> str | None:
    if case.kind == "pair":
        return _pair(rank, case)
    if case.kind == "barrier":
        return _barrier(rank, case)
    if case.kind == "callback":
        return _callback(rank, case)
    if case.kind == "random":
        return _random_program(rank, world, case)
    raise ValueError(case.kind)


def _machines_and_local(shape: str) -> tuple[int, int]:
    ids = SHAPES[shape]
    machines = len(set(ids))
    return machines, len(ids) // machines


def _job(shape: str, staging: str) -> CaseJob:
    world = len(SHAPES[shape])
    machines, local = _machines_and_local(shape)
    one_slot = staging_slot_bytes(SLICE, machines, local)
    cases = pair_cases(world, forms=shape == "2x2") + extra_cases(world)
    return CaseJob(
        f"kind order {shape}, {staging} staging",
        run_case,
        cases,
        SHAPES[shape],
        env=fairring_env(
            total_memory=one_slot if staging == "one_slot" else None,
            slice_size=SLICE,
            FAIRRING_SLICE_SCALING="off",
            FAIRRING_PIPELINE_CHUNK=CHUNK,
        ),
        timeout_s=JOB_TIMEOUT_S,
        pg_timeout_s=GROUP_TIMEOUT_S,
    )


JOBS = {
    f"{shape}-{staging}": _job(shape, staging)
    for shape in ("2x2", "3x1", "1x3", "2x3")
    for staging in ("default", "one_slot")
}


def _groups(job: CaseJob) -> dict[str, list[str]]:
    """Case ids by test: pairs by (first, second), the rest one test each."""
    out: dict[str, list[str]] = {}
    for case in job.cases:
        key = f"{case.first}-then-{case.second}" if case.kind == "pair" else case.id
        out.setdefault(key, []).append(case.id)
    return out


@pytest.mark.parametrize(
    ("job", "group"),
    [pytest.param(j, g, id=f"{j}-{g}") for j, job in JOBS.items() for g in _groups(job)],
)
def test_kind_order(job: str, group: str) -> None:
    errors = JOBS[job].errors()
    failed = {i: errors[i] for i in _groups(JOBS[job])[group] if errors[i]}
    if failed:
        pytest.fail(
            f"{len(failed)} case(s) failed on {JOBS[job].machine_ids}:\n"
            + "\n".join(f"  {i}: rank {r}: {e}" for i, errs in failed.items() for r, e in errs[:3])
        )
