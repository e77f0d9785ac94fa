"""Scaling with the number of machines (1 rank each), with and without slice scaling.

    python bench/scaling.py                          # loopback, M = 1 2 4 8
    python bench/scaling.py --rate 1gbit --machines 2,4,8

Fairring's third microbenchmark: a burst of 25 MiB buckets, all async at once, on M
machines. Variants, in the same processes: Gloo; fairring as configured by default;
and fairring with a small FAIRRING_SLICE_SIZE (--small-slice), once with
FAIRRING_SLICE_SCALING=off and once on. Scaling only changes anything once shards
(slice / (M·L)) fall below its 1 MiB floor, which at M <= 8 and one rank per machine
needs a slice below 8 MiB: hence the small slice, to show the over-sharding it fixes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import report

import common


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--machines", default="1,2,4,8")
    p.add_argument("--buckets", type=int, default=16)
    p.add_argument("--bucket-size", default="25M")
    p.add_argument("--small-slice", default="2M", help="FAIRRING_SLICE_SIZE of the on/off pair")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--rate", default=None)
    p.add_argument("--netns", action="store_true")
    p.add_argument("--name", default=None)
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per machine count")
    common.add_output_args(p)
    return p.parse_args(argv)


def _effective_slice(env: dict[str, str], machines: int) -> int | None:
    """The slice fairring will use, if this version of fairring_pg says (else None)."""
    from fairring_pg.config import Config

    with common.env_overrides(env):
        config = Config.from_env()
    effective = getattr(config, "effective_slice_size", None)
    return effective(machines, 1) if effective else None


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    common.init_worker()
    world = dist.get_world_size()
    bucket = common.parse_size(args.bucket_size)
    buckets = [torch.zeros(bucket // 4) for _ in range(args.buckets)]
    configs = {
        "fairring default": {},
        f"fairring {args.small_slice} scaling off": {
            "FAIRRING_SLICE_SIZE": args.small_slice,
            "FAIRRING_SLICE_SCALING": "off",
        },
        f"fairring {args.small_slice} scaling on": {
            "FAIRRING_SLICE_SIZE": args.small_slice,
            "FAIRRING_SLICE_SCALING": "on",
        },
    }
    groups = {"gloo": dist.group.WORLD}
    groups.update({name: common.fairring_group(**env) for name, env in configs.items()})

    def issue_all(group: Any, n: int) -> None:
        works = [dist.all_reduce(b, group=group, async_op=True) for b in buckets[:n]]
        for work in works:
            work.wait()

    for group in groups.values():  # connections and first touch, untimed
        issue_all(group, 2)
    times = common.time_iterations(
        {name: (lambda g=g: issue_all(g, args.buckets)) for name, g in groups.items()},
        args.iters,
        0,
        dist.barrier,
    )
    slices = {name: _effective_slice(env, world) for name, env in configs.items()}
    common.write_worker_result(args.raw_out, {"world": world, "times": times, "slices": slices})
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> int:
    place = common.placement(args, "scaling")
    forwarded = [
        "--buckets",
        str(args.buckets),
        "--bucket-size",
        args.bucket_size,
        "--small-slice",
        args.small_slice,
        "--iters",
        str(args.iters),
    ]
    runs: dict[str, Any] = {}
    for machines in (int(m) for m in args.machines.split(",")):
        code, result = common.run_workers(
            Path(__file__),
            args,
            place,
            f"{machines}x1",
            forwarded,
            machines,
            1,
            f"{place.name}_{machines}",
        )
        runs[str(machines)] = result if result is not None else {"error": f"exit status {code}"}
    config = {
        "where": place.where,
        "rate": args.rate,
        "buckets": args.buckets,
        "bucket_size": args.bucket_size,
        "small_slice": args.small_slice,
        "iters": args.iters,
    }
    common.stamp_and_save("scaling", place.name, config, render, {"runs": runs}, args.out)
    return 0 if all("error" not in r for r in runs.values()) else 1


def render(data: dict[str, Any]) -> tuple[str, Any]:
    cfg = data["stamp"]["config"]
    total = cfg["buckets"] * common.parse_size(cfg["bucket_size"])
    rows, series = [], {}
    for machines, run in data["runs"].items():
        if "error" in run:
            rows.append([machines, "failed", run["error"], "", "", ""])
            continue
        gloo_s = common.median(run["times"]["gloo"])
        for variant, times in run["times"].items():
            t = common.median(times)
            slice_bytes = run["slices"].get(variant)
            rows.append(
                [
                    machines,
                    variant,
                    report.ms(t),
                    report.mbps(common.busbw(total, t, run["world"])),
                    common.show_size(slice_bytes) if slice_bytes else "",
                    report.ratio(gloo_s / t),
                ]
            )
            xs, ys = series.setdefault(variant, ([], []))
            xs.append(int(machines))
            ys.append(common.busbw(total, t, run["world"]) / 1e6)
    markdown = (
        f"# Scaling with machines (x1 rank, {cfg['where']})\n\n"
        + report.stamp_lines(data["stamp"])
        + f"\n{cfg['buckets']} buckets of {cfg['bucket_size']}B, all async at once; median of"
        f" {cfg['iters']} iterations (slowest rank). busbw = 2(M-1)/M x total / t.\n\n"
        + report.table(
            ["machines", "variant", "total ms", "busbw MB/s", "effective slice", "speedup vs gloo"],
            rows,
        )
    )

    def plot(path: Path) -> None:
        report.line_plot(
            path,
            {"bus bandwidth vs machines": series},
            "machines (x1 rank)",
            "bus bandwidth (MB/s)",
            title=f"scaling ({cfg['where']})",
        )

    return markdown, plot


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
