"""What users build on allreduce, reduce-scatter and all-gather keeps working on fairring.

Autograd's differentiable all_reduce, functional collectives (eager and under
torch.compile), DTensor redistribution, a tensor-parallel MLP and a compiled DDP model,
each on 2 simulated machines x 2 ranks with exact expected values computed here from
every rank's inputs, and each rank's Timeline (FAIRRING_TIMELINE) showing that fairring's
engine, not a delegate, ran the allreduces, reduce-scatters and all-gathers.

Inputs are integers held in float64 or int64 (or small integers in float32 for the
models): every sum is exact in any order, and the int64 values exceed 32 bits, so a
result is right to the last bit or visibly wrong.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from multiprocess import SHAPES, fairring_env, run_ranks

SHAPE = SHAPES["2x2"]
WORLD = len(SHAPE)
# Models compile with inductor on every rank at once: minutes on a busy 2-core machine.
COMPILE_TIMEOUT_S = 420


def _ints(rank: int, numel: int) -> torch.Tensor:
    """Rank r's int64 input: beyond 32 bits, distinct per rank and per element."""
    return (rank + 1) * 2**40 + torch.arange(numel, dtype=torch.int64) * (rank + 3)


def _floats(rank: int, numel: int) -> torch.Tensor:
    """Rank r's float64 input: integers up to about 2**40 plus halves, exact in any sum."""
    return (rank + 1) * 2.0**38 + torch.arange(numel, dtype=torch.float64) * 0.5 * (rank + 1)


def _sum_over_ranks(make: Any, numel: int) -> torch.Tensor:
    return sum(make(r, numel) for r in range(WORLD))


def _collectives_run(trace_dir: Path) -> list[collections.Counter[str]]:
    """Per rank, how many collectives of each kind fairring's engine ran (its Timeline)."""
    counts = []
    for rank in range(WORLD):
        events = json.loads((trace_dir / f"trace.rank{rank}.json").read_text())
        ops = [e["name"].split(" #")[0] for e in events if e.get("cat") == "ops"]
        counts.append(collections.Counter(ops))
    return counts


def _run(fn: Any, tmp_path: Path, timeout_s: float = 120, **env: str) -> list[Any]:
    job_env = fairring_env(FAIRRING_TIMELINE=str(tmp_path / "trace.json"), **env)
    return run_ranks(fn, WORLD, SHAPE, env=job_env, timeout_s=timeout_s)


def _assert_engine_ran(tmp_path: Path, **at_least: int) -> None:
    for rank, counts in enumerate(_collectives_run(tmp_path)):
        for kind, n in at_least.items():
            assert counts[kind] >= n, (
                f"rank {rank}: fairring ran {dict(counts)}, expected {kind} >= {n}"
            )


# -- autograd: torch.distributed.nn.functional.all_reduce --------------------------------


def _autograd_all_reduce(rank: int, world_size: int) -> tuple[list[float], list[float]]:
    from torch.distributed.nn.functional import all_reduce

    x = _floats(rank, 6).requires_grad_()
    y = all_reduce(x * (rank + 2))
    # dL/dy on rank r is (r + 1); all_reduce's backward sums the ranks' gradients.
    (y * (rank + 1)).sum().backward()
    assert x.grad is not None
    return y.detach().tolist(), x.grad.tolist()


def test_autograd_all_reduce_forward_and_backward(tmp_path: Path) -> None:
    results = _run(_autograd_all_reduce, tmp_path)
    want_y = sum(_floats(r, 6) * (r + 2) for r in range(WORLD)).tolist()
    grad_sum = sum(r + 1 for r in range(WORLD))
    for rank, (y, grad) in enumerate(results):
        assert y == want_y, f"rank {rank}"
        assert grad == [float(grad_sum * (rank + 2))] * 6, f"rank {rank}"
    _assert_engine_ran(tmp_path, allreduce=2)  # forward and backward


# -- functional collectives ----------------------------------------------------------------

NUMEL = 24  # divisible by WORLD: the reduce-scatter's shards


def _functional(
    x: torch.Tensor, f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD
    summed = funcol.all_reduce(x, "sum", group)
    gathered = funcol.all_gather_tensor(f, 0, group)
    scattered = funcol.reduce_scatter_tensor(f, "sum", 0, group)
    # Arithmetic on the results: the waits are implicit, where the values are used.
    return summed + 1, gathered * 2, scattered - 1


def _functional_eager(rank: int, world_size: int) -> list[list[Any]]:
    out = _functional(_ints(rank, NUMEL), _floats(rank, NUMEL))
    return [t.tolist() for t in out]


def _functional_compiled(rank: int, world_size: int) -> list[list[Any]]:
    compiled = torch.compile(_functional, fullgraph=True)
    out = compiled(_ints(rank, NUMEL), _floats(rank, NUMEL))
    again = compiled(_ints(rank, NUMEL), _floats(rank, NUMEL))  # the cached graph
    assert all(torch.equal(a, b) for a, b in zip(out, again, strict=True))
    return [t.tolist() for t in out]


def _check_functional(results: list[list[list[Any]]]) -> None:
    want_sum = (_sum_over_ranks(_ints, NUMEL) + 1).tolist()
    want_gather = (torch.cat([_floats(r, NUMEL) for r in range(WORLD)]) * 2).tolist()
    reduced = _sum_over_ranks(_floats, NUMEL) - 1
    shard = NUMEL // WORLD
    for rank, (summed, gathered, scattered) in enumerate(results):
        assert summed == want_sum, f"rank {rank}: all_reduce"
        assert gathered == want_gather, f"rank {rank}: all_gather_tensor"
        assert scattered == reduced[rank * shard : (rank + 1) * shard].tolist(), (
            f"rank {rank}: reduce_scatter_tensor"
        )


def test_functional_collectives_eager(tmp_path: Path) -> None:
    _check_functional(_run(_functional_eager, tmp_path))
    _assert_engine_ran(tmp_path, allreduce=1, all_gather=1, reduce_scatter=1)


def test_functional_collectives_compiled(tmp_path: Path) -> None:
    _check_functional(_run(_functional_compiled, tmp_path, timeout_s=COMPILE_TIMEOUT_S))
    _assert_engine_ran(tmp_path, allreduce=2, all_gather=2, reduce_scatter=2)


# -- DTensor -------------------------------------------------------------------------------

ROWS, COLS = 8, 3


def _dtensor_redistribute(rank: int, world_size: int) -> dict[str, list[Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    mine = _floats(rank, ROWS * COLS).view(ROWS, COLS)
    shard = DTensor.from_local(mine[: ROWS // world_size], mesh, [Shard(0)], run_check=False)
    partial = DTensor.from_local(mine, mesh, [Partial()], run_check=False)
    return {
        "shard_to_replicate": shard.redistribute(mesh, [Replicate()]).to_local().tolist(),
        "partial_to_replicate": partial.redistribute(mesh, [Replicate()]).to_local().tolist(),
        "partial_to_shard": partial.redistribute(mesh, [Shard(0)]).to_local().tolist(),
    }


def test_dtensor_redistribute(tmp_path: Path) -> None:
    results = _run(_dtensor_redistribute, tmp_path)
    per_rank = ROWS // WORLD
    gathered = torch.cat(
        [_floats(r, ROWS * COLS).view(ROWS, COLS)[:per_rank] for r in range(WORLD)]
    )
    summed = _sum_over_ranks(_floats, ROWS * COLS).view(ROWS, COLS)
    for rank, got in enumerate(results):
        assert got["shard_to_replicate"] == gathered.tolist(), f"rank {rank}"
        assert got["partial_to_replicate"] == summed.tolist(), f"rank {rank}"
        assert (
            got["partial_to_shard"] == summed[rank * per_rank : (rank + 1) * per_rank].tolist()
        ), f"rank {rank}"
    _assert_engine_ran(tmp_path, allreduce=1, all_gather=1, reduce_scatter=1)


# -- models: a tensor-parallel MLP, a compiled DDP model --------------------------------------

IN, HIDDEN, OUT, BATCH = 8, 16, 4, 6


def _small_int_mlp() -> torch.nn.Sequential:
    """The same MLP on every rank, with small integer weights: exact float32 arithmetic."""
    mlp = torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT)
    )
    with torch.no_grad():
        for i, p in enumerate(mlp.parameters()):
            values = (torch.arange(p.numel()) * (7 + 2 * i) + i) % 5 - 2
            p.copy_(values.view_as(p).float())
    return mlp


def _batch(rank: int) -> torch.Tensor:
    return ((torch.arange(BATCH * IN) * (rank + 5) + rank) % 7 - 3).float().view(BATCH, IN)


def _reference_grads(
    inputs: list[torch.Tensor], scale: float
) -> tuple[torch.Tensor, dict[str, list[Any]]]:
    mlp = _small_int_mlp()
    out = mlp(torch.cat(inputs))
    (out.sum() * scale).backward()
    return out.detach(), {
        n: p.grad.tolist() for n, p in mlp.named_parameters() if p.grad is not None
    }


def _tensor_parallel_mlp(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world_size,))
    mlp = parallelize_module(
        _small_int_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    x = _batch(0).requires_grad_()  # tensor parallelism: every rank the same input
    out = mlp(x)
    out.sum().backward()
    assert x.grad is not None
    grads = {
        n: p.grad.full_tensor().tolist() for n, p in mlp.named_parameters() if p.grad is not None
    }
    return {"out": out.detach().tolist(), "x_grad": x.grad.tolist(), "grads": grads}


def test_tensor_parallel_mlp(tmp_path: Path) -> None:
    results = _run(_tensor_parallel_mlp, tmp_path)
    x = _batch(0).requires_grad_()
    mlp = _small_int_mlp()
    out = mlp(x)
    out.sum().backward()
    assert x.grad is not None
    want_grads = {n: p.grad.tolist() for n, p in mlp.named_parameters() if p.grad is not None}
    for rank, got in enumerate(results):
        assert got["out"] == out.detach().tolist(), f"rank {rank}: forward"
        assert got["x_grad"] == x.grad.tolist(), f"rank {rank}: input gradient"
        assert got["grads"] == want_grads, f"rank {rank}: weight gradients"
    # Forward: RowwiseParallel's partial sums; backward: the replicated input's gradient;
    # full_tensor() of the sharded gradients: all-gathers.
    _assert_engine_ran(tmp_path, allreduce=2, all_gather=1)


def _compiled_ddp(rank: int, world_size: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.compile(DDP(_small_int_mlp()))
    grads = []
    for _ in range(2):  # the first step compiles, the second runs the compiled graph
        model.zero_grad()
        out = model(_batch(rank))
        out.sum().backward()
        grads.append(
            {n: p.grad.tolist() for n, p in model.module.named_parameters() if p.grad is not None}
        )
    assert grads[0] == grads[1]
    return {"out": out.detach().tolist(), "grads": grads[1]}


def test_compiled_ddp_model(tmp_path: Path) -> None:
    results = _run(_compiled_ddp, tmp_path, timeout_s=COMPILE_TIMEOUT_S)
    inputs = [_batch(r) for r in range(WORLD)]
    # DDP averages the ranks' gradients: the gradient of the whole batch's loss / WORLD.
    out, want_grads = _reference_grads(inputs, 1.0 / WORLD)
    for rank, got in enumerate(results):
        assert got["out"] == out[rank * BATCH : (rank + 1) * BATCH].tolist(), (
            f"rank {rank}: forward"
        )
        assert got["grads"] == want_grads, f"rank {rank}: averaged gradients"
    _assert_engine_ran(tmp_path, allreduce=2)
