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
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from cuda_jobs import CUDA_MARKS, JOB_ENV, MACHINES, TIMEOUT_S, device, machine_ids
from multiprocess import run_ranks
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
from test_subgroup_paths import check_paths, path_env, paths_taken
from values import compare_exact, reduce_op

from fairring_pg.group_info import subgroup_stats

pytestmark = CUDA_MARKS

SIZES = (0, 1, 2, 7, 1001, 10_000)


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
    dev = device()
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
    """As on CPU (tests/test_subgroup_paths.py): at one rank per machine, NCCL's own allreduce
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
    dev = device()
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
    dev = device()
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
    dev = device()
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
    dev = device()
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
