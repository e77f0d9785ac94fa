"""DDP as users run it on CPU: comm hooks and DDP's modes, on fairring against Gloo.

One job per backend trains a fresh small model for each configuration below (torch's
PowerSGD hook past its start iteration, the fp16 and bf16 compress hooks, a hook that
chains two more allreduces inside ``.then()``, ``static_graph``,
``gradient_as_bucket_view``, ``no_sync()``), each rank on its own data, with SGD and
buckets of a few KB, so that every step has several buckets of different sizes in
flight. fairring runs the hooks as they are: their callbacks issue collectives while
the next buckets' allreduces are still in flight. In the Gloo reference every
allreduce completes before it returns (reference.inline_collectives), so its
callbacks run inline, in program order, never on Gloo's threads (where they could
race the next bucket's allreduce and pair different operations across ranks, or
outlive the interpreter); the operations and their order per bucket are the same.
"""

# No `from __future__ import annotations` here: DDP checks a hook's annotations at
# registration, and string annotations fail its check.
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import DEFAULT_BACKEND, SHAPES, memoised, run_ranks
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

BACKEND = DEFAULT_BACKEND
MACHINES = SHAPES["2x2"]
STEPS = 6
START_POWERSGD_ITER = 2  # steps 0-1 allreduce plainly, 2-5 compress
BUCKET_CAP_MB = 0.008  # ~8 KB: the layers below fall into buckets of different sizes
LR = 0.05
CLIP = 0.5
# How close fairring's final weights must be to Gloo's: the allreduces sum in another
# order, so float32 sums differ in the last bits; the float16/bfloat16 hooks round each
# sum to 11/8 bits, so one rounding that goes the other way moves a weight by up to
# LR x (half an ulp of that gradient).
RTOL = 1e-5
ATOL = {"fp16": 1e-5, "bf16": 1e-4}
RAISED = "raised by the comm hook's callback"

CONFIGS: dict[str, dict[str, Any]] = {
    "powersgd": {"hook": "powersgd"},
    "fp16": {"hook": "fp16"},
    "bf16": {"hook": "bf16"},
    "chained": {"hook": "chained"},
    "static_graph": {"static_graph": True},
    "static_graph_chained": {"hook": "chained", "static_graph": True},
    "bucket_view": {"gradient_as_bucket_view": True},
    "bucket_view_powersgd": {"hook": "powersgd", "gradient_as_bucket_view": True},
    "no_sync": {"no_sync_steps": (1, 2)},
    "no_sync_powersgd": {"hook": "powersgd", "no_sync_steps": (3,)},
}


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 96), nn.Tanh(), nn.Linear(96, 12)
    )


def _chained_hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages the bucket, then inside ``.then()``: averages the (equal) means once
    more, through an allreduce with a ``.then()`` of its own, and clips by the largest
    norm over ranks (a second allreduce)."""
    world = dist.get_world_size()

    def chain(fut: torch.futures.Future) -> torch.Tensor:
        mean = fut.value()[0] / world
        again = (
            dist.all_reduce(mean.clone(), async_op=True)
            .get_future()
            .then(lambda f: f.value()[0] / world)
            .wait()
        )
        norm = again.norm().reshape(1)
        dist.all_reduce(norm, op=dist.ReduceOp.MAX)
        return again * torch.clamp(CLIP / norm, max=1.0)

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(chain)


def _bf16_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook itself: DDP refuses that name unless torch was built
    with CUDA and NCCL, though the hook runs on any backend."""
    return default_hooks.bf16_compress_hook(state, bucket)


def _raising_hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    def fail(fut: torch.futures.Future) -> torch.Tensor:
        raise RuntimeError(RAISED)

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(fail)


def _register(ddp: DDP, name: str | None) -> None:
    if name is None:
        return
    state: object = None
    hook: Callable[..., torch.futures.Future]
    if name == "powersgd":
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=2,
            start_powerSGD_iter=START_POWERSGD_ITER,
            min_compression_rate=1.0,
        )
        hook = powersgd.powerSGD_hook
    elif name == "fp16":
        hook = default_hooks.fp16_compress_hook
    elif name == "bf16":
        hook = _bf16_hook
    elif name == "chained":
        hook = _chained_hook
    elif name == "raising":
        hook = _raising_hook
    else:
        raise ValueError(name)
    ddp.register_comm_hook(state, hook)


def _train(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _model()
    ddp = DDP(
        model,
        bucket_cap_mb=BUCKET_CAP_MB,
        static_graph=config.get("static_graph", False),
        gradient_as_bucket_view=config.get("gradient_as_bucket_view", False),
    )
    _register(ddp, config.get("hook"))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(16, 24, generator=gen)
        y = torch.randn(16, 12, generator=gen)
        if step in config.get("no_sync_steps", ()):
            # DDP decides in forward whether backward allreduces: both go inside.
            with ddp.no_sync():
                nn.functional.mse_loss(ddp(x), y).backward()  # accumulates locally
            continue  # the next synced step reduces the sum
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": losses,
    }


def _raising(rank: int) -> str:
    ddp = DDP(_model(), bucket_cap_mb=BUCKET_CAP_MB)
    _register(ddp, "raising")
    loss = ddp(torch.randn(4, 24)).sum()
    try:
        loss.backward()
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return str(exc)
    return "backward() returned"


def train_all(rank: int, world: int, reference: bool) -> dict[str, Any]:
    if reference:
        # Gloo's callbacks would run on its threads (reference.py says why not).
        from reference import inline_collectives

        inline_collectives()
    out: dict[str, Any] = {name: _train(rank, cfg) for name, cfg in CONFIGS.items()}
    out["raising"] = _raising(rank)
    dist.barrier()
    return out


@memoised
def _run(backend: str) -> list[dict[str, Any]]:
    return run_ranks(
        train_all,
        len(MACHINES),
        MACHINES,
        backend=backend,
        timeout_s=240,
        reference=backend == "gloo",
    )


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_replicas_bit_identical_and_weights_match_gloo(config: str) -> None:
    ours = _run(BACKEND)
    for rank, res in enumerate(ours[1:], start=1):
        for name, value in res[config]["final"].items():
            assert torch.equal(value, ours[0][config]["final"][name]), (
                f"{config}: rank {rank} {name} differs from rank 0's"
            )
    if BACKEND == "gloo":
        pytest.skip("the suite runs on Gloo: replicas compared, no other backend to match")
    gloo = _run("gloo")
    atol = ATOL.get(config, 1e-7)
    for rank in range(len(MACHINES)):
        for name, want in gloo[rank][config]["final"].items():
            torch.testing.assert_close(
                ours[rank][config]["final"][name],
                want,
                rtol=RTOL,
                atol=atol,
                msg=lambda m, rank=rank, name=name: f"{config} rank {rank} {name}: {m}",
            )
        torch.testing.assert_close(
            torch.tensor(ours[rank][config]["losses"]),
            torch.tensor(gloo[rank][config]["losses"]),
            rtol=RTOL,
            atol=atol,
        )


def test_powersgd_compresses_after_its_start_iteration() -> None:
    """The PowerSGD runs really used both phases: their weights differ from plain
    allreduce's, and fairring and Gloo agree on them (checked above)."""
    ours = _run(BACKEND)
    plain = ours[0]["bucket_view"]["final"]  # same model, data and steps, no hook
    compressed = ours[0]["powersgd"]["final"]
    assert any(not torch.allclose(plain[k], compressed[k]) for k in plain)


def test_raising_hook_fails_backward_on_every_rank() -> None:
    for rank, message in enumerate(_run(BACKEND)):
        assert RAISED in message["raising"], f"rank {rank}: {message['raising']}"
