"""CUDA faults (one GPU, simulated machines: tests/cuda_jobs.py): a killed peer, a destroy
after it, shutdown with work in flight and a size mismatch. The tests marked
``cuda_fault`` run without MPS (scripts/run_cuda_tests.sh): MPS takes every client of
the GPU down with one that dies mid-kernel.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cuda_jobs import CUDA_MARKS, device, machine_ids
from multiprocess import launch
from reliability_helpers import run_bare

pytestmark = CUDA_MARKS


# ------------------------------------------------------------------ faults

FAULT_TIMEOUT_S = 20
# What NCCL, its watchdog or fairring's sub-groups say when a peer is gone (not the
# bare word "NCCL", which any log line of an NCCL job may hold).
NCCL_FAILURE_WORDS = (
    "Watchdog caught collective operation timeout",
    "watchdog thread terminated",
    "NCCL error",
    "ncclRemoteError",
    "ncclSystemError",
    "timed out",
    "failed earlier",
)


def killed_peer(rank: int, world: int) -> None:
    """Rank world-1 dies (SIGKILL) after a few allreduces; the others keep reducing."""
    dev = device()
    t = torch.ones(1 << 20, device=dev)
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(1000):
        dist.all_reduce(t)
        torch.cuda.synchronize()
    return "completed 1000 allreduces without the killed peer"


@pytest.mark.cuda_fault
def test_cuda_killed_peer_fails_every_survivor() -> None:
    start = time.monotonic()
    outcomes = launch(
        killed_peer,
        3,
        machine_ids(3),
        backend="fairring",
        env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
        timeout_s=FAULT_TIMEOUT_S + 90,
        pg_timeout_s=FAULT_TIMEOUT_S,
        abort_grace_s=None,
    )
    elapsed = time.monotonic() - start
    assert outcomes[-1].status == "crashed", outcomes[-1].describe()
    for o in outcomes[:-1]:
        # Under NCCL's error handling a survivor raises from a collective or is torn
        # down by the watchdog; what it must not do is hang until killed, or complete
        # (a returned value: status "ok").
        assert o.status in ("error", "crashed"), o.describe()
        if o.status == "error":
            # Raised by the collectives, not by the test's own code or the start-up.
            assert o.phase == "fn" and o.error_type not in ("AssertionError",), o.describe()
            text = o.error_message or ""
        else:
            text = o.log_tail  # the watchdog's last words before it aborted the process
        assert any(w in text for w in NCCL_FAILURE_WORDS), o.describe()
    assert elapsed < FAULT_TIMEOUT_S + 80, elapsed


def destroy_after_a_dead_peer(rank: int, world: int) -> dict[str, Any]:
    """The last rank dies after a warm-up; the others issue allreduces that can never
    finish (their NCCL kernels wait for the dead peer) and destroy the group (timed).
    NCCL's own error handling is off, so nothing but fairring's destroy ends them: the
    watchdog's timeout marks the sub-groups failed, and destroy aborts them all, the
    world communicator included (a graceful NCCL shutdown of it would wait forever)."""
    dev = device()
    t = torch.ones(1 << 20, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(4):
        dist.all_reduce(t, async_op=True)
    backend = dist.distributed_c10d._get_default_group()._get_backend(dev)
    before = backend.subgroup_stats("cuda")
    start = time.monotonic()
    dist.destroy_process_group()
    return {
        "destroy_s": time.monotonic() - start,
        "before": before,
        "after": backend.subgroup_stats("cuda"),
    }


@pytest.mark.cuda_fault
def test_cuda_destroy_after_a_dead_peer_aborts_every_sub_group() -> None:
    outcomes = launch(
        destroy_after_a_dead_peer,
        3,
        machine_ids(3),
        backend="fairring",
        env={
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
            "TORCH_NCCL_ENABLE_MONITORING": "0",
            "FAIRRING_CUDA_ALLREDUCE": "lanes",
        },
        timeout_s=FAULT_TIMEOUT_S + 120,
        pg_timeout_s=FAULT_TIMEOUT_S,
        abort_grace_s=None,
    )
    assert outcomes[-1].status == "crashed", outcomes[-1].describe()
    for o in outcomes[:-1]:
        assert o.ok, o.describe()
        # Its watchdog needs the group's timeout to call the collectives failed; then
        # the abort, not a wait of its own.
        assert o.value["destroy_s"] < FAULT_TIMEOUT_S + 30, o.value
        assert o.value["before"]["shutdown"] == "running", o.value
        # The watchdog's timeout (from when the allreduces were issued) usually comes
        # first; the drain's own (from destroy) a little later: either ends in an abort.
        assert o.value["after"]["shutdown"] in ("aborted: failed", "aborted: timed out"), o.value
        # Two lanes and the world communicator (one rank per machine: no local groups).
        assert o.value["after"]["aborted_groups"] == 3, o.value


def _lifecycle(rank: int, world: int, store: Any, destroy: bool) -> dict[str, Any]:
    """One exact allreduce, then 16 large ones posted and never waited for; then
    destroy_process_group() (timed), or the interpreter simply exits."""
    dist.init_process_group(
        "fairring", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    dev = device()
    t = torch.full((10_000,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    exact = torch.equal(t.cpu(), torch.full((10_000,), float(sum(range(1, world + 1)))))
    for _ in range(16):
        dist.all_reduce(torch.ones(8 << 20, device=dev), async_op=True)
    # Last, one whose result this rank reads after the destroy: a destroy that
    # aborted the sub-groups would leave it unfinished.
    last = torch.full((4 << 20,), float(rank + 1), device=dev)
    dist.all_reduce(last, async_op=True)
    destroy_s = None
    if destroy:
        start = time.perf_counter()
        dist.destroy_process_group()
        destroy_s = time.perf_counter() - start
    else:
        torch.cuda.synchronize()  # nothing else orders the read after the lanes
    want = float(sum(range(1, world + 1)))
    exact = exact and torch.equal(last.cpu(), torch.full((4 << 20,), want))
    return {"exact": exact, "destroy_s": destroy_s}


@pytest.mark.parametrize("destroy", [True, False], ids=["destroy", "exit_without_destroy"])
def test_cuda_shutdown_with_work_in_flight(destroy: bool) -> None:
    outcomes = run_bare(_lifecycle, machine_ids(2), timeout_s=180, destroy=destroy)
    for o in outcomes:
        assert o.status == "ok" and o.exitcode == 0, o.describe()
        assert o.value["exact"], o.describe()
        if destroy:
            assert o.value["destroy_s"] < 30, o.value
        assert o.exit_latency_s is not None and o.exit_latency_s < 30, o.exit_latency_s


def mismatch(rank: int, world: int) -> None:
    """Rank 1 reduces one element more than rank 0, then both synchronise."""
    dev = device()
    t = torch.ones(1000 + rank, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    dist.all_reduce(torch.ones(10, device=dev))
    torch.cuda.synchronize()


@pytest.mark.cuda_fault
@pytest.mark.parametrize("debug", ["off", "DETAIL"])
def test_cuda_size_mismatch_never_passes(debug: str) -> None:
    # Through the five steps: rank 1 has a slice tail that rank 0 lacks, so the ranks
    # issue different collectives. (On the direct path, sizes under
    # FAIRRING_DIRECT_BELOW, mismatched counts reach one NCCL allreduce, and what
    # happens is NCCL's to say: a hang, or garbage.)
    env: dict[str, Any] = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "FAIRRING_DIRECT_BELOW": "0"}
    if debug == "DETAIL":
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    outcomes = launch(
        mismatch,
        2,
        machine_ids(2),
        backend="fairring",
        env=env,
        timeout_s=FAULT_TIMEOUT_S + 90,
        pg_timeout_s=FAULT_TIMEOUT_S,
        abort_grace_s=None,
    )
    assert not all(o.ok for o in outcomes), "a size mismatch passed silently"
    if debug == "DETAIL":
        # torch's wrapper compares every collective's shapes first, as for NCCL.
        for o in outcomes:
            assert o.status == "error" and "mismatch" in (o.error_message or ""), o.describe()
