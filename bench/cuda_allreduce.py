"""fairring against NCCL (and Gloo) on CUDA tensors, in the same processes.

    python bench/cuda_allreduce.py                    # 2x1 and 4x1 on this host's GPU 0
    python bench/cuda_allreduce.py --shapes 4x1 --paths lanes --lanes 1,2,4,8
    python bench/cuda_allreduce.py --profile DIR      # and torch.profiler traces in DIR

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
communicator buffers, outside torch's allocator) beside its staging.

A fairring group is made per FAIRRING_CUDA_ALLREDUCE path in ``--paths`` (default
``auto,lanes``: at one rank per machine, NCCL's allreduce on the world communicator,
and the five steps on the lanes), and per lane count in ``--lanes`` (to choose
FAIRRING_LANES). ``measured`` is a group under ``auto`` whose plan
(FAIRRING_TEST_CUDA_PLAN) measures each size of 64 KiB and more against the
composition of the model's kind (the trials of issue 39): its trials run before the
timing, each call timed alone, and the decisions record the times the GPU's timing
events gave each way (the slowest rank's) and the winner. Every figure of the ``auto``
group is judged against issue 26's targets
(NCCL's time / fairring's, i.e. fairring's speed as a fraction of NCCL's, at least 0.97
at every size, in flight and in DDP steps/s) and printed PASS or FAIL; a miss does not
change the exit status (it is a finding for the profile to explain). ``--profile DIR``
then records one iteration of the 25 MiB case and one of the in-flight case of every
group with torch.profiler on rank 0: a gzipped Chrome trace per group and case, and
``profile_<shape>.txt``, which says where the time went (device time by kind of kernel,
and the busiest operators).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from cuda_allreduce_report import (
    IN_FLIGHT,
    IN_FLIGHT_SIZE,
    PROFILED_SIZE,
    SIZES,
    render,
    verdicts,
)

import common

SMALL_RUN_BYTES = 4 * common.MIB
PATHS = ("auto", "lanes", "direct", "measured")
# The sizes the measured group trials, each a class of its own (64 KiB and up), and the
# composition each is timed against: pieces, rail exchange.
MEASURED = {
    "64K": (1, "alltoall"),
    "1M": (1, "alltoall"),
    "25M": (2, "alltoall"),
    "100M": (4, "alltoall"),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--shapes", default="2x1,4x1")
    p.add_argument(
        "--paths",
        default="auto,lanes",
        help=f"comma-separated FAIRRING_CUDA_ALLREDUCE paths to compare ({', '.join(PATHS)})",
    )
    p.add_argument("--lanes", default="", help="comma-separated FAIRRING_LANES to compare")
    p.add_argument(
        "--profile",
        type=Path,
        help="folder for torch.profiler traces of the 25 MiB and in-flight cases",
    )
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
    args = p.parse_args(argv)
    for path in args.paths.split(","):
        if path not in PATHS:
            p.error(f"--paths: {path!r} is not one of {', '.join(PATHS)}")
    return args


def measured_plan(scale: int) -> str:
    """FAIRRING_TEST_CUDA_PLAN for the measured group: NCCL's below the first measured
    size, then a measured class from each of MEASURED's sizes (divided by ``scale``)."""
    rows = ["0:nccl"]
    for text, (pieces, exchange) in MEASURED.items():
        rows.append(f"{common.parse_size(text) // scale}:measure:{pieces}:{exchange}")
    return ",".join(rows)


def variant_name(path: str, lanes: int | None) -> str:
    """'fairring' for the default path, 'fairring-lanes' for FAIRRING_CUDA_ALLREDUCE=lanes,
    with '-k4' for FAIRRING_LANES=4."""
    name = "fairring" if path == "auto" else f"fairring-{path}"
    return name if lanes is None else f"{name}-k{lanes}"


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

    from fairring_pg.group_info import subgroup_stats

    if args.cpu_dry_run:
        os.environ["FAIRRING_TEST_CPU_SUBGROUPS"] = "on"
        dev = torch.device("cpu")
    else:
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
    common.init_worker(args.timeout)
    world = dist.get_world_size()
    barrier = dist.barrier
    scale = 64 if args.cpu_dry_run else 1
    groups, memory = _groups(args, dev, scale)
    results: dict[str, Any] = {"sizes": {}, "memory": memory, "measured": {}}
    for name, group in groups.items():
        if name.startswith("fairring-measured"):
            results["measured"][name] = _trials(group, dev, scale, barrier)
    results["sizes"] = _time_sizes(args, groups, dev, scale)
    flight = [
        torch.ones(common.parse_size(IN_FLIGHT_SIZE) // scale // 4, device=dev)
        for _ in range(IN_FLIGHT)
    ]
    variants = {name: _many(g, flight, dev) for name, g in groups.items() if name != "gloo"}
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
    results["paths"] = {
        name: subgroup_stats(g, dev.type) for name, g in groups.items() if name.startswith("fair")
    }
    fairring = {name: g for name, g in groups.items() if name.startswith("fair")}
    results["host_per_piece"] = {n: _host_per_piece(g, dev, scale) for n, g in fairring.items()}
    if args.profile is not None:
        timed = {name: g for name, g in groups.items() if name != "gloo"}
        size = common.parse_size(PROFILED_SIZE) // scale
        t = torch.ones(size // 4, device=dev)
        tensors = [torch.ones(size // 4, device=dev) for _ in range(IN_FLIGHT)]
        cases = {
            PROFILED_SIZE: {name: _one(t, g, 1, dev) for name, g in timed.items()},
            "in_flight": {name: _many(g, tensors, dev) for name, g in timed.items()},
        }
        shape = f"{int(os.environ['NNODES'])}x{world // int(os.environ['NNODES'])}"
        _profile(cases, args.profile, shape, dev, barrier)
    common.write_worker_result(args.out, results)


def _groups(
    args: argparse.Namespace, dev: Any, scale: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The groups timed side by side (a fairring group per path and lane count, NCCL's,
    Gloo's), and what each fairring group's sub-groups took on the GPU at their first
    use, on every rank at once (mem_get_info sees the whole device, so the sum over
    ranks)."""
    import torch
    import torch.distributed as dist

    from fairring_pg.config import Config
    from fairring_pg.group_info import cuda_plan
    from fairring_pg.sizing import lane_staging_bytes

    world = dist.get_world_size()
    barrier = dist.barrier
    nccl = dist.new_group(backend="gloo" if args.cpu_dry_run else "nccl")
    gloo = None if args.no_gloo else dist.new_group(backend="gloo")
    lane_counts = [int(k) for k in args.lanes.split(",") if k] or [None]
    paths = args.paths.split(",")
    probe = torch.ones(8 << 20, device=dev)
    dist.all_reduce(probe, group=nccl)
    groups: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    for path, lanes in [(path, lanes) for path in paths for lanes in lane_counts]:
        name = variant_name(path, lanes)
        env = {"FAIRRING_CUDA_ALLREDUCE": path}
        if path == "measured":
            env = {
                "FAIRRING_CUDA_ALLREDUCE": "auto",
                "FAIRRING_TEST_CUDA_PLAN": measured_plan(scale),
            }
        if lanes is not None:
            env["FAIRRING_LANES"] = str(lanes)
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
        plan = cuda_plan(group)
        staging = 0
        if plan.composes:
            staging = config.lanes * lane_staging_bytes(plan.largest_piece, machines, local)
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
    return groups, memory


def _one(t: Any, group: Any, reps: int, dev: Any) -> Any:
    """``reps`` allreduces of ``t`` one after another."""
    import torch.distributed as dist

    def run() -> None:
        for _ in range(reps):
            dist.all_reduce(t, group=group)
        _sync(dev)

    return run


def _many(group: Any, tensors: list[Any], dev: Any) -> Any:
    """An allreduce of each of ``tensors``, all in flight at once."""
    import torch.distributed as dist

    def run() -> None:
        works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
        for w in works:
            w.wait()
        _sync(dev)

    return run


def _time_sizes(
    args: argparse.Namespace, groups: dict[str, Any], dev: Any, scale: int
) -> dict[str, dict[str, float]]:
    """Seconds per allreduce of each size, per group."""
    import torch
    import torch.distributed as dist

    sizes: dict[str, dict[str, float]] = {}
    for text in SIZES:
        reps = max(1, SMALL_RUN_BYTES // common.parse_size(text))
        if args.cpu_dry_run:
            reps = min(reps, 4)  # the script's shape, not its figures: seconds, not minutes
        size = common.parse_size(text) // scale
        t = torch.ones(size // 4, device=dev)
        variants = {name: _one(t, g, reps, dev) for name, g in groups.items()}
        times = common.time_iterations(variants, args.iters, 1, dist.barrier)
        sizes[text] = {n: common.median(v) / reps for n, v in times.items()}
    return sizes


def _trials(group: Any, dev: Any, scale: int, barrier: Any) -> dict[str, Any]:
    """The measured group's trials, size by size: each of a class's trial calls and its
    decision call timed alone on the host (the slowest rank's), and the decision, whose
    times the device's timing events gave."""
    import torch
    import torch.distributed as dist

    from fairring_pg.group_info import measured_choices
    from fairring_pg.measured import TRIAL_CALLS

    out: dict[str, Any] = {}
    for text in MEASURED:
        size = common.parse_size(text) // scale
        t = torch.ones(size // 4, device=dev)
        calls = []
        for _ in range(TRIAL_CALLS + 1):
            barrier()
            start = time.perf_counter()
            dist.all_reduce(t, group=group)
            _sync(dev)
            calls.append(time.perf_counter() - start)
        slowest = torch.tensor(calls, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        decided = [d for d in measured_choices(group) if d["from_bytes"] == size]
        out[text] = {"trial_s": slowest.tolist(), "decision": decided[0] if decided else None}
    return out


def _host_per_piece(group: Any, dev: Any, scale: int) -> float | None:
    """Host seconds the calling thread spends issuing a 25 MiB allreduce, per piece,
    with the device kept busy by a long kernel first (so nothing of it waits on the
    device); None where the group's calls do not compose (NCCL's own)."""
    import torch
    import torch.distributed as dist

    from fairring_pg.group_info import subgroup_stats

    # The dry run's sizes are scaled down, but this one must still compose (above
    # FAIRRING_DIRECT_BELOW).
    size = common.parse_size(PROFILED_SIZE) if scale == 1 else 4 * common.MIB
    t = torch.ones(size // 4, device=dev)
    dist.all_reduce(t, group=group)
    _sync(dev)
    before = subgroup_stats(group, dev.type)
    if before is None:
        return None
    if dev.type == "cuda":
        torch.cuda._sleep(200_000_000)
    start = time.perf_counter()
    work = dist.all_reduce(t, group=group, async_op=True)
    issued = time.perf_counter() - start
    work.wait()
    _sync(dev)
    pieces = subgroup_stats(group, dev.type)["sliced_units"] - before["sliced_units"]
    return issued / pieces if pieces else None


def _device_time_by_kind(events: Any) -> dict[str, float]:
    """Seconds of device time (self time of every kernel and copy) by kind: NCCL's
    kernels, copies, and the rest (fairring's reductions, fills, casts)."""
    kinds = {"NCCL kernels": 0.0, "copies": 0.0, "other kernels": 0.0}
    for e in events:
        us = getattr(e, "self_device_time_total", 0.0) or 0.0
        if us <= 0:
            continue
        name = e.key.lower()
        kind = "NCCL kernels" if "nccl" in name else "copies" if "memcpy" in name else None
        kinds[kind or "other kernels"] += us / 1e6
    return kinds


def _profile(
    cases: dict[str, dict[str, Any]], folder: Path, shape: str, dev: Any, barrier: Any
) -> None:
    """One iteration of each case and group under torch.profiler, every rank at once (so
    that the collectives meet); rank 0 writes a Chrome trace of each and a summary."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sort = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    lines = [f"torch.profiler, {shape}, rank 0 (one iteration per case and group)", ""]
    for case, variants in cases.items():
        for name, run in variants.items():
            barrier()
            run()  # warm
            barrier()
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                run()
                wall = time.perf_counter() - start
            if dist.get_rank() != 0:
                continue
            folder.mkdir(parents=True, exist_ok=True)
            # Gzipped: a trace of the in-flight case runs to megabytes; Perfetto reads it.
            trace = folder / f"trace_{shape}_{case}_{name}.json.gz"
            prof.export_chrome_trace(str(trace))
            events = prof.key_averages()
            kinds = _device_time_by_kind(events)
            lines.append(f"== {case}, {name}: {wall * 1e3:.2f} ms on the host ({trace.name})")
            if dev.type == "cuda":
                lines.append(
                    "device time: "
                    + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in kinds.items())
                    + " (kernels of concurrent streams overlap: the sum can exceed the wall)"
                )
            lines += [events.table(sort_by=sort, row_limit=12), ""]
    if dist.get_rank() == 0:
        (folder / f"profile_{shape}.txt").write_text("\n".join(lines) + "\n")
    _sync(dev)
    barrier()


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


def driver(args: argparse.Namespace) -> int:
    out_dir = args.out or common.TMP
    out_dir.mkdir(parents=True, exist_ok=True)
    status = 0
    config = {"lanes": args.lanes, "paths": args.paths}
    report = [f"CUDA allreduce, stamp: {json.dumps(common.stamp(config))}", ""]
    forwarded = [
        "--iters",
        str(args.iters),
        "--ddp-steps",
        str(args.ddp_steps),
        "--paths",
        args.paths,
        "--lanes",
        args.lanes,
        "--timeout",
        str(args.timeout),
    ]
    if args.profile is not None:
        forwarded += ["--profile", str(args.profile.resolve())]
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
        data["targets"] = verdicts(data)
        text = render(shape, data)
        print(text, flush=True)
        report.append(text)
        (out_dir / f"cuda_allreduce_{shape}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out_dir / "cuda_allreduce.md").write_text("\n".join(report))
    print(f"wrote {out_dir}/cuda_allreduce.md", flush=True)
    if args.profile is not None:
        print(f"wrote torch.profiler traces and summaries to {args.profile}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
