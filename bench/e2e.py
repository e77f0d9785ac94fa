"""End-to-end DDP (or FSDP2) training of the benchmark Transformer: words/s, fairring vs Gloo.

    python bench/e2e.py                        # 2 machines x 2 ranks, loopback
    python bench/e2e.py --shape 4x1 --rate 1gbit
    python bench/e2e.py --fsdp --rate 1gbit    # FSDP2: fully_shard per block, then the root

The model, corpus and step are bench/train_ddp.py's (bench/transformer.py). Unlike
scripts/main_job.sh, which runs each backend as a separate job, both backends train
here in the same processes: two copies of the model, one DDP over the Gloo group and
one over a fairring group, trained in alternating timed blocks so that a slow spell
of this shared host hits both alike. Same seeds and data on both sides, so the final
weights also show how closely the two backends agree.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import report

import common


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--shape", default="2x2")
    p.add_argument("--blocks", type=int, default=4, help="timed blocks per backend")
    p.add_argument("--block-steps", type=int, default=5)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="default: DDP's own, as DDP(model)"
    )
    p.add_argument(
        "--fsdp", action="store_true", help="FSDP2 (fully_shard per block) instead of DDP"
    )
    p.add_argument("--rate", default=None)
    p.add_argument("--netns", action="store_true")
    p.add_argument("--name", default=None)
    p.add_argument("--timeout", type=float, default=500.0)
    common.add_output_args(p)
    return p.parse_args(argv)


class Trainer:
    """One replica of the model over one process group, as bench/train_ddp.py steps it:
    DDP, or with --fsdp FSDP2 (each Transformer block its own unit, then the root), which
    all-gathers parameters and reduce-scatters gradients instead of allreducing."""

    def __init__(self, group: Any, args: argparse.Namespace, rank: int) -> None:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from transformer import ModelConfig, SyntheticCorpus, bucket_kwargs, build_model

        self.cfg = ModelConfig()
        self.batch = args.batch
        self.fsdp = args.fsdp
        if args.fsdp:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.fsdp import fully_shard

            self.model = build_model(self.cfg, seed=0)
            mesh = DeviceMesh.from_group(group, "cpu")
            for block in self.model.encoder.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        else:
            self.model = DDP(
                build_model(self.cfg, seed=0),
                process_group=group,
                **bucket_kwargs(args.bucket_cap_mb),
            )
        opt = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
        self.optimizer = opt(self.model.parameters(), lr=args.lr)
        self.corpus = SyntheticCorpus(self.cfg.vocab, seed=0, rank=rank)
        self.loss = 0.0

    def step(self) -> None:
        import torch.nn.functional as F

        inputs, targets = self.corpus.batch(self.batch, self.cfg.seq_len)
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, self.cfg.vocab), targets.reshape(-1))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # on CPU, returns once every bucket's allreduce has finished
        self.optimizer.step()
        self.loss = loss.item()

    def full_state(self) -> dict[str, Any]:
        """Every parameter whole (FSDP shards them), to compare the two backends."""
        if self.fsdp:
            return {k: v.full_tensor() for k, v in self.model.state_dict().items()}
        return self.model.module.state_dict()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformer import gradient_bytes

    common.init_worker()
    rank, world = dist.get_rank(), dist.get_world_size()
    trainers = {
        "gloo": Trainer(dist.group.WORLD, args, rank),
        "fairring": Trainer(common.fairring_group(), args, rank),
    }
    for trainer in trainers.values():
        for _ in range(args.warmup_steps):
            trainer.step()

    def block(trainer: Trainer) -> Callable[[], None]:
        def run() -> None:
            for _ in range(args.block_steps):
                trainer.step()

        return run

    # Blocks of steps, the backends alternating; a block takes as long as its slowest rank.
    seconds = common.time_iterations(
        {name: block(t) for name, t in trainers.items()}, args.blocks, 0, dist.barrier
    )
    a, b = (t.full_state() for t in trainers.values())
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    losses = {name: t.loss for name, t in trainers.items()}
    loss_tensor = torch.tensor(list(losses.values()), dtype=torch.float64)
    dist.all_reduce(loss_tensor)
    common.write_worker_result(
        args.raw_out,
        {
            "world": world,
            "seconds": seconds,
            "words_per_step": world * args.batch * trainers["gloo"].cfg.seq_len,
            "grad_mib": gradient_bytes(trainers["gloo"].model) / common.MIB,
            "final_loss": dict(zip(losses, (loss_tensor / world).tolist(), strict=True)),
            "max_param_diff": diff,
        },
    )
    # As in train_ddp: DDP's reducers hold the groups, and a Gloo group left to
    # interpreter teardown sometimes aborted a rank at exit.
    dist.barrier()
    trainers.clear()
    gc.collect()
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> int:
    machines, ranks = common.parse_shape(args.shape)
    place = common.placement(args, "e2e_fsdp" if args.fsdp else "e2e")
    forwarded = [
        "--blocks",
        str(args.blocks),
        "--block-steps",
        str(args.block_steps),
        "--warmup-steps",
        str(args.warmup_steps),
        "--batch",
        str(args.batch),
        "--optimizer",
        args.optimizer,
        "--lr",
        str(args.lr),
        *(["--fsdp"] if args.fsdp else []),
    ]
    if args.bucket_cap_mb is not None:
        forwarded += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
    code, results = common.run_workers(
        Path(__file__), args, place, args.shape, forwarded, machines, ranks, place.name
    )
    if results is None:
        return code
    config = {
        "where": place.where,
        "rate": args.rate,
        "shape": args.shape,
        "blocks": args.blocks,
        "block_steps": args.block_steps,
        "batch": args.batch,
        "optimizer": args.optimizer,
        "bucket_cap_mb": args.bucket_cap_mb,
        "fsdp": args.fsdp,
    }
    common.stamp_and_save("e2e", place.name, config, render, results, args.out)
    return 0


def steps_per_s(data: dict[str, Any], backend: str) -> float:
    """Median over blocks: a block disturbed by another process counts once, not fully."""
    steps = data["stamp"]["config"]["block_steps"]
    return common.median([steps / s for s in data["seconds"][backend]])


def render(data: dict[str, Any]) -> tuple[str, Any]:
    cfg = data["stamp"]["config"]
    rates = {b: steps_per_s(data, b) for b in ("gloo", "fairring")}
    rows = [
        [
            b,
            f"{r:.3f}",
            f"{r * data['words_per_step']:.0f}",
            f"{data['final_loss'][b]:.4f}",
            ", ".join(f"{cfg['block_steps'] / s:.2f}" for s in data["seconds"][b]),
            report.ratio(r / rates["gloo"]),
        ]
        for b, r in rates.items()
    ]
    cap = cfg.get("bucket_cap_mb")
    buckets = "DDP's default buckets" if cap is None else f"DDP buckets of {cap} MB"
    wrapper = "DDP"
    if cfg.get("fsdp"):
        buckets, wrapper = "FSDP2, fully_shard per block and the root", "FSDP2"
    markdown = (
        f"# End-to-end {wrapper} Transformer: {cfg['shape']} ({cfg['where']})\n\n"
        + report.stamp_lines(data["stamp"])
        + f"\n{data['grad_mib']:.1f} MiB of gradients, {buckets},"
        f" {cfg['batch']} sequences/rank/step; {cfg['blocks']} alternating blocks of"
        f" {cfg['block_steps']} steps per backend, median block.\n\n"
        + report.table(
            ["backend", "steps/s", "words/s", "final loss", "steps/s per block", "vs gloo"], rows
        )
        + f"\nmax |param difference| fairring vs gloo after training:"
        f" {data['max_param_diff']:.3e} ({cfg['optimizer']})\n"
    )

    def plot(path: Path) -> None:
        series = {
            b: (list(range(1, len(s) + 1)), [cfg["block_steps"] / x for x in s])
            for b, s in data["seconds"].items()
        }
        report.line_plot(
            path,
            {f"{cfg['shape']} {cfg['where']}": series},
            "block",
            "steps/s",
            title=f"{wrapper} Transformer, steps/s per block",
        )

    return markdown, plot


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
