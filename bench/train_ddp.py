"""End-to-end DDP training of a small Transformer LM; run one copy per rank under torchrun.

    torchrun --nproc-per-node 4 bench/train_ddp.py --backend fairring

Rank 0 prints one JSON line with steps/s and words/s (tokens per second over all
ranks), optionally also writes it to --json-out, and can dump the final parameters
(--dump-params) so that runs with different backends can be compared.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# Run as a plain script by torchrun, so the sibling module is not on the path by default.
from transformer import (
    ModelConfig,
    SyntheticCorpus,
    bucket_kwargs,
    build_model,
    gradient_bytes,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="fairring")
    p.add_argument(
        "--import-fairring",
        action="store_true",
        help="import fairring_pg explicitly instead of relying on the entry-point autoload",
    )
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--ff", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="sgd keeps weights comparable across backends: Adam turns rounding-level"
        " gradient differences into lr-sized steps",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP bucket size in MB (default: DDP's own, as DDP(model) is run)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument(
        "--no-sync",
        action="store_true",
        help="backward under DDP's no_sync(): no allreduce at all, the compute-only baseline",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="process group timeout")
    p.add_argument("--json-out", type=Path, help="rank 0 also writes its JSON line here")
    p.add_argument("--dump-params", type=Path, help="rank 0 saves the final state_dict here")
    return p.parse_args()


def machine_layout(world_size: int) -> tuple[int, int]:
    """(machines, ranks per machine) as torchrun laid the job out."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return world_size // local, local


def _write_result(
    args: argparse.Namespace,
    model: Any,
    cfg: ModelConfig,
    layout: tuple[int, int, int],
    elapsed: float,
    final_loss: torch.Tensor,
    step_s: list[float],
) -> None:
    """Rank 0's line of results: printed, and written where --json-out says."""
    world, machines, local = layout
    words = args.steps * world * args.batch * cfg.seq_len
    result = {
        "backend": args.backend,
        "world_size": world,
        "machines": machines,
        "ranks_per_machine": local,
        "steps": args.steps,
        "seconds": round(elapsed, 4),
        "steps_per_s": round(args.steps / elapsed, 4),
        "words_per_s": round(words / elapsed, 1),
        "final_loss": round(final_loss.item(), 6),
        "step_ms": [round(1000 * x, 1) for x in step_s],
        "optimizer": args.optimizer,
        "lr": args.lr,
        # Other jobs on a small shared host are the main source of noise.
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "grad_mib": round(gradient_bytes(model) / 2**20, 2),
    }
    line = json.dumps(result)
    print(line, flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(line + "\n")
    if args.dump_params:
        args.dump_params.parent.mkdir(parents=True, exist_ok=True)
        torch.save(model.module.state_dict(), args.dump_params)


def main() -> None:
    args = parse_args()
    # Several ranks share few cores: more threads per rank only oversubscribes them.
    torch.set_num_threads(args.threads)
    if args.import_fairring:
        import fairring_pg  # noqa: F401

    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    machines, local = machine_layout(world)

    cfg = ModelConfig(
        vocab=args.vocab,
        d_model=args.d_model,
        heads=args.heads,
        layers=args.layers,
        ff=args.ff,
        seq_len=args.seq_len,
    )
    model = DDP(build_model(cfg, args.seed), **bucket_kwargs(args.bucket_cap_mb))
    optimizer_cls = torch.optim.Adam if args.optimizer == "adam" else torch.optim.SGD
    optimizer = optimizer_cls(model.parameters(), lr=args.lr)
    corpus = SyntheticCorpus(cfg.vocab, args.seed, rank)

    def step() -> torch.Tensor:
        inputs, targets = corpus.batch(args.batch, cfg.seq_len)
        # DDP decides in forward whether the backward allreduces, so no_sync() must
        # cover the forward too.
        with model.no_sync() if args.no_sync else contextlib.nullcontext():
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            # On CPU, DDP's backward returns only once every bucket's allreduce
            # finished, so a step's time includes its communication.
            loss.backward()
        optimizer.step()
        return loss.detach()

    for _ in range(args.warmup_steps):
        step()
    # Start and stop the clock with every rank lined up, so rank 0's wall time is the
    # job's time rather than its own.
    dist.barrier()
    start = time.perf_counter()
    losses = []
    step_ends = []
    for _ in range(args.steps):
        losses.append(step())
        step_ends.append(time.perf_counter())
    dist.barrier()
    elapsed = time.perf_counter() - start
    step_s = [b - a for a, b in zip([start, *step_ends[:-1]], step_ends, strict=True)]

    # Mean loss over ranks of the last step: what the job as a whole reached.
    final_loss = losses[-1].clone() if losses else torch.zeros(())
    dist.all_reduce(final_loss)
    final_loss /= world

    if rank == 0:
        layout = (world, machines, local)
        _write_result(args, model, cfg, layout, elapsed, final_loss, step_s)
    # Leave together, and drop DDP's reducer (which holds the process group) before
    # destroying the group: torch's Gloo group left to interpreter teardown
    # sometimes aborted a rank at exit ("terminate called without an active
    # exception", about one run in ten on 2 x 2 with --backend gloo).
    dist.barrier()
    model = optimizer = None  # the step closure holds them too
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
