"""FSDP's collectives, reduce-scatter and all-gather, fairring vs Gloo at 2x2.

    python bench/fsdp.py                      # 2 machines x 2 ranks, loopback
    python bench/fsdp.py --sizes 25M --iters 9

Sizes are the big tensor's: the reduce-scatter's input and the all-gather's output
(world x each rank's part), as FSDP passes a flat gradient or parameter buffer. Each
iteration is one collective (small sizes: a run of back-to-back ones, each waited, timed
together), right after a barrier; the figure is the median over iterations of the
slowest rank. Both backends run in the same processes, iterations alternating. FSDP2
training itself is bench/e2e.py --fsdp.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import report

import common

DEFAULT_SIZES = "64K,25M,100M"
SMALL_RUN_BYTES = 4 * common.MIB
MAX_REPS = 50
COLLECTIVES = ("reduce_scatter", "all_gather")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--shape", default="2x2")
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rate", default=None)
    p.add_argument("--netns", action="store_true")
    p.add_argument("--name", default=None)
    p.add_argument("--timeout", type=float, default=400.0)
    common.add_output_args(p)
    return p.parse_args(argv)


def reps_for(size: int) -> int:
    return max(1, min(MAX_REPS, SMALL_RUN_BYTES // max(size, 1)))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    common.init_worker()
    world = dist.get_world_size()
    groups = {"gloo": dist.group.WORLD, "fairring": common.fairring_group()}
    # The names FSDP2 calls since torch 2.13 (the older ones warn there); 2.11 has only those.
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    results: dict[str, Any] = {}
    for size in [common.parse_size(s) for s in args.sizes.split(",")]:
        big = torch.zeros(size // 4, dtype=torch.float32)
        part = torch.zeros(size // 4 // world, dtype=torch.float32)
        reps = reps_for(size)

        def rs(
            group: Any, big: torch.Tensor = big, part: torch.Tensor = part, reps: int = reps
        ) -> None:
            for _ in range(reps):
                reduce_scatter(part, big, group=group)

        def ag(
            group: Any, big: torch.Tensor = big, part: torch.Tensor = part, reps: int = reps
        ) -> None:
            for _ in range(reps):
                all_gather(big, part, group=group)

        for name, fn in (("reduce_scatter", rs), ("all_gather", ag)):
            variants = {b: (lambda g=g, fn=fn: fn(g)) for b, g in groups.items()}
            times = common.time_iterations(variants, args.iters, args.warmup, dist.barrier)
            results[f"{name}/{size}"] = {
                "reps": reps,
                **{k: [t / reps for t in v] for k, v in times.items()},
            }
    common.write_worker_result(args.raw_out, {"world": world, "results": results})
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> int:
    machines, ranks = common.parse_shape(args.shape)
    place = common.placement(args, "fsdp")
    forwarded = ["--sizes", args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    code, results = common.run_workers(
        Path(__file__), args, place, args.shape, forwarded, machines, ranks, place.name
    )
    if results is None:
        return code
    config = {
        "where": place.where,
        "rate": args.rate,
        "shape": args.shape,
        "iters": args.iters,
        "timing": "median over iterations of the slowest rank",
    }
    common.stamp_and_save("fsdp", place.name, config, render, results, args.out)
    return 0


def summarize(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (collective, size): median seconds of each backend and the speedup."""
    rows = []
    for key, per in data["results"].items():
        name, size = key.split("/")
        row: dict[str, Any] = {"collective": name, "size": int(size)}
        for b in ("gloo", "fairring"):
            row[f"{b}_s"] = common.median(per[b])
            row[f"{b}_best_s"] = min(per[b])
        row["speedup"] = row["gloo_s"] / row["fairring_s"]
        row["speedup_best"] = row["gloo_best_s"] / row["fairring_best_s"]
        rows.append(row)
    return rows


def render(data: dict[str, Any]) -> tuple[str, Any]:
    cfg = data["stamp"]["config"]
    rows = summarize(data)
    markdown = (
        f"# FSDP collectives: {cfg['shape']} ({cfg['where']})\n\n"
        + report.stamp_lines(data["stamp"])
        + "\nSize: the reduce-scatter's input, the all-gather's output (float32). "
        "speedup = Gloo time / fairring time (medians; best of: fastest iterations).\n\n"
        + report.table(
            ["collective", "size", "gloo ms", "fairring ms", "speedup", "speedup (best of)"],
            [
                [
                    r["collective"],
                    common.show_size(r["size"]),
                    report.ms(r["gloo_s"]),
                    report.ms(r["fairring_s"]),
                    report.ratio(r["speedup"]),
                    report.ratio(r["speedup_best"]),
                ]
                for r in rows
            ],
        )
    )

    def plot(path: Path) -> None:
        panels = {
            c: {
                b: (
                    [r["size"] for r in rows if r["collective"] == c],
                    [r[f"{b}_s"] * 1e3 for r in rows if r["collective"] == c],
                )
                for b in ("gloo", "fairring")
            }
            for c in COLLECTIVES
        }
        report.line_plot(path, panels, "size (bytes)", "ms", logx=True, title="FSDP collectives")

    return markdown, plot


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
