"""Where the CUDA path must be as safe as NCCL (one GPU, simulated machines:
tests/cuda_jobs.py): what the composition cannot do is left to NCCL, a delegated gather
of a temporary keeps its memory, NCCL local groups with calls in flight, blocking wait,
and a plan that composes nothing.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cuda_jobs import CUDA_MARKS, JOB_ENV, TIMEOUT_S, device, machine_ids
from multiprocess import run_ranks

from fairring_pg.group_info import subgroup_stats

pytestmark = CUDA_MARKS


# -------------------------------------------------- as safe as NCCL (issue 38's checks)


def like_nccl(rank: int, world: int) -> list[dict[str, Any]]:
    """Calls the composition cannot do (complex, float8, unsigned 16/32/64-bit, AVG on
    integers, PREMUL_SUM) go to NCCL's own allreduce, at a size the plan composes: each
    ends as it does on a plain NCCL group of the same ranks (the same values, or an
    error where NCCL raises one), never with an error of fairring's."""
    dev = device()
    nccl = dist.new_group(backend="nccl")
    n = 1 << 20
    kinds: list[tuple[str, torch.dtype, Any]] = [
        ("complex64-SUM", torch.complex64, dist.ReduceOp.SUM),
        ("uint16-MAX", torch.uint16, dist.ReduceOp.MAX),
        ("uint32-SUM", torch.uint32, dist.ReduceOp.SUM),
        ("uint64-MIN", torch.uint64, dist.ReduceOp.MIN),
        ("float8_e4m3fn-SUM", torch.float8_e4m3fn, dist.ReduceOp.SUM),
        ("int32-AVG", torch.int32, dist.ReduceOp.AVG),
        ("float32-PREMUL_SUM", torch.float32, dist._make_nccl_premul_sum(0.5)),
    ]
    out = []
    for name, dtype, op in kinds:
        ends = []
        for group in (None, nccl):
            base = (torch.arange(n, dtype=torch.float64) % 7 + rank).to(dtype).to(dev)
            try:
                dist.all_reduce(base, op=op, group=group)
                torch.cuda.synchronize()
                ends.append(("ok", base.cpu().view(torch.uint8)))
            except Exception as exc:  # noqa: BLE001 - compared with NCCL's own outcome
                ends.append(("error", type(exc).__name__))
        same = ends[0][0] == ends[1][0] and (
            torch.equal(ends[0][1], ends[1][1]) if ends[0][0] == "ok" else ends[0][1] == ends[1][1]
        )
        out.append({"kind": name, "fairring": ends[0][0], "nccl": ends[1][0], "same": same})
    return out


def test_cuda_what_the_composition_cannot_do_is_left_to_nccl() -> None:
    results = run_ranks(
        like_nccl, 2, machine_ids(2), backend="fairring", env=JOB_ENV, timeout_s=TIMEOUT_S
    )
    for rank, rows in enumerate(results):
        for row in rows:
            assert row["same"], (rank, row)


def gathered_temporary(rank: int, world: int, rounds: int) -> str | None:
    """The async all-gather of a temporary (``x[:, 0].contiguous()``), then the caller's
    stream allocates and writes blocks of its size: a hold released before NCCL ran
    would hand the temporary's block to those, and the gathered values would show it."""
    dev = device()
    n = 1 << 20
    for i in range(rounds):
        x = torch.stack([torch.full((n,), float(1000 * rank + i), device=dev)] * 2, dim=1)
        torch.cuda._sleep(50_000_000)  # keep NCCL behind the caller's stream
        out = torch.empty(world * n, device=dev)
        work = dist.all_gather_into_tensor(out, x[:, 0].contiguous(), async_op=True)
        del x
        for _ in range(4):
            torch.full((n,), -1.0, device=dev)
        work.wait()
        want = torch.cat([torch.full((n,), float(1000 * r + i)) for r in range(world)])
        if not torch.equal(out.cpu(), want):
            return f"round {i}: all-gather of a temporary read reused memory"
    return None


@pytest.mark.parametrize("path", ["auto", "lanes"])
def test_cuda_delegated_gather_of_a_temporary_keeps_its_memory(path: str) -> None:
    results = run_ranks(
        gathered_temporary,
        2,
        machine_ids(2),
        backend="fairring",
        env={**JOB_ENV, "FAIRRING_CUDA_ALLREDUCE": path},
        timeout_s=TIMEOUT_S,
        rounds=20,
    )
    assert results == [None, None], results


def nccl_local_groups(rank: int, world: int, calls: int) -> dict[str, Any]:
    """2 x 2 with NCCL local groups: each rank its own NCCL host (so that NCCL takes two
    ranks of a simulated machine on one GPU), several composed calls in flight at once,
    every result exact; under a short group timeout, a deadlock would be the watchdog's
    error instead of a hang. Four processes share the GPU: the communicators fit it only
    with run_cuda_tests.sh's NCCL_MAX_NCHANNELS=4 (else the plan composes nothing)."""
    os.environ["NCCL_HOSTID"] = f"gpu-rank{rank}"
    dist.init_process_group("fairring", timeout=timedelta(seconds=60))
    dev = device()
    tensors = [
        torch.full((3 << 20,), float((rank + 1) * (i + 1)), device=dev) for i in range(calls)
    ]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    total = world * (world + 1) // 2
    exact = all(
        torch.equal(t.cpu(), torch.full((3 << 20,), float(total * (i + 1))))
        for i, t in enumerate(tensors)
    )
    stats = subgroup_stats(None, "cuda")
    dist.destroy_process_group()
    return {"exact": exact, "stats": stats}


def test_cuda_nccl_local_groups_with_calls_in_flight() -> None:
    results = run_ranks(
        nccl_local_groups,
        4,
        machine_ids(2, local=2),
        backend="fairring",
        env={
            **JOB_ENV,
            "FAIRRING_SLICE_SIZE": str(1 << 20),
            "FAIRRING_TOTAL_MEMORY": str(16 << 20),
        },
        timeout_s=TIMEOUT_S,
        init_group=False,
        calls=6,
    )
    for r in results:
        assert r["exact"], r
        assert r["stats"]["composed_calls"] == 6 and r["stats"]["sliced_units"] >= 18, r


def issue_under_blocking_wait(rank: int, world: int) -> dict[str, Any]:
    """Under TORCH_NCCL_BLOCKING_WAIT=1 an async composed allreduce issued behind a long
    kernel returns before the device gets to it (no step waited on the host), and
    wait() then blocks until it is done, exact."""
    dev = device()
    t = torch.full((8 << 20,), float(rank + 1), device=dev)
    dist.all_reduce(t)  # connects
    torch.cuda.synchronize()
    t.fill_(float(rank + 1))
    torch.cuda._sleep(400_000_000)  # about 0.2-0.3 s of device time
    start = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    issue_s = time.perf_counter() - start
    work.wait()
    wait_s = time.perf_counter() - start
    exact = torch.equal(t.cpu(), torch.full((8 << 20,), float(world * (world + 1) // 2)))
    return {"issue_s": issue_s, "wait_s": wait_s, "exact": exact}


def test_cuda_blocking_wait_does_not_serialise_the_steps() -> None:
    results = run_ranks(
        issue_under_blocking_wait,
        2,
        machine_ids(2),
        backend="fairring",
        env={**JOB_ENV, "TORCH_NCCL_BLOCKING_WAIT": "1", "FAIRRING_SLICE_SIZE": str(1 << 20)},
        timeout_s=TIMEOUT_S,
    )
    for r in results:
        assert r["exact"], r
        assert r["issue_s"] < r["wait_s"] / 4, r


def direct_plan(rank: int, world: int) -> dict[str, Any]:
    """Where the plan composes nothing (one rank per machine under auto), every CUDA
    allreduce is NCCL's own Work: 8 B to 1 MiB exact, and captured into a CUDA graph."""
    dev = device()
    exact = []
    for nbytes in (8, 256, 4096, 65536, 1 << 20):
        t = torch.full((nbytes // 4,), float(rank + 1), device=dev)
        dist.all_reduce(t)
        exact.append(
            torch.equal(t.cpu(), torch.full((nbytes // 4,), float(world * (world + 1) // 2)))
        )
    t = torch.ones(1 << 18, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(t)
    t.fill_(float(rank + 2))
    graph.replay()
    torch.cuda.synchronize()
    replayed = torch.equal(t.cpu(), torch.full((1 << 18,), float(sum(r + 2 for r in range(world)))))
    return {"exact": exact, "replayed": replayed, "stats": subgroup_stats(None, "cuda")}


def test_cuda_a_plan_that_composes_nothing_is_nccl_alone() -> None:
    results = run_ranks(direct_plan, 2, machine_ids(2), backend="fairring", timeout_s=TIMEOUT_S)
    for r in results:
        assert all(r["exact"]) and r["replayed"], r
        assert r["stats"] is None, r  # no sub-group path at all: nothing of fairring's
