"""DDP's comm hooks on the sub-group allreduce, on CPU (FAIRRING_TEST_CPU_SUBGROUPS=on,
tests/test_subgroups.py): training with each hook, a chained one too, matches Gloo's.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import SHAPES, run_ranks

# ------------------------------------------------------------------ DDP comm hooks
from test_subgroups import TIMEOUT_S, subgroup_env


def _chained_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
    """Two allreduces in a chain: the callback of the first issues the second and waits
    on it (as PowerSGD does), on buckets of different sizes."""
    tensor = bucket.buffer()
    world = dist.get_world_size()

    def second(fut: Any) -> torch.Tensor:
        summed = fut.value()[0]
        again = summed.clone()
        dist.all_reduce(again, async_op=True).get_future().wait()  # world * summed
        return again / world / world

    return dist.all_reduce(tensor, async_op=True).get_future().then(second)


def train_with_hook(
    rank: int, world: int, hooks: tuple[str, ...], steps: int, reference: bool
) -> dict[str, dict[str, torch.Tensor]]:
    """Train the same small model once per hook, in one process group; the reference
    (Gloo) runs the same hooks with every allreduce completed before it returns
    (reference.inline_collectives), so their callbacks run inline, never on Gloo's
    threads."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    if reference:
        from reference import inline_collectives

        inline_collectives()
    finals = {}
    for hook in hooks:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(24, 40),
            torch.nn.ReLU(),
            torch.nn.Linear(40, 30),
            torch.nn.Linear(30, 5),
        )
        # A few buckets of different sizes: callbacks of concurrent buckets chain.
        ddp = DDP(model, bucket_cap_mb=0.004)
        if hook == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook == "powersgd":
            state = powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2
            )
            ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        elif hook == "chained":
            ddp.register_comm_hook(None, _chained_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(steps):
            gen = torch.Generator().manual_seed(100 * rank + step)
            x = torch.randn(16, 24, generator=gen)
            y = torch.randn(16, 5, generator=gen)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        finals[hook] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return finals


HOOKS = ("allreduce", "fp16", "powersgd", "chained")


@functools.cache
def _hook_runs(backend: str) -> list[dict[str, dict[str, torch.Tensor]]]:
    """One job per backend trains with every hook (2 jobs, not one per hook and backend)."""
    shape = SHAPES["2x2"]
    return run_ranks(
        train_with_hook,
        len(shape),
        shape,
        backend=backend,
        env=subgroup_env(),
        timeout_s=TIMEOUT_S,
        hooks=HOOKS,
        steps=6,
        reference=backend == "gloo",
    )


@pytest.mark.parametrize("hook", HOOKS)
def test_ddp_comm_hooks_match_gloo(hook: str) -> None:
    """The futures complete before allreduce returns, as NCCL's do: hooks that chain
    and block in their callbacks run in program order on every rank."""
    fairring = [r[hook] for r in _hook_runs("fairring")]
    gloo = [r[hook] for r in _hook_runs("gloo")]
    for rank in range(1, len(fairring)):
        for name, value in fairring[rank].items():
            assert torch.equal(value, fairring[0][name]), f"rank {rank} differs in {name}"
    # The same hook on the same buckets on both: only the order of summation differs
    # from Gloo's, a few ulps of float32 in the weights (as test_ddp_hooks holds them).
    # fp16 sums 4 ranks' gradients (|g| < 0.2 here) in fp16: another order can round
    # each sum one fp16 ulp (2**-11 relative) apart, which moves a weight by at most
    # steps * lr * 2**-11 * 0.2 = 6 * 0.05 * 1e-4 = 3e-5 (measured: 1e-5).
    rtol, atol = (0.0, 3e-5) if hook == "fp16" else (1e-5, 1e-6)
    for name, value in fairring[0].items():
        torch.testing.assert_close(value, gloo[0][name], rtol=rtol, atol=atol, msg=name)
