"""DDP and delegated collectives on the CUDA path (one GPU, simulated machines:
tests/cuda_jobs.py): training with each comm hook matches NCCL's, and every delegated
collective gives NCCL's result.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from cuda_jobs import CUDA_MARKS, TIMEOUT_S, device, machine_ids
from multiprocess import run_ranks

pytestmark = CUDA_MARKS


# ------------------------------------------------------------------ DDP parity


def train_ddp(rank: int, world: int, steps: int, hook: str) -> dict[str, torch.Tensor]:
    """A small Transformer, SGD, identical start on every rank, per-rank data."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    dev = device()
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
    dev = device()
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
