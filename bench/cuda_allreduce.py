"""fairring against NCCL (and Gloo) on CUDA tensors, in the same processes.

    python bench/cuda_allreduce.py                    # 2x1 and 4x1 on this host's GPU 0
    python bench/cuda_allreduce.py --shapes 4x1 --lanes 1,2,4,8

M simulated machines x L ranks, every rank on ``cuda:0`` with its own
``FAIRRING_MACHINE_ID`` and ``NCCL_HOSTID`` (so NCCL connects them over its socket
transport, as between hosts). Start MPS first (``nvidia-cuda-mps-control -d``):
without it the processes time-slice the GPU and NCCL's spinning kernels take
milliseconds per operation. scripts/run_cuda_tests.sh does both.

Per shape, one job: the default group is Gloo (barriers, gathering figures), and a
fairring group, an NCCL group and a Gloo group of the same ranks are timed side by
side, iteration by iteration: one allreduce at 64 KiB, 1, 25 and 100 MiB, 16 of
25 MiB in flight at once, and DDP training of a small Transformer (steps/s, fairring
against NCCL). Each figure is the median over iterations of the slowest rank. It also
reports the GPU memory fairring's sub-groups took at their first use (NCCL's
communicator buffers, outside torch's allocator) beside its staging. With ``--lanes``
the fairring group is made once per lane count, to choose FAIRRING_LANES.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SIZES = ("64K", "1M", "25M", "100M")
IN_FLIGHT = 16
IN_FLIGHT_SIZE = "25M"
SMALL_RUN_BYTES = 4 * common.MIB
# The targets, as fairring time / NCCL time (lower is better).
TARGETS = {"25M": 0.77, "100M": 0.77, "in_flight": 1 / 1.5, "64K": 1.5, "1M": 1.5}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--shapes", default="2x1,4x1")
    p.add_argument("--lanes", default="", help="comma-separated FAIRRING_LANES to compare")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--ddp-steps", type=int, default=20)
    p.add_argument("--no-gloo", action="store_true", help="skip Gloo (slow on CUDA tensors)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per shape")
    p.add_argument(
        "--out",
        type=Path,
        help="(driver) folder for the JSON and markdown; (worker) raw result file",
    )
    # A check of this script without a GPU: CPU tensors, fairring on its sub-group test
    # path, Gloo in NCCL's place, tiny sizes. Its figures mean nothing.
    p.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------ worker


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()


def _memory(dev: Any) -> tuple[int, int]:
    """(free bytes on the device, bytes torch's allocator has reserved)."""
    import torch

    if dev.type != "cuda":
        return 0, 0
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from fairring_pg.config import Config, lane_staging_bytes

    if args.cpu_dry_run:
        os.environ["FAIRRING_TEST_CPU_SUBGROUPS"] = "on"
        dev = torch.device("cpu")
    else:
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    common.init_worker(args.timeout)
    world = dist.get_world_size()
    barrier = dist.barrier
    nccl = dist.new_group(backend="gloo" if args.cpu_dry_run else "nccl")
    gloo = None if args.no_gloo else dist.new_group(backend="gloo")
    lane_counts = [int(k) for k in args.lanes.split(",") if k] or [None]

    # What fairring's sub-groups take on the GPU at their first use, on every rank
    # at once (mem_get_info sees the whole device, so the sum over ranks).
    probe = torch.ones(8 << 20, device=dev)
    dist.all_reduce(probe, group=nccl)
    groups: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    for lanes in lane_counts:
        name = "fairring" if lanes is None else f"fairring-lanes{lanes}"
        env = {} if lanes is None else {"FAIRRING_LANES": str(lanes)}
        group = common.fairring_group(**env)
        barrier()
        free_before, reserved_before = _memory(dev)
        barrier()
        dist.all_reduce(probe, group=group)
        barrier()
        free_after, reserved_after = _memory(dev)
        config = Config.from_env({**os.environ, **env})
        machines = int(os.environ["NNODES"])
        local = world // machines
        staging = 0
        if machines > 1:
            slice_size = config.subgroup_slice_size(machines, local)
            staging = config.lanes * lane_staging_bytes(slice_size, machines, local)
        device_wide = free_before - free_after
        memory[name] = {
            "device_bytes_all_ranks": device_wide,
            "allocator_bytes_this_rank": reserved_after - reserved_before,
            "staging_bytes_per_rank": staging,
            "outside_allocator_per_rank": (device_wide - world * (reserved_after - reserved_before))
            / world,
        }
        groups[name] = group
    groups["nccl"] = nccl
    if gloo is not None:
        groups["gloo"] = gloo

    def one(t: torch.Tensor, group: Any, reps: int) -> Any:
        def run() -> None:
            for _ in range(reps):
                dist.all_reduce(t, group=group)
            _sync(dev)

        return run

    results: dict[str, Any] = {"sizes": {}, "memory": memory}
    scale = 64 if args.cpu_dry_run else 1
    for text in SIZES:
        reps = max(1, SMALL_RUN_BYTES // common.parse_size(text))
        size = common.parse_size(text) // scale
        t = torch.ones(size // 4, device=dev)
        variants = {name: one(t, g, reps) for name, g in groups.items()}
        times = common.time_iterations(variants, args.iters, 1, barrier)
        results["sizes"][text] = {n: common.median(v) / reps for n, v in times.items()}

    flight = [
        torch.ones(common.parse_size(IN_FLIGHT_SIZE) // scale // 4, device=dev)
        for _ in range(IN_FLIGHT)
    ]

    def many(group: Any) -> Any:
        def run() -> None:
            works = [dist.all_reduce(t, group=group, async_op=True) for t in flight]
            for w in works:
                w.wait()
            _sync(dev)

        return run

    variants = {name: many(g) for name, g in groups.items() if name != "gloo"}
    times = common.time_iterations(variants, max(2, args.iters // 2), 1, barrier)
    results["in_flight"] = {n: common.median(v) for n, v in times.items()}
    flight.clear()

    # A 6-layer, 512-wide LM with an 8000-word vocabulary (~25M parameters: DDP's
    # buckets are full 25 MiB ones); a toy in the dry run.
    width, vocab = (32, 500) if args.cpu_dry_run else (512, 8000)
    results["ddp_steps_per_s"] = {
        name: _ddp_rate(g, args.ddp_steps, dev, width, vocab)
        for name, g in groups.items()
        if name != "gloo"
    }
    common.write_worker_result(args.out, results)


def _ddp_rate(group: Any, steps: int, dev: Any, width: int, vocab: int) -> float:
    """Steps/s of a small Transformer LM under DDP on ``group`` (slowest rank)."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        torch.nn.TransformerEncoder(layer, 6),
        torch.nn.Linear(width, vocab),
    ).to(dev)
    ids = [0] if dev.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, vocab, (16, 129), generator=gen).to(dev) for _ in range(4)]

    def step(tokens: torch.Tensor) -> None:
        logits = ddp(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()

    for i in range(3):
        step(batches[i % 4])
    _sync(dev)
    dist.barrier()
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % 4])
    _sync(dev)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return steps / float(elapsed)


# ------------------------------------------------------------------------ driver


def render(shape: str, data: dict[str, Any]) -> str:
    names = list(data["in_flight"])
    fair = [n for n in names if n.startswith("fairring")]
    lines = [f"### {shape}: seconds per allreduce (median of the slowest rank)", ""]
    head = "| case | " + " | ".join(names + (["gloo"] if "gloo" in data["sizes"]["1M"] else []))
    head += " | " + " | ".join(f"{n}/nccl" for n in fair) + " | target |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]

    with_gloo = "gloo" in data["sizes"]["1M"]

    def row(case: str, times: dict[str, float], target: float | None) -> str:
        cells = [f"{times[n] * 1e3:.3f} ms" for n in names]
        if with_gloo:
            cells.append(f"{times['gloo'] * 1e3:.3f} ms" if "gloo" in times else "-")
        ratios = [f"{times[n] / times['nccl']:.2f}" for n in fair]
        goal = "" if target is None else f"<= {target:.2f}"
        return f"| {case} | " + " | ".join(cells + ratios) + f" | {goal} |"

    for text in SIZES:
        lines.append(row(text, data["sizes"][text], TARGETS.get(text)))
    lines.append(
        row(f"{IN_FLIGHT} x {IN_FLIGHT_SIZE} in flight", data["in_flight"], TARGETS["in_flight"])
    )
    rates = data["ddp_steps_per_s"]
    lines += [
        "",
        "DDP Transformer (steps/s, higher is better): "
        + ", ".join(f"{n} {rates[n]:.2f}" for n in rates)
        + " — "
        + ", ".join(f"{n}/nccl {rates[n] / rates['nccl']:.2f}" for n in fair)
        + " (target >= 1.00)",
    ]
    for n, m in data["memory"].items():
        lines.append(
            f"GPU memory, {n}: {m['outside_allocator_per_rank'] / common.MIB:.0f} MiB per rank "
            f"outside torch's allocator at first use (NCCL communicators), "
            f"{m['staging_bytes_per_rank'] / common.MIB:.1f} MiB staging"
        )
    return "\n".join(lines) + "\n"


def driver(args: argparse.Namespace) -> int:
    out_dir = args.out or common.TMP
    out_dir.mkdir(parents=True, exist_ok=True)
    status = 0
    report = [f"CUDA allreduce, stamp: {json.dumps(common.stamp({'lanes': args.lanes}))}", ""]
    forwarded = [
        "--iters",
        str(args.iters),
        "--ddp-steps",
        str(args.ddp_steps),
        "--lanes",
        args.lanes,
        "--timeout",
        str(args.timeout),
    ]
    if args.no_gloo:
        forwarded.append("--no-gloo")
    if args.cpu_dry_run:
        forwarded.append("--cpu-dry-run")
    for shape in args.shapes.split(","):
        machines, local = common.parse_shape(shape)
        raw = common.TMP / f"cuda_allreduce_{shape}.json"
        raw.unlink(missing_ok=True)
        raw.parent.mkdir(parents=True, exist_ok=True)
        print(f"== CUDA allreduce {shape}", flush=True)
        code = common.launch(
            Path(__file__), [*forwarded, "--out", str(raw)], machines, local, timeout=args.timeout
        )
        if code != 0:
            print(f"!! {shape} failed with exit status {code}", file=sys.stderr, flush=True)
            status = code
            continue
        data = json.loads(raw.read_text())
        text = render(shape, data)
        print(text, flush=True)
        report.append(text)
        (out_dir / f"cuda_allreduce_{shape}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out_dir / "cuda_allreduce.md").write_text("\n".join(report))
    print(f"wrote {out_dir}/cuda_allreduce.md", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
