"""Every collective other than allreduce, through the fairring process group on CPU
tensors, gives exact results (fairring hands them to Gloo).

One 2x2 job runs all cases. Where Gloo itself does not support a collective, the same
case runs on a plain Gloo job too, and fairring must fail the same way (same exception
type) rather than succeed with a wrong answer or fail differently.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import DEFAULT_BACKEND, SHAPES

BACKEND = DEFAULT_BACKEND
MACHINES = SHAPES["2x2"]


@dataclasses.dataclass(frozen=True)
class Case:
    id: str


def _value(rank: int, tag: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Distinct, exactly representable data per (rank, tag)."""
    return (torch.arange(n, dtype=torch.int64) + 1000 * rank + 100_000 * tag).to(dtype)


def _eq(got: torch.Tensor, want: torch.Tensor, what: str) -> list[str]:
    if got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want):
        return []
    return [f"{what}: got {got.tolist()[:8]}..., expected {want.tolist()[:8]}..."]


def _broadcast(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    for src in range(world):
        t = _value(rank, src, 13)
        dist.broadcast(t, src=src)
        errors += _eq(t, _value(src, src, 13), f"src {src}")
    # int64 and async.
    t = _value(rank, 7, 5, torch.int64)
    dist.broadcast(t, src=3, async_op=True).wait()  # type: ignore[union-attr]
    errors += _eq(t, _value(3, 7, 5, torch.int64), "async int64 from 3")
    return "; ".join(errors) or None


def _all_gather(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    out = [torch.empty(9) for _ in range(world)]
    dist.all_gather(out, _value(rank, 1, 9))
    for r in range(world):
        errors += _eq(out[r], _value(r, 1, 9), f"slot {r}")
    return "; ".join(errors) or None


def _all_gather_into_tensor(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    want = torch.cat([_value(r, 2, 6, torch.int32) for r in range(world)])
    out = torch.empty(world * 6, dtype=torch.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in 2.13
        dist.all_gather_into_tensor(out, _value(rank, 2, 6, torch.int32))
    errors += _eq(out, want, "all_gather_into_tensor")
    out = torch.empty(world * 6, dtype=torch.int32)
    dist.all_gather_single(out, _value(rank, 2, 6, torch.int32))  # its successor
    errors += _eq(out, want, "all_gather_single")
    return "; ".join(errors) or None


def _reduce_scatter(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    inputs = [_value(rank, 3 + j, 5) for j in range(world)]
    out = torch.empty(5)
    dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM)
    want = sum(_value(r, 3 + rank, 5).double() for r in range(world)).float()
    errors += _eq(out, want, "output")
    return "; ".join(errors) or None


def _reduce_scatter_tensor(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    inp = torch.cat([_value(rank, 10 + j, 4) for j in range(world)])
    want = sum(_value(r, 10 + rank, 4).double() for r in range(world)).float()
    out = torch.empty(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in 2.13
        dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
    errors += _eq(out, want, "reduce_scatter_tensor")
    out = torch.empty(4)
    dist.reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM)  # its successor
    errors += _eq(out, want, "reduce_scatter_single")
    return "; ".join(errors) or None


def _reduce(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    for dst in (0, 3):
        t = _value(rank, 20 + dst, 11)
        dist.reduce(t, dst=dst, op=dist.ReduceOp.MAX)
        if rank == dst:
            errors += _eq(t, _value(world - 1, 20 + dst, 11), f"MAX at dst {dst}")
        t = _value(rank, 30 + dst, 11, torch.int64)
        dist.reduce(t, dst=dst, op=dist.ReduceOp.SUM)
        if rank == dst:
            want = sum(_value(r, 30 + dst, 11, torch.int64) for r in range(world))
            errors += _eq(t, want, f"SUM at dst {dst}")
    return "; ".join(errors) or None


def _gather(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    for dst in (0, 2):
        out = [torch.empty(4) for _ in range(world)] if rank == dst else None
        dist.gather(_value(rank, 40, 4), gather_list=out, dst=dst)
        if out is not None:
            for r in range(world):
                errors += _eq(out[r], _value(r, 40, 4), f"dst {dst} slot {r}")
    return "; ".join(errors) or None


def _gather_single(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    # torch >= 2.14: a gather into one flat tensor on dst.
    for dst in (0, 2):
        out = torch.empty(world * 4) if rank == dst else None
        dist.gather_single(_value(rank, 42, 4), out, dst=dst)
        if out is not None:
            want = torch.cat([_value(r, 42, 4) for r in range(world)])
            errors += _eq(out, want, f"dst {dst}")
    return "; ".join(errors) or None


def _scatter(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    for src in (0, 1):
        pieces = [_value(src, 50 + r, 6) for r in range(world)] if rank == src else None
        out = torch.empty(6)
        dist.scatter(out, scatter_list=pieces, src=src)
        errors += _eq(out, _value(src, 50 + rank, 6), f"from src {src}")
    return "; ".join(errors) or None


def _all_to_all(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    inputs = [_value(rank, 60 + j, 3) for j in range(world)]
    out = [torch.empty(3) for _ in range(world)]
    dist.all_to_all(out, inputs)
    for r in range(world):
        errors += _eq(out[r], _value(r, 60 + rank, 3), f"from {r}")
    return "; ".join(errors) or None


def _all_to_all_single(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    inp = torch.cat([_value(rank, 70 + j, 2) for j in range(world)])
    out = torch.empty(2 * world)
    dist.all_to_all_single(out, inp)
    want = torch.cat([_value(r, 70 + rank, 2) for r in range(world)])
    errors += _eq(out, want, "even split")
    # Uneven split: rank r sends r + j + 1 elements to rank j.
    send = [rank + j + 1 for j in range(world)]
    recv = [r + rank + 1 for r in range(world)]
    inp = torch.cat([_value(rank, 80 + j, send[j]) for j in range(world)])
    out = torch.empty(sum(recv))
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
    want = torch.cat([_value(r, 80 + rank, recv[r]) for r in range(world)])
    errors += _eq(out, want, "uneven split")
    return "; ".join(errors) or None


def _send_recv(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    # A ring, both directions, even ranks first to avoid blocking.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.empty(7)
    if rank % 2 == 0:
        dist.send(_value(rank, 90, 7), dst=nxt)
        dist.recv(got, src=prv)
    else:
        dist.recv(got, src=prv)
        dist.send(_value(rank, 90, 7), dst=nxt)
    errors += _eq(got, _value(prv, 90, 7), "ring")
    # isend/irecv, tagged.
    got = torch.empty(3, dtype=torch.int64)
    reqs = [
        dist.isend(_value(rank, 91, 3, torch.int64), dst=prv, tag=5),
        dist.irecv(got, src=nxt, tag=5),
    ]
    for req in reqs:
        req.wait()
    errors += _eq(got, _value(nxt, 91, 3, torch.int64), "isend/irecv")
    return "; ".join(errors) or None


def _recv_any_source(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    # Ranks 1..3 send to rank 0, which receives from whoever comes first.
    if rank == 0:
        senders = []
        for _ in range(world - 1):
            got = torch.empty(4)
            src = dist.recv(got)
            senders.append(src)
            errors += _eq(got, _value(src, 92, 4), f"from {src}")
        if sorted(senders) != list(range(1, world)):
            errors.append(f"senders reported: {senders}")
    else:
        dist.send(_value(rank, 92, 4), dst=0)
    return "; ".join(errors) or None


def _barrier(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    for _ in range(3):
        dist.barrier()
    work = dist.barrier(async_op=True)
    assert work is not None
    work.wait()
    return "; ".join(errors) or None


def _monitored_barrier(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    # dist.monitored_barrier() itself refuses every backend but "gloo" (a check in
    # torch's Python), so go to the process group as a monitored barrier would.
    pg = dist.distributed_c10d._get_default_group()
    pg.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)
    if BACKEND_OF_JOB[0] == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=30))
    return "; ".join(errors) or None


def _objects(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    objs: list[object] = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    want = [{"rank": r, "s": "x" * r} for r in range(world)]
    if objs != want:
        errors.append(f"all_gather_object: {objs}")
    lst: list[object] = [("hello", 1), [2, 3]] if rank == 1 else [None, None]
    dist.broadcast_object_list(lst, src=1)
    if lst != [("hello", 1), [2, 3]]:
        errors.append(f"broadcast_object_list: {lst}")
    return "; ".join(errors) or None


def _new_group(rank: int, world: int, case: Case) -> str | None:
    errors: list[str] = []
    # Sub-groups made with the default backend, and a collective on them.
    group = dist.new_group([1, 2])
    if rank in (1, 2):
        t = _value(rank, 95, 5)
        dist.broadcast(t, src=2, group=group)
        errors += _eq(t, _value(2, 95, 5), "broadcast in [1, 2]")
        t = _value(rank, 96, 5)
        dist.all_reduce(t, group=group)
        errors += _eq(t, _value(1, 96, 5) + _value(2, 96, 5), "all_reduce in [1, 2]")
    dist.barrier()
    return "; ".join(errors) or None


# Each case's rank side: None if it passed, else what went wrong.
_RUNNERS: dict[str, Callable[[int, int, Case], str | None]] = {
    "broadcast": _broadcast,
    "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "reduce": _reduce,
    "gather": _gather,
    "gather_single": _gather_single,
    "scatter": _scatter,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "send_recv": _send_recv,
    "recv_any_source": _recv_any_source,
    "barrier": _barrier,
    "monitored_barrier": _monitored_barrier,
    "objects": _objects,
    "new_group": _new_group,
}


def run_case(rank: int, world: int, case: Case) -> str | None:
    if case.id not in _RUNNERS:
        raise ValueError(case.id)
    return _RUNNERS[case.id](rank, world, case)


# Which backend the rank's job runs (set on the rank by run_case_with_backend).
BACKEND_OF_JOB: list[str] = [""]


def run_case_with_backend(rank: int, world: int, case: Case) -> str | None:
    BACKEND_OF_JOB[0] = dist.get_backend()
    return run_case(rank, world, case)


CASE_IDS = (
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce",
    "gather",
    *(["gather_single"] if hasattr(dist, "gather_single") else []),
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send_recv",
    "recv_any_source",
    "barrier",
    "monitored_barrier",
    "objects",
    "new_group",
)
CASES = [Case(i) for i in CASE_IDS]
# Collectives Gloo refuses with a message naming itself: fairring must hand them to
# Gloo (whose refusal then is the same, word for word), not refuse them on its own.
REFUSED_BY_THE_DELEGATE = {"gather_single"}

JOB = CaseJob("delegation 2x2", run_case_with_backend, CASES, MACHINES, backend=BACKEND)
# Gloo on the same cases: tells which collectives Gloo itself lacks.
GLOO_JOB = CaseJob("delegation 2x2 on gloo", run_case_with_backend, CASES, MACHINES, "gloo")


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_delegated_collective(case_id: str) -> None:
    if BACKEND != "gloo":
        gloo_errors = GLOO_JOB.errors()[case_id]
        if gloo_errors:
            # Gloo cannot do it: fairring must fail the same way, on every rank.
            ours = JOB.errors()[case_id]
            assert len(ours) == len(MACHINES), (
                f"gloo fails {case_id} ({gloo_errors[0][1]}) but fairring does not "
                f"fail it on every rank: {ours}"
            )
            want_type = gloo_errors[0][1].split(":")[0]
            got_types = {err.split(":")[0] for _, err in ours}
            assert got_types == {want_type}, (
                f"{case_id}: gloo fails with {gloo_errors[0][1]!r}, fairring with {ours}"
            )
            if case_id in REFUSED_BY_THE_DELEGATE:
                # First lines: what follows is a C++ stack trace.
                gloo_says = gloo_errors[0][1].splitlines()[0]
                assert {err.splitlines()[0] for _, err in ours} == {gloo_says}, (
                    f"{case_id} did not reach Gloo: gloo fails with {gloo_says!r},"
                    f" fairring with {ours}"
                )
            return
    JOB.check(case_id)
