"""CUDA graph capture on the CUDA path (one GPU, simulated machines: tests/cuda_jobs.py):
the probe fairring refuses captured allreduces with, captured allreduces on every path,
and delegated collectives captured as on NCCL.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from cuda_jobs import CUDA_MARKS, TIMEOUT_S, device, machine_ids
from multiprocess import run_ranks

from fairring_pg.group_info import subgroup_stats

pytestmark = CUDA_MARKS


def test_capture_probe_reads_the_driver() -> None:
    """The probe fairring refuses captured allreduces with, against the real driver: no
    capture, the captured stream, and the legacy default stream while another stream is
    captured (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT), with no warning (the driver is
    there)."""
    import warnings

    import native_module

    probe = native_module.load().CaptureProbe("libcuda.so.1")
    torch.cuda.set_device(0)
    states: dict[str, str] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states["outside"] = probe.state(torch.cuda.current_stream().cuda_stream)
        graph = torch.cuda.CUDAGraph()
        x = torch.ones(16, device="cuda")
        try:
            with torch.cuda.graph(graph):
                x.mul_(2)
                states["captured"] = probe.state(torch.cuda.current_stream().cuda_stream)
                states["legacy"] = probe.state(0)
        except RuntimeError:
            pass  # if asking about the legacy stream broke the capture, it says so above
        states["after"] = probe.state(torch.cuda.current_stream().cuda_stream)
    assert states == {
        "outside": "none",
        "captured": "active",
        "legacy": "implicit",
        "after": "none",
    }, states
    assert not [w for w in caught if "CUDA graph" in str(w.message)], caught


def captured_allreduce(rank: int, world: int, numel: int) -> dict[str, Any]:
    """An allreduce captured into a CUDA graph is NCCL's own (a graph cannot hold
    fairring's streams, and NCCL's allreduce it can), whatever the plan says of its
    size; replayed on new values it reduces them, and the group composes after it."""
    dev = device()
    t = torch.full((numel,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    before = subgroup_stats(None, "cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(t)
    t.fill_(float(rank + 10))
    graph.replay()
    torch.cuda.synchronize()
    replayed = torch.equal(t.cpu(), torch.full((numel,), float(sum(r + 10 for r in range(world)))))
    u = torch.full((numel,), float(rank + 1), device=dev)
    dist.all_reduce(u)
    exact = torch.equal(u.cpu(), torch.full((numel,), float(world * (world + 1) // 2)))
    after = subgroup_stats(None, "cuda")
    return {"replayed": replayed, "exact_after": exact, "before": before, "after": after}


@pytest.mark.parametrize("path", ["auto", "lanes"])
def test_cuda_graph_capture_of_an_allreduce_works(path: str) -> None:
    """25 MiB: composed under `lanes` when not captured."""
    numel = 25 << 20 >> 2
    results = run_ranks(
        captured_allreduce,
        2,
        machine_ids(2),
        backend="fairring",
        env={"FAIRRING_CUDA_ALLREDUCE": path},
        timeout_s=TIMEOUT_S,
        numel=numel,
    )
    for r in results:
        assert r["replayed"] and r["exact_after"], r
        if path == "lanes":
            # The captured call went to NCCL's own; the one after it composed.
            b, a = r["before"], r["after"]
            assert a["nccl_calls"] - b["nccl_calls"] == 1, r
            assert a["composed_calls"] - b["composed_calls"] == 1, r


def captured_delegated(rank: int, world: int) -> dict[str, Any]:
    """A warm-up allreduce of x, not waited for; then a broadcast of x and an all-gather
    of it captured into a CUDA graph (torch.cuda.graph synchronises the device first),
    replayed on new values: the results are NCCL's, and the capture never asked about
    or waited for the warm-up's events (either would break it)."""
    dev = device()
    n = 1000
    x = torch.full((n,), float(rank + 1), device=dev)
    dist.all_reduce(x, async_op=True)
    out = torch.empty(world * n, device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.broadcast(x, src=world - 1)
        dist.all_gather_into_tensor(out, x)
    x.fill_(float(rank + 10))
    graph.replay()
    torch.cuda.synchronize()
    want = float(world - 1 + 10)
    fairring = dist.get_backend() == "fairring"
    return {
        "broadcast": torch.equal(x.cpu(), torch.full((n,), want)),
        "all_gather": torch.equal(out.cpu(), torch.full((world * n,), want)),
        "stats": subgroup_stats(None, "cuda") if fairring else None,
    }


@pytest.mark.parametrize("path", ["auto", "lanes"])
def test_cuda_captured_delegated_collectives_work_as_on_nccl(path: str) -> None:
    runs = {
        backend: run_ranks(
            captured_delegated,
            2,
            machine_ids(2),
            backend=backend,
            env={"FAIRRING_CUDA_ALLREDUCE": path},
            timeout_s=TIMEOUT_S,
        )
        for backend in ("nccl", "fairring")
    }
    for r in runs["nccl"]:  # the scenario itself is one NCCL supports
        assert r["broadcast"] and r["all_gather"], r
    for r in runs["fairring"]:
        assert r["broadcast"] and r["all_gather"], r
        if path == "auto":
            # One rank per machine: the plan composes nothing, all of it NCCL's own.
            assert r["stats"] is None, r
            continue
        # Both captured collectives touch x, whose allreduce (NCCL's own at 4 KB, below
        # FAIRRING_DIRECT_BELOW) fairring still counts as in flight (nothing asked the
        # device since): neither was ordered after it, nor asked about it.
        assert r["stats"]["unordered_in_capture"] == 2, r
        assert r["stats"]["ordering_waits"] == 0, r
