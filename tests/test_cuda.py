"""The CUDA path on one GPU: M simulated machines x 1 rank, every rank on ``cuda:0``.

Each simulated machine has its own ``FAIRRING_MACHINE_ID`` and ``NCCL_HOSTID`` (the
harness sets both), so NCCL treats the ranks as hosts of their own and connects them
through its socket transport, as between machines. CUDA allreduces are composed of
NCCL sub-group collectives (src/subgroups/). With one rank per machine the default
(FAIRRING_CUDA_ALLREDUCE=auto) is NCCL's own allreduce on the world group, which the
path tests check; most jobs here set ``lanes``, so that the rail exchange on
FAIRRING_LANES lanes runs; FAIRRING_TEST_LOCAL_GLOO=on adds two ranks per machine, whose
local steps then run on Gloo (NCCL refuses two ranks on one GPU of one host).

Every test skips without a GPU; ``scripts/run_cuda_tests.sh`` runs them (with MPS, so
that NCCL's spinning kernels of several processes share the GPU instead of
time-slicing) and then the benchmark.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import fairring_env, launch, run_ranks
from reliability_helpers import run_bare
from test_allreduce import (
    DTYPES,
    FLOAT_DTYPES,
    OPS,
    VIEW_KINDS,
    Case,
    _make_base,
    _view_of,
    make_input,
    reduce_exact,
)
from test_subgroups import check_paths, path_env, paths_taken
from values import compare_exact, reduce_op

from fairring_pg.group_info import subgroup_stats

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MACHINES = (2, 3, 4)
SIZES = (0, 1, 2, 7, 1001, 10_000)
# Small slices and staging, as in the CPU suite: many slices, every lane reused; no
# direct path, so that every tensor of M elements or more goes through the five steps
# (at one rank per machine too: lanes).
JOB_ENV = fairring_env(
    total_memory=64 * 1024,
    slice_size=4 * 1024,
    FAIRRING_SLICE_SCALING="off",
    FAIRRING_DIRECT_BELOW=0,
    FAIRRING_CUDA_ALLREDUCE="lanes",
)
# A first run on a new machine can lower it (a hang then costs less device time).
TIMEOUT_S = int(os.environ.get("FAIRRING_TEST_CUDA_TIMEOUT", "300"))


def machine_ids(m: int, local: int = 1) -> list[str]:
    return [f"gpu-m{i}" for i in range(m) for _ in range(local)]


def _device() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


# ------------------------------------------------------------------ exact results


def build_cuda_cases(full: bool = True) -> list[Case]:
    combos = [
        (op, dtype, n)
        for op in OPS
        for dtype in DTYPES
        if not (op == "AVG" and dtype not in FLOAT_DTYPES)
        for n in (SIZES if full else (7, 1001))
    ]
    cases = [Case(f"{op}-{dtype}-n{n}", "plain", op, dtype, n) for op, dtype, n in combos]
    cases += [Case(f"{kind}-SUM-float32", kind, "SUM", "float32", 0) for kind in VIEW_KINDS]
    cases += [
        Case("big-SUM-float32-n1500000", "plain", "SUM", "float32", 1_500_000),
        Case("big-MAX-int64-n600000", "plain", "MAX", "int64", 600_000),
        Case("big-AVG-bfloat16-n700001", "plain", "AVG", "bfloat16", 700_001),
        Case("async-SUM-float32", "async", "SUM", "float32", 10_000),
        Case("future_then-SUM-bfloat16", "future_then", "SUM", "bfloat16", 1001),
        Case("coalesced-SUM-float32", "coalesced", "SUM", "float32", 0),
        Case("coalesced-MIN-int16", "coalesced", "MIN", "int16", 0),
        Case("coalesced_churn-SUM-int16", "coalesced_churn", "SUM", "int16", 0),
        Case("after_errors-SUM-float32", "plain", "SUM", "float32", 1001),
    ]
    return cases


# Bytes per element as the composition reduces it (int16 travels as int32).
_ELEM = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "int16": 4, "float16": 2}
_ELEM.update(bfloat16=2, int8=1, uint8=1, bool=1)
_NCCL_GROUP: list[Any] = []


def _delegated(case: Case, world: int) -> bool:
    """A plain call too small for one group of L·M x 16 bytes: NCCL's own allreduce."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    group = local * (world // local) * max(1, 16 // _ELEM[case.dtype])
    return case.kind == "plain" and case.numel < group


def _like_nccl(rank: int, world: int, case: Case, dev: torch.device) -> str | None:
    """The call on fairring and on a plain group of its delegate's backend (NCCL; Gloo
    where ranks share the GPU), of the same ranks, made at the first such case on every
    rank alike: the same outcome, bit for bit, or the same error (int16, which NCCL does
    not reduce)."""
    from fairring_pg.group_info import cuda_decision

    if not _NCCL_GROUP:
        _NCCL_GROUP.append(dist.new_group(backend=cuda_decision().delegate))
    ends = []
    for group in (None, _NCCL_GROUP[0]):
        tensor = make_input(rank, case, case.numel, world).to(dev)
        try:
            dist.all_reduce(tensor, op=reduce_op(case.op), group=group)
            ends.append(("ok", tensor.cpu()))
        except Exception as exc:  # noqa: BLE001 - compared with NCCL's own
            ends.append(("error", type(exc).__name__))
    if ends[0][0] != ends[1][0]:
        return f"fairring {ends[0]}, NCCL {ends[1]}"
    if ends[0][0] == "ok" and not torch.equal(ends[0][1], ends[1][1]):
        return f"fairring's values differ from NCCL's: {ends[0][1][:4]} vs {ends[1][1][:4]}"
    return None


def run_cuda_case(rank: int, world: int, case: Case) -> str | None:
    dev = _device()
    if _delegated(case, world):
        return _like_nccl(rank, world, case, dev)
    if case.kind in ("plain",) + VIEW_KINDS:
        shape, view_of = _view_of(case.kind, case.numel)
        bases = [_make_base(r, case, world, shape) for r in range(world)]
        base = bases[rank].clone(memory_format=torch.preserve_format).to(dev)
        view = view_of(base)
        dist.all_reduce(view, op=reduce_op(case.op))
        expected_base = bases[rank].clone(memory_format=torch.preserve_format)
        view_of(expected_base).copy_(reduce_exact([view_of(b) for b in bases], case.op, case.dtype))
        return compare_exact(view.cpu(), view_of(expected_base), "result") or compare_exact(
            base.cpu(), expected_base, "base tensor (elements outside the view must not change)"
        )
    if case.kind in ("async", "future_then"):
        inputs = [make_input(r, case, case.numel, world) for r in range(world)]
        expected = reduce_exact(inputs, case.op, case.dtype)
        tensor = inputs[rank].to(dev)
        work = dist.all_reduce(tensor, op=reduce_op(case.op), async_op=True)
        assert work is not None
        if case.kind == "async":
            work.wait()  # the current stream waits; reading the tensor syncs with it
            # Work.exception() is not callable from Python on torch 2.11 (its pybind
            # binding cannot convert an exception_ptr), so ask is_success().
            if not work.is_success():
                return "a successful allreduce reports is_success() False"
            return compare_exact(tensor.cpu(), expected, "result after wait()")
        doubled = work.get_future().then(lambda f: f.value()[0] * 2).wait()
        return compare_exact(doubled.cpu(), expected * 2, "value of the chained future")
    if case.kind in ("coalesced", "coalesced_churn"):
        sizes = (5, 1, 1001, 3000)
        all_inputs = [
            [
                make_input(r, dataclasses.replace(case, id=f"{case.id}/{i}"), n, world)
                for i, n in enumerate(sizes)
            ]
            for r in range(world)
        ]
        tensors = [t.to(dev) for t in all_inputs[rank]]
        pg = dist.distributed_c10d._get_default_group()
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = reduce_op(case.op)
        work = pg.allreduce_coalesced(tensors, opts)
        if case.kind == "coalesced_churn":
            # The caller's stream takes fresh blocks of the fused buffers' sizes and
            # writes them while the lanes may still read those buffers: memory the
            # allocator hands out again too early shows up in the results.
            total = sum(sizes)
            for dtype in (torch.int16, torch.int32):
                for _ in range(4):
                    torch.full((total,), 12345, dtype=dtype, device=dev)
        work.wait()
        for i, t in enumerate(tensors):
            expected = reduce_exact([ins[i] for ins in all_inputs], case.op, case.dtype)
            err = compare_exact(t.cpu(), expected, f"tensor {i} of {len(sizes)}")
            if err:
                return err
        return None
    raise ValueError(case.kind)


JOBS = {
    f"{m}x1": CaseJob(
        f"cuda allreduce {m}x1",
        run_cuda_case,
        build_cuda_cases(),
        machine_ids(m),
        backend="fairring",
        env=JOB_ENV,
        timeout_s=TIMEOUT_S,
    )
    for m in MACHINES
}
# Two ranks per simulated machine on the one GPU: the local steps on Gloo groups.
JOBS["2x2-local-gloo"] = CaseJob(
    "cuda allreduce 2x2, local groups on Gloo",
    run_cuda_case,
    build_cuda_cases(full=False),
    machine_ids(2, local=2),
    backend="fairring",
    env={**JOB_ENV, "FAIRRING_TEST_LOCAL_GLOO": "on"},
    timeout_s=TIMEOUT_S,
)


@pytest.mark.parametrize(
    ("job", "case_id"),
    [pytest.param(j, i, id=f"{j}-{i}") for j, job in JOBS.items() for i in job.case_ids],
)
def test_cuda_allreduce_exact(job: str, case_id: str) -> None:
    JOBS[job].check(case_id)


# ------------------------------------------------------------- which path ran


@pytest.mark.parametrize("m", (2, 4))
def test_cuda_path_per_mode_and_size(m: int) -> None:
    """As on CPU (tests/test_subgroups.py): at one rank per machine, NCCL's own allreduce
    on the world group for every size unless FAIRRING_CUDA_ALLREDUCE=lanes, exact."""
    ids = machine_ids(m)
    # CPU tensors on fairring's own engine: the switch of the CPU test path is off.
    env = path_env(FAIRRING_TEST_CPU_SUBGROUPS=None)
    per_rank = run_ranks(
        paths_taken, m, ids, backend="fairring", env=env, timeout_s=TIMEOUT_S, device="cuda"
    )
    check_paths(f"{m}x1", ids, per_rank)


# ------------------------------------------------------------- streams, concurrency


def concurrent_streams(rank: int, world: int, count: int, numel: int) -> str | None:
    """`count` async allreduces, each issued from its own stream right after a kernel
    on that stream wrote its input, waited on that stream, checked at the end."""
    dev = _device()
    streams = [torch.cuda.Stream(dev) for _ in range(count)]
    tensors, works = [], []
    for i, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            # A long kernel on this stream writes the input: the allreduce must
            # start after it, not after the default stream.
            t = torch.full((numel,), float(rank + 1), device=dev)
            for _ in range(20):
                t = t * 1.0
            t = t * (i + 1)
            tensors.append(t)
            works.append(dist.all_reduce(t, async_op=True))
    for stream, work, t in zip(streams, works, tensors, strict=True):
        with torch.cuda.stream(stream):
            work.wait()  # this stream, not the host, waits
            t.add_(0)  # ordered after the allreduce on this stream
    torch.cuda.synchronize()
    total = world * (world + 1) / 2
    for i, t in enumerate(tensors):
        want = total * (i + 1)
        if not torch.equal(t.cpu(), torch.full((numel,), want)):
            return f"allreduce {i}: got {t[:4].tolist()}..., want {want}"
    return None


@pytest.mark.parametrize("m", MACHINES)
def test_cuda_concurrent_streams(m: int) -> None:
    results = run_ranks(
        concurrent_streams,
        m,
        machine_ids(m),
        backend="fairring",
        env=JOB_ENV,
        timeout_s=TIMEOUT_S,
        count=8,
        numel=300_001,
    )
    assert results == [None] * m, results


def wait_does_not_block_host(rank: int, world: int) -> dict[str, float]:
    """Work.wait() of a large allreduce returns at once on the host (the stream waits);
    synchronizing then takes the real time."""
    dev = _device()
    t = torch.ones(64 << 20 >> 2, device=dev)
    dist.all_reduce(t)  # set-up (communicators) out of the way
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    waited = time.perf_counter() - start
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    assert torch.equal(t[:8].cpu(), torch.full((8,), float(world**2))), t[:8]
    # With a timeout, wait() blocks the host until the device is done (as
    # ProcessGroupNCCL's does): the work is complete when it returns.
    work = dist.all_reduce(t, async_op=True)
    work.wait(timeout=timedelta(seconds=60))
    completed = work.is_completed()
    synchronize = dist.all_reduce(t, async_op=True)
    synchronize.synchronize()  # the current stream waits, as wait() without a timeout
    torch.cuda.synchronize()
    assert torch.equal(t[:8].cpu(), torch.full((8,), float(world**4))), t[:8]
    return {"wait_s": waited, "total_s": total, "completed_after_timed_wait": completed}


def test_cuda_wait_is_a_stream_wait() -> None:
    results = run_ranks(
        wait_does_not_block_host, 2, machine_ids(2), backend="fairring", timeout_s=TIMEOUT_S
    )
    for r in results:
        assert r["wait_s"] < r["total_s"] / 2, r
        assert r["completed_after_timed_wait"], r


def overlapping_operations(rank: int, world: int, numel: int) -> str | None:
    """Two async allreduces of one tensor and a delegated broadcast of it, none waited
    for before the next is issued: each must see the previous one's result, as on
    NCCL's one stream, although their slices run on different lanes."""
    dev = _device()
    t = torch.full((numel,), float(rank + 1), device=dev)
    works = [dist.all_reduce(t, async_op=True), dist.all_reduce(t, async_op=True)]
    works.append(dist.broadcast(t, src=world - 1, async_op=True))
    for work in works:
        work.wait()
    want = float(world * world * (world + 1) // 2)
    got = t.cpu()
    if not torch.equal(got, torch.full((numel,), want)):
        wrong = (got != want).nonzero()
        return f"{len(wrong)} elements differ, first at {wrong[0].item()}: {got[wrong[0]].item()}"
    return None


@pytest.mark.parametrize("m", (2, 4))
def test_cuda_operations_on_the_same_memory_stay_in_order(m: int) -> None:
    results = run_ranks(
        overlapping_operations,
        m,
        machine_ids(m),
        backend="fairring",
        env=JOB_ENV,
        timeout_s=TIMEOUT_S,
        numel=300_001,
    )
    assert results == [None] * m, results


def bucket_views(rank: int, world: int, buckets: int, numel: int) -> dict[str, Any]:
    """A buffer cut into bucket views, each allreduced async: no bucket waits for another
    (disjoint bytes); then the whole buffer, which waits for every bucket; then one
    bucket again, which waits for its own first allreduce and the whole one. A long
    kernel on the caller's stream first keeps all of them in flight while they are
    issued, so the waits counted do not depend on timing."""
    dev = _device()
    dist.all_reduce(torch.ones(8, device=dev))  # the sub-groups connect here, not below
    torch.cuda.synchronize()
    buf = torch.empty(buckets * numel, device=dev)
    views = [buf[i * numel : (i + 1) * numel] for i in range(buckets)]
    for i, view in enumerate(views):
        view.fill_(float((rank + 1) * (i + 1)))
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device time ahead of everything
    start = subgroup_stats(None, "cuda")
    works = [dist.all_reduce(view, async_op=True) for view in views]
    disjoint = subgroup_stats(None, "cuda")
    works.append(dist.all_reduce(buf, async_op=True))
    whole = subgroup_stats(None, "cuda")
    works.append(dist.all_reduce(views[1], async_op=True))
    again = subgroup_stats(None, "cuda")
    for work in works:
        work.wait()
    torch.cuda.synchronize()
    total = world * (world + 1) // 2
    want = [float(total * (i + 1) * world) for i in range(buckets)]
    want[1] *= world
    got = [torch.unique(view).cpu().tolist() for view in views]
    return {
        "exact": got == [[w] for w in want],
        "got": got,
        "waits": [
            disjoint["ordering_waits"] - start["ordering_waits"],
            whole["ordering_waits"] - disjoint["ordering_waits"],
            again["ordering_waits"] - whole["ordering_waits"],
        ],
        "sliced": again["sliced_units"] - start["sliced_units"],
    }


def test_cuda_bucket_views_run_in_parallel_and_overlaps_in_order() -> None:
    buckets, numel = 4, 512 * 1024  # 2 MiB each: two 1 MiB slices, on both lanes
    env = {
        **JOB_ENV,
        "FAIRRING_SLICE_SIZE": str(1 << 20),
        "FAIRRING_TOTAL_MEMORY": str(16 << 20),
    }
    results = run_ranks(
        bucket_views,
        2,
        machine_ids(2),
        backend="fairring",
        env=env,
        timeout_s=TIMEOUT_S,
        buckets=buckets,
        numel=numel,
    )
    for r in results:
        assert r["exact"], r["got"]
        assert r["waits"] == [0, buckets, 2], r
        # Two 1 MiB slices per bucket, eight for the whole buffer.
        assert r["sliced"] == buckets * 2 + buckets * 2 + 2, r


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
    dev = _device()
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
    dev = _device()
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


# ------------------------------------------------------------------ DDP parity


def train_ddp(rank: int, world: int, steps: int, hook: str) -> dict[str, torch.Tensor]:
    """A small Transformer, SGD, identical start on every rank, per-rank data."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    dev = _device()
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(500, 64), torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(64, 500)
    ).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=1)
    if hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=3
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        tokens = torch.randint(0, 500, (8, 33), generator=gen).to(dev)
        logits = ddp(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 500), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "powersgd"])
@pytest.mark.parametrize("m", (2, 4))
def test_cuda_ddp_matches_nccl(m: int, hook: str) -> None:
    runs = {
        backend: run_ranks(
            train_ddp,
            m,
            machine_ids(m),
            backend=backend,
            timeout_s=TIMEOUT_S,
            steps=12,
            hook=hook,
        )
        for backend in ("fairring", "nccl")
    }
    fairring, nccl = runs["fairring"], runs["nccl"]
    for rank in range(1, m):  # every rank ends with the same bits
        for name, value in fairring[rank].items():
            assert torch.equal(value, fairring[0][name]), f"rank {rank} differs in {name}"
    tol = {"allreduce": (1e-4, 1e-5), "fp16": (2e-3, 1e-4), "powersgd": (2e-3, 1e-4)}[hook]
    for name, value in fairring[0].items():
        # Only the summation order differs from NCCL's: rounding, not algorithm.
        torch.testing.assert_close(value, nccl[0][name], rtol=tol[0], atol=tol[1], msg=name)


# ------------------------------------------------------------ delegated collectives


def delegated(rank: int, world: int) -> list[str]:
    """Collectives other than allreduce on CUDA tensors, through fairring (NCCL)."""
    dev = _device()
    errors: list[str] = []

    def value(r: int, tag: int, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32) + 1000 * r + 100_000 * tag

    t = value(rank, 0, 13).to(dev)
    dist.broadcast(t, src=world - 1)
    if not torch.equal(t.cpu(), value(world - 1, 0, 13)):
        errors.append("broadcast")
    out = [torch.empty(9, device=dev) for _ in range(world)]
    dist.all_gather(out, value(rank, 1, 9).to(dev))
    if any(not torch.equal(out[r].cpu(), value(r, 1, 9)) for r in range(world)):
        errors.append("all_gather")
    flat = torch.empty(world * 6, device=dev)
    dist.all_gather_single(flat, value(rank, 2, 6).to(dev))
    if not torch.equal(flat.cpu(), torch.cat([value(r, 2, 6) for r in range(world)])):
        errors.append("all_gather_single")
    inp = torch.cat([value(rank, 10 + j, 4) for j in range(world)]).to(dev)
    got = torch.empty(4, device=dev)
    dist.reduce_scatter_single(got, inp)
    want = sum(value(r, 10 + rank, 4) for r in range(world))
    if not torch.equal(got.cpu(), want):
        errors.append("reduce_scatter_single")
    send = torch.cat([value(rank, 20 + j, 3) for j in range(world)]).to(dev)
    recv = torch.empty(world * 3, device=dev)
    dist.all_to_all_single(recv, send)
    if not torch.equal(recv.cpu(), torch.cat([value(r, 20 + rank, 3) for r in range(world)])):
        errors.append("all_to_all_single")
    red = value(rank, 30, 5).to(dev)
    dist.reduce(red, dst=0)
    if rank == 0 and not torch.equal(red.cpu(), sum(value(r, 30, 5) for r in range(world))):
        errors.append("reduce")
    dist.barrier()
    torch.cuda.synchronize()
    return errors


@pytest.mark.parametrize("m", (2, 3))
def test_cuda_delegated_collectives(m: int) -> None:
    results = run_ranks(delegated, m, machine_ids(m), backend="fairring", timeout_s=TIMEOUT_S)
    assert results == [[]] * m, results


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
    dev = _device()
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
    dev = _device()
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
    dev = _device()
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
    dev = _device()
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


# -------------------------------------------------- as safe as NCCL (issue 38's checks)


def like_nccl(rank: int, world: int) -> list[dict[str, Any]]:
    """Calls the composition cannot do (complex, float8, unsigned 16/32/64-bit, AVG on
    integers, PREMUL_SUM) go to NCCL's own allreduce, at a size the plan composes: each
    ends as it does on a plain NCCL group of the same ranks (the same values, or an
    error where NCCL raises one), never with an error of fairring's."""
    dev = _device()
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
    dev = _device()
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
    dev = _device()
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
    dev = _device()
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
    dev = _device()
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
