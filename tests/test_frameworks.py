"""Training frameworks on fairring: Lightning, Accelerate and the Hugging Face Trainer.

Each framework runs DDP on 2 CPU ranks the way its users start it (the ranks are
launched as torchrun launches them, and the framework creates the process group), for a
few steps of a tiny model built from code or from a config. Each rank records the
batches it trained on, its starting weights and its final ones, and counts in
torch.profiler the allreduces that ran, by backend ("fairring:all_reduce" against
"gloo:all_reduce"). The test then asserts that

- the default group is fairring, fairring ran one allreduce of the whole gradient per
  step and Gloo no allreduce at all (training that fell back to Gloo, or ran without
  DDP, fails here),
- the ranks end with bit-identical weights, and
- those weights are what plain SGD on one process gives from rank 0's starting weights
  and, at each step, every rank's batch together (computed here, in the test process):
  the allreduces averaged the right gradients.

Accelerate on CPU picks Gloo itself: the HF Trainer, which runs on it, refuses
``ddp_backend="fairring"`` with ``use_cpu=True``, and ``PartialState(backend="fairring")``
on a machine without a GPU makes a fairring group and then trains without DDP. Both jobs
therefore call ``init_process_group("fairring")`` first, which Accelerate then uses as
it is, the way the README gives.
"""

from __future__ import annotations

import collections
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import memoised, run_ranks
from torch import nn

STEPS = 4
BATCH = 4  # per rank and step
FEATURES, HIDDEN, CLASSES = 8, 16, 5
LR = 0.1
# GPT-2 from a config, small enough to train in a moment; no dropout, so that a step is
# a function of the weights and the batch.
GPT2_CONFIG = dict(
    vocab_size=64,
    n_positions=16,
    n_embd=32,
    n_layer=2,
    n_head=2,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
SEQ = 12
# One machine with two ranks, as `torchrun --nproc-per-node 2` starts them.
MACHINES = ["m0", "m0"]
TIMEOUT_S = 240


# ------------------------------------------------------------------------ models, data


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def classification_data(world: int) -> torch.utils.data.TensorDataset:
    """Enough samples for STEPS steps of BATCH on every rank, the same on all ranks
    (the framework's sampler gives each rank its share)."""
    gen = torch.Generator().manual_seed(7)
    n = STEPS * BATCH * world
    return torch.utils.data.TensorDataset(
        torch.randn(n, FEATURES, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)
    )


def token_data(world: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, GPT2_CONFIG["vocab_size"], (STEPS * BATCH * world, SEQ), generator=gen)
    # The first label is never predicted; ignoring it (-100) makes every way of counting
    # a batch's tokens (the Trainer divides by a count it makes itself) the same.
    labels = ids.clone()
    labels[:, 0] = -100
    return [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels, strict=True)]


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(**GPT2_CONFIG))


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------- what ranks report


def allreduces(prof: torch.profiler.profile, model: nn.Module) -> dict[str, int]:
    """How many allreduces each backend ran while `prof` recorded (c10d names each
    collective's profiler range "<backend>:<collective>"), and how many of fairring's
    carried the model's gradients: the model is small enough for DDP's first bucket, so
    that is one allreduce of every parameter's element per step."""
    counts: collections.Counter[str] = collections.Counter()
    numel = sum(p.numel() for p in model.parameters())
    for event in prof.events():
        if event.name.endswith(":all_reduce"):
            counts[event.name.split(":")[0]] += 1
            if event.name == "fairring:all_reduce" and event.input_shapes == [[numel]]:
                counts["fairring gradients"] += 1
    return dict(counts)


def report(
    initial: dict[str, torch.Tensor],
    model: nn.Module,
    batches: list[Any],
    prof: torch.profiler.profile,
) -> dict[str, Any]:
    return {
        "backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "allreduces": allreduces(prof, model),
        "initial": initial,
        "final": state_of(model),
        "batches": batches,
    }


def profiling() -> torch.profiler.profile:
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    )


# ------------------------------------------------------------------------------- jobs


def lightning_job(rank: int, world: int) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyNet()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            batches.append((x.clone(), y.clone()))
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    torch.manual_seed(100 + rank)  # a different start on every rank: DDP broadcasts rank 0's
    module = Module()
    initial = state_of(module.net)
    loader = torch.utils.data.DataLoader(classification_data(world), batch_size=BATCH)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=len(MACHINES),
        strategy=DDPStrategy(process_group_backend="fairring"),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with profiling() as prof:
        trainer.fit(module, loader)
    return report(initial, module.net, batches, prof)


def accelerate_job(rank: int, world: int) -> dict[str, Any]:
    from accelerate import Accelerator

    # On CPU, Accelerate picks Gloo itself (and PartialState(backend="fairring") on a
    # machine without a GPU makes the group but then runs without DDP); a group that
    # exists already is used as it is.
    dist.init_process_group("fairring")
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(100 + rank)
    model = TinyNet()
    initial = state_of(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(classification_data(world), batch_size=BATCH)
    ddp, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    batches = []
    with profiling() as prof:
        for x, y in loader:
            batches.append((x.clone(), y.clone()))
            loss = nn.functional.cross_entropy(ddp(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return report(initial, model, batches, prof)


def trainer_job(rank: int, world: int) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    # On CPU, Accelerate (under the Trainer) refuses any backend but Gloo; a group that
    # exists already is used as it is.
    dist.init_process_group("fairring")
    torch.manual_seed(100 + rank)
    model = gpt2()
    initial = state_of(model)
    batches: list[dict[str, torch.Tensor]] = []

    def record(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        batches.append({k: kwargs[k].clone() for k in ("input_ids", "labels")})

    model.register_forward_pre_hook(record, with_kwargs=True)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            use_cpu=True,
            per_device_train_batch_size=BATCH,
            max_steps=STEPS,
            learning_rate=LR,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,  # no clipping: plain SGD steps
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=100 + rank,
        )
        trainer = Trainer(model=model, args=args, train_dataset=token_data(world))
        with profiling() as prof:
            trainer.train()
    return report(initial, model, batches, prof)


# ------------------------------------------------------------------- the reference run


def classification_reference(initial: dict[str, torch.Tensor], steps: list[list[Any]]) -> nn.Module:
    model = TinyNet()
    model.load_state_dict(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for per_rank in steps:
        x = torch.cat([b[0] for b in per_rank])
        y = torch.cat([b[1] for b in per_rank])
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def gpt2_reference(initial: dict[str, torch.Tensor], steps: list[list[Any]]) -> nn.Module:
    model = gpt2()
    model.load_state_dict(initial)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for per_rank in steps:
        ids = torch.cat([b["input_ids"] for b in per_rank])
        labels = torch.cat([b["labels"] for b in per_rank])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


JOBS: dict[str, tuple[Callable[..., dict[str, Any]], Callable[..., nn.Module]]] = {
    "lightning": (lightning_job, classification_reference),
    "accelerate": (accelerate_job, classification_reference),
    "hf_trainer": (trainer_job, gpt2_reference),
}


@memoised
def _results(name: str) -> list[dict[str, Any]]:
    job = JOBS[name][0]
    # The jobs (the frameworks) create fairring groups whatever FAIRRING_TEST_BACKEND says;
    # naming it has the launcher build the core first.
    return run_ranks(
        job, len(MACHINES), MACHINES, "fairring", timeout_s=TIMEOUT_S, init_group=False
    )


@pytest.mark.parametrize("name", list(JOBS))
def test_framework_trains_on_fairring(name: str) -> None:
    results = _results(name)
    world = len(MACHINES)
    for rank, r in enumerate(results):
        assert (r["backend"], r["world"]) == ("fairring", world), f"rank {rank}"
        runs = r["allreduces"]
        assert runs.get("fairring gradients") == STEPS and "gloo" not in runs, (
            f"rank {rank} ran {runs} allreduces: {STEPS} steps need one fairring allreduce "
            "of the gradients each, and no Gloo ones"
        )
        assert len(r["batches"]) == STEPS, f"rank {rank} trained on {len(r['batches'])} batches"

    first = results[0]["final"]
    for rank, r in enumerate(results[1:], start=1):
        for key, value in first.items():
            assert torch.equal(r["final"][key], value), f"{key}: rank {rank} differs from rank 0"
    # Rank 0's start is every rank's (DDP broadcasts it), which the others did not have.
    assert any(
        not torch.equal(results[1]["initial"][k], v) for k, v in results[0]["initial"].items()
    )

    steps = [[r["batches"][s] for r in results] for s in range(STEPS)]
    expected = state_of(JOBS[name][1](results[0]["initial"], steps))
    moved = max((first[k] - results[0]["initial"][k]).abs().max().item() for k in first)
    assert moved > 1e-3, "training did not change the weights"
    for key, value in expected.items():
        torch.testing.assert_close(first[key], value, rtol=1e-5, atol=1e-6, msg=key)
