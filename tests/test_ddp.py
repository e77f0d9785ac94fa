"""DDP parity: the same small Transformer trained on fairring and on gloo ends with the
same weights.

Each rank starts from a different random init (so DDP construction must verify the
parameters and broadcast rank 0's state), trains ~10 SGD steps on its own deterministic
data, some of them under ``no_sync()`` (gradient accumulation), with small buckets so
several allreduces are in flight per step. The parent compares the runs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import DEFAULT_BACKEND, SHAPES, memoised, run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

BACKEND = DEFAULT_BACKEND
MACHINES = SHAPES["2x2"]
STEPS = 10
NO_SYNC_STEPS = {3, 4, 7}  # gradients accumulate; the following step syncs them all
D_MODEL, SEQ, BATCH, CLASSES = 32, 6, 4, 10


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            D_MODEL, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank: int, world: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(1000 + rank)  # a different init on every rank
    torch.use_deterministic_algorithms(True)
    model = TinyTransformer()
    before = _state(model)
    ddp = DDP(model, bucket_cap_mb=0.02)  # ~20 KB buckets: several per step
    after_construction = {k.removeprefix("module."): v for k, v in _state(ddp).items()}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(10_000 * rank + step)
        x = torch.randn(BATCH, SEQ, D_MODEL, generator=gen)
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
        if step in NO_SYNC_STEPS:
            with ddp.no_sync():
                nn.functional.cross_entropy(ddp(x), y).backward()
            continue
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    dist.barrier()
    return {
        "before": before,
        "after_construction": after_construction,
        "final": _state(model),
        "losses": losses,
    }


@memoised
def _run(backend: str) -> list[dict[str, Any]]:
    return run_ranks(train, len(MACHINES), MACHINES, backend=backend, timeout_s=300, steps=STEPS)


def _assert_states_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


@pytest.mark.parametrize("backend", sorted({BACKEND, "gloo"}))
def test_ddp_construction_broadcasts_rank0_state(backend: str) -> None:
    results = _run(backend)
    first = results[0]["before"]["head.weight"]
    assert not torch.equal(first, results[1]["before"]["head.weight"]), "inits should differ"
    for rank, res in enumerate(results):
        _assert_states_equal(
            res["after_construction"], results[0]["before"], f"rank {rank} after DDP()"
        )


@pytest.mark.parametrize("backend", sorted({BACKEND, "gloo"}))
def test_ddp_replicas_stay_identical(backend: str) -> None:
    # allreduce must give every rank the same bits, or replicas drift apart.
    results = _run(backend)
    for rank, res in enumerate(results[1:], start=1):
        _assert_states_equal(res["final"], results[0]["final"], f"rank {rank} final weights")
    changed = any(
        not torch.equal(results[0]["final"][k], results[0]["before"][k])
        for k in results[0]["final"]
    )
    assert changed, "training did not change the weights"


def test_ddp_parity_with_gloo() -> None:
    if BACKEND == "gloo":
        pytest.skip("FAIRRING_TEST_BACKEND=gloo: nothing to compare with")
    ours, gloo = _run(BACKEND), _run("gloo")
    for rank in range(len(MACHINES)):
        for name, want in gloo[rank]["final"].items():
            torch.testing.assert_close(
                ours[rank]["final"][name],
                want,
                rtol=1e-3,
                atol=1e-5,
                msg=lambda m, rank=rank, name=name: f"rank {rank} {name}: {m}",
            )
        torch.testing.assert_close(
            torch.tensor(ours[rank]["losses"]),
            torch.tensor(gloo[rank]["losses"]),
            rtol=1e-3,
            atol=1e-5,
        )
