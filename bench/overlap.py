"""Overlap: many 25 MiB buckets issued async at once, parallelism bounded by staging memory.

    python bench/overlap.py                    # 2x2 loopback, 64 buckets, p = 1 2 4 8
    python bench/overlap.py --shape 4x1 --rate 1gbit --buckets 16

Part 1 (Fairring's second microbenchmark): all buckets are issued with async_op=True,
then waited; FAIRRING_TOTAL_MEMORY holds exactly p staging slots (slice = bucket, slice
scaling off), so at most p buckets are reduced at a time. Gloo gets the same buckets,
async, in the same processes. Part 2: 16 buckets in flight at once with fairring's
default configuration, against Gloo doing the same 16 async.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import report

import common


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--shape", default="2x2")
    p.add_argument("--buckets", type=int, default=64)
    p.add_argument("--bucket-size", default="25M")
    p.add_argument("--parallelism", default="1,2,4,8")
    p.add_argument("--inflight", type=int, default=16, help="part 2: buckets in flight")
    p.add_argument("--iters", type=int, default=2, help="part 1 timed iterations")
    p.add_argument("--inflight-iters", type=int, default=5)
    p.add_argument("--rate", default=None)
    p.add_argument("--netns", action="store_true")
    p.add_argument("--name", default=None)
    p.add_argument("--timeout", type=float, default=500.0)
    common.add_output_args(p)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from fairring_pg.sizing import staging_slot_bytes

    common.init_worker()
    world = dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    bucket = common.parse_size(args.bucket_size)
    slot = staging_slot_bytes(bucket, world // local, local)
    buckets = [torch.zeros(bucket // 4) for _ in range(max(args.buckets, args.inflight))]

    def issue_all(group: Any, n: int) -> None:
        works = [dist.all_reduce(b, group=group, async_op=True) for b in buckets[:n]]
        for work in works:
            work.wait()

    # Part 1: the parallelism sweep.
    parallelism = [int(p) for p in args.parallelism.split(",")]
    groups = {"gloo": dist.group.WORLD}
    for p in parallelism:
        groups[f"p={p}"] = common.fairring_group(
            FAIRRING_TOTAL_MEMORY=str(p * slot),
            FAIRRING_SLICE_SIZE=str(bucket),
            FAIRRING_SLICE_SCALING="off",
        )
    for group in groups.values():  # connections and first-touch of staging, untimed
        issue_all(group, 2)
    sweep = common.time_iterations(
        {name: (lambda g=g: issue_all(g, args.buckets)) for name, g in groups.items()},
        args.iters,
        0,
        dist.barrier,
    )
    for name, group in groups.items():
        if name != "gloo":
            dist.destroy_process_group(group)

    # Part 2: a burst of buckets in flight, fairring as configured by default.
    default = common.fairring_group()
    inflight = common.time_iterations(
        {
            "gloo": lambda: issue_all(dist.group.WORLD, args.inflight),
            "fairring": lambda: issue_all(default, args.inflight),
        },
        args.inflight_iters,
        1,
        dist.barrier,
    )
    common.write_worker_result(
        args.raw_out,
        {
            "world": world,
            "local": local,
            "bucket": bucket,
            "slot_bytes": slot,
            "sweep": sweep,
            "inflight": inflight,
        },
    )
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> int:
    machines, ranks = common.parse_shape(args.shape)
    place = common.placement(args, "overlap")
    forwarded = [
        "--buckets",
        str(args.buckets),
        "--bucket-size",
        args.bucket_size,
        "--parallelism",
        args.parallelism,
        "--inflight",
        str(args.inflight),
        "--iters",
        str(args.iters),
        "--inflight-iters",
        str(args.inflight_iters),
    ]
    code, results = common.run_workers(
        Path(__file__), args, place, args.shape, forwarded, machines, ranks, place.name
    )
    if results is None:
        return code
    config = {
        "where": place.where,
        "rate": args.rate,
        "shape": args.shape,
        "buckets": args.buckets,
        "bucket_size": args.bucket_size,
        "inflight": args.inflight,
        "iters": args.iters,
        "inflight_iters": args.inflight_iters,
    }
    common.stamp_and_save("overlap", place.name, config, render, results, args.out)
    return 0


def _row(label: str, seconds: float, total: int, world: int, gloo_s: float) -> list[str]:
    return [
        label,
        report.ms(seconds),
        report.mbps(common.algbw(total, seconds)),
        report.mbps(common.busbw(total, seconds, world)),
        report.ratio(gloo_s / seconds),
    ]


def render(data: dict[str, Any]) -> tuple[str, Any]:
    cfg = data["stamp"]["config"]
    world, bucket = data["world"], data["bucket"]
    headers = ["variant", "total ms", "algbw MB/s", "busbw MB/s", "speedup vs gloo"]
    sweep = {k: common.median(v) for k, v in data["sweep"].items()}
    total = cfg["buckets"] * bucket
    rows = [_row(k, t, total, world, sweep["gloo"]) for k, t in sweep.items()]
    inflight = {k: common.median(v) for k, v in data["inflight"].items()}
    total2 = cfg["inflight"] * bucket
    rows2 = [_row(k, t, total2, world, inflight["gloo"]) for k, t in inflight.items()]
    markdown = (
        f"# Overlap: {cfg['shape']} ({cfg['where']})\n\n"
        + report.stamp_lines(data["stamp"])
        + f"\n## {cfg['buckets']} buckets of {common.show_size(bucket)}, all async at once\n\n"
        f"p = staging slots (FAIRRING_TOTAL_MEMORY = p x {data['slot_bytes']} B, slice = bucket,"
        " slice scaling off): at most p buckets are reduced at a time. Median of"
        f" {cfg['iters']} iterations.\n\n"
        + report.table(headers, rows)
        + f"\n## {cfg['inflight']} buckets of {common.show_size(bucket)} in flight at once\n\n"
        "fairring with its default configuration; Gloo doing the same allreduces async. "
        f"Median of {cfg['inflight_iters']} iterations.\n\n" + report.table(headers, rows2)
    )
    ps = [(int(k[2:]), t) for k, t in sweep.items() if k.startswith("p=")]

    def plot(path: Path) -> None:
        report.line_plot(
            path,
            {
                f"{cfg['buckets']} x {common.show_size(bucket)}, {cfg['shape']}": {
                    "fairring": ([p for p, _ in ps], [t for _, t in ps])
                }
            },
            "parallelism (staging slots)",
            "total time (s)",
            hlines={"gloo (async)": sweep["gloo"]},
            title="overlap vs parallelism",
        )

    return markdown, plot


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
