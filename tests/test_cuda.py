"""The CUDA path on one GPU: M simulated machines x 1 rank, every rank on ``cuda:0``.

NCCL refuses two ranks on one GPU, so each rank is its own machine (its own
``FAIRRING_MACHINE_ID``): the intra-node NCCL steps are skipped and the rail exchange
runs over loopback, through pinned staging. The other collectives on CUDA tensors go
to Gloo there (fairring_pg/cuda.py), which DDP's parameter broadcast needs.

Every test skips without a GPU; ``scripts/run_cuda_tests.sh`` runs them with
``-m cuda -s`` (the timing test prints its table).
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
from multiprocess import CaseJob, fairring_env, run_ranks
from test_allreduce import (
    DTYPES,
    FLOAT_DTYPES,
    OPS,
    SIZES,
    Case,
    _compare,
    _op,
    make_input,
    reduce_exact,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MACHINES = (2, 3, 4)
# Small slices and staging, as in the CPU suite: many slices, back-pressure.
JOB_ENV = fairring_env(total_memory=64 * 1024, slice_size=4 * 1024)
TIMEOUT_S = 600


def machine_ids(m: int) -> list[str]:
    return [f"gpu-m{i}" for i in range(m)]


def _device() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


# ------------------------------------------------------------------ exact results


def build_cuda_cases() -> list[Case]:
    cases = [
        Case(f"{op}-{dtype}-n{n}", "plain", op, dtype, n)
        for op in OPS
        for dtype in DTYPES
        if not (op == "AVG" and dtype not in FLOAT_DTYPES)
        for n in SIZES
    ]
    cases += [
        Case("big-SUM-float32-n1500000", "plain", "SUM", "float32", 1_500_000),
        Case("big-MAX-int64-n600000", "plain", "MAX", "int64", 600_000),
        Case("transposed-SUM-float32", "transposed", "SUM", "float32", 143),
        Case("transposed-MAX-int32", "transposed", "MAX", "int32", 143),
        Case("async-SUM-float32", "async", "SUM", "float32", 10_000),
        Case("future_then-SUM-bfloat16", "future_then", "SUM", "bfloat16", 1001),
        Case("coalesced-SUM-float32", "coalesced", "SUM", "float32", 0),
    ]
    return cases


def run_cuda_case(rank: int, world: int, case: Case) -> str | None:
    dev = _device()
    if case.kind == "plain":
        inputs = [make_input(r, case, case.numel, world) for r in range(world)]
        tensor = inputs[rank].to(dev)
        dist.all_reduce(tensor, op=_op(case.op))
        return _compare(tensor.cpu(), reduce_exact(inputs, case.op, case.dtype), "result")
    if case.kind == "transposed":
        bases = [make_input(r, case, case.numel, world).reshape(13, 11) for r in range(world)]
        base = bases[rank].to(dev)
        view = base.t()
        dist.all_reduce(view, op=_op(case.op))
        expected = reduce_exact([b.t() for b in bases], case.op, case.dtype)
        return _compare(view.cpu(), expected, "result through a transposed view")
    if case.kind in ("async", "future_then"):
        inputs = [make_input(r, case, case.numel, world) for r in range(world)]
        expected = reduce_exact(inputs, case.op, case.dtype)
        tensor = inputs[rank].to(dev)
        work = dist.all_reduce(tensor, op=_op(case.op), async_op=True)
        assert work is not None
        if case.kind == "async":
            work.wait()  # the current stream waits; reading the tensor syncs with it
            return _compare(tensor.cpu(), expected, "result after wait()")
        doubled = work.get_future().then(lambda f: f.value()[0] * 2).wait()
        return _compare(doubled.cpu(), (expected * 2), "value of the chained future")
    if case.kind == "coalesced":
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
        opts.reduceOp = dist.ReduceOp.SUM
        pg.allreduce_coalesced(tensors, opts).wait()
        for i, t in enumerate(tensors):
            expected = reduce_exact([ins[i] for ins in all_inputs], case.op, case.dtype)
            err = _compare(t.cpu(), expected, f"tensor {i} of {len(sizes)}")
            if err:
                return err
        return None
    raise ValueError(case.kind)


JOBS = {
    m: CaseJob(
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


@pytest.mark.parametrize(
    ("m", "case_id"),
    [pytest.param(m, i, id=f"{m}x1-{i}") for m, job in JOBS.items() for i in job.case_ids],
)
def test_cuda_allreduce_exact(m: int, case_id: str) -> None:
    JOBS[m].check(case_id)


# ------------------------------------------------------------- streams, concurrency


def concurrent_streams(rank: int, world: int, count: int, numel: int) -> str | None:
    """`count` async allreduces, each issued from its own stream right after a kernel
    on that stream wrote its input, waited on that stream, checked at the end."""
    dev = _device()
    streams = [torch.cuda.Stream(dev) for _ in range(count)]
    tensors, works = [], []
    for i, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            # Written on this stream: the allreduce must start after it.
            t = torch.full((numel,), float(rank + 1), device=dev) * (i + 1)
            tensors.append(t)
            works.append(dist.all_reduce(t, async_op=True))
    for stream, work, t in zip(streams, works, tensors, strict=True):
        with torch.cuda.stream(stream):
            work.wait()  # this stream, not the host, waits
            t.mul_(1)  # ordered after the allreduce on this stream
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
        numel=300_000,
    )
    assert results == [None] * m, results


# ------------------------------------------------------------------ DDP parity


def train_ddp(rank: int, world: int, steps: int) -> dict[str, torch.Tensor]:
    """A small Transformer, SGD, identical start on every rank, per-rank data."""
    dev = _device()
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(500, 64), torch.nn.TransformerEncoder(layer, 2), torch.nn.Linear(64, 500)
    ).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=1)
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


@pytest.mark.parametrize("m", MACHINES)
def test_cuda_ddp_matches_gloo(m: int) -> None:
    runs = {
        backend: run_ranks(
            train_ddp, m, machine_ids(m), backend=backend, timeout_s=TIMEOUT_S, steps=20
        )
        for backend in ("fairring", "gloo")
    }
    fairring, gloo = runs["fairring"], runs["gloo"]
    for rank in range(1, m):  # DDP keeps the replicas identical
        for name, value in fairring[rank].items():
            assert torch.equal(value, fairring[0][name]), f"rank {rank} differs in {name}"
    for name, value in fairring[0].items():
        # Only the summation order differs from Gloo: rounding, not algorithm.
        torch.testing.assert_close(value, gloo[0][name], rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------------------ timing

SIZES_MIB = (1, 25, 100)


def time_allreduces(rank: int, world: int, repeats: int) -> dict[str, dict[int, float]]:
    """Seconds per allreduce, fairring and a Gloo group of the same processes."""
    dev = _device()
    gloo = dist.new_group(backend="gloo")
    out: dict[str, dict[int, float]] = {"fairring": {}, "gloo": {}}
    for mib in SIZES_MIB:
        t = torch.ones(mib * 2**20 // 4, device=dev)
        for name, group in (("fairring", None), ("gloo", gloo)):
            dist.all_reduce(t, group=group)  # warm-up (and the first-call set-up)
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                dist.all_reduce(t, group=group)
            torch.cuda.synchronize()
            out[name][mib] = (time.perf_counter() - start) / repeats
    return out


@pytest.mark.parametrize("m", MACHINES)
def test_cuda_allreduce_time_vs_gloo(m: int) -> None:
    results = run_ranks(
        time_allreduces, m, machine_ids(m), backend="fairring", timeout_s=TIMEOUT_S, repeats=5
    )
    slowest = {
        name: {mib: max(r[name][mib] for r in results) for mib in SIZES_MIB}
        for name in ("fairring", "gloo")
    }
    print(f"\nCUDA allreduce, {m} machines x 1 rank on one GPU (slowest rank, mean of 5):")
    print(f"{'size':>8} {'fairring ms':>12} {'gloo ms':>10} {'gloo/fairring':>14}")
    for mib in SIZES_MIB:
        f, g = slowest["fairring"][mib] * 1e3, slowest["gloo"][mib] * 1e3
        print(f"{mib:>5}MiB {f:>12.2f} {g:>10.2f} {g / f:>14.2f}")
