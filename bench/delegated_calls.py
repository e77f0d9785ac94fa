"""What the announcement costs the CPU collectives fairring hands to Gloo.

    python bench/delegated_calls.py --shapes 2x1,2x2 --iters 60
    python bench/delegated_calls.py --shapes 4x1 --rate 1gbit     # root and iproute2

A broadcast, a gather and an all_to_all_single (fairring runs none of them) reach Gloo
only once every rank announced the same call on fairring's engine
(src/cpu/gloo_calls.h): one empty message to each machine and rail peer. Each
worker times the same calls on a fairring group and on Gloo's own group in the same
processes, interleaved iteration by iteration, and prints the medians, their ratio
(Gloo's time over fairring's: below 1 is what the check costs) and the interquartile
range of each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import common

BENCHMARK = "delegated_calls"
CALLS = ("broadcast", "gather", "all_to_all")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument(
        "--shapes", default="2x1,2x2", help="machines x ranks per machine, comma-separated"
    )
    p.add_argument("--sizes", default="4K,64K,1M", help="bytes per rank, comma-separated")
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rate", help="a shaped namespace link (e.g. 1gbit); loopback without")
    p.add_argument("--netns", action="store_true", help="namespace hosts, unshaped")
    p.add_argument("--name", help="the results' file name (default from the placement)")
    p.add_argument("--timeout", type=float, default=600.0)
    common.add_output_args(p)
    return p.parse_args(argv)


def _quartiles(values: list[float]) -> tuple[float, float]:
    s = sorted(values)
    return s[len(s) // 4], s[(3 * len(s)) // 4]


def _call(name: str, group: Any, n: int) -> Any:
    """One call of `name` on `group`, `n` float32 elements per rank."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.ones(n)
    if name == "broadcast":
        return lambda: dist.broadcast(t, src=0, group=group)
    if name == "gather":
        gathered = [torch.empty(n) for _ in range(world)] if rank == 0 else None
        return lambda: dist.gather(t, gathered, dst=0, group=group)
    out = torch.empty(n)
    return lambda: dist.all_to_all_single(out, t, group=group)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    common.init_worker(args.timeout)
    world = dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    fairring = common.fairring_group()
    rows: list[dict[str, Any]] = []
    for size in [common.parse_size(s) for s in args.sizes.split(",")]:
        n = max(world, size // 4 // world * world)
        for name in CALLS:
            times = common.time_iterations(
                {"gloo": _call(name, gloo, n), "fairring": _call(name, fairring, n)},
                args.iters,
                args.warmup,
                dist.barrier,
            )
            g, f = common.median(times["gloo"]), common.median(times["fairring"])
            rows.append(
                {
                    "call": name,
                    "bytes": n * 4,
                    "gloo_ms": g * 1e3,
                    "fairring_ms": f * 1e3,
                    "ratio": g / f,
                    "gloo_iqr_ms": [q * 1e3 for q in _quartiles(times["gloo"])],
                    "fairring_iqr_ms": [q * 1e3 for q in _quartiles(times["fairring"])],
                }
            )
    common.write_worker_result(args.raw_out, {"rows": rows})
    dist.destroy_process_group(fairring)


def _commit(stamp: dict[str, Any]) -> str:
    return stamp["git_commit"] + (" with uncommitted changes" if stamp["git_dirty"] else "")


def _render(data: dict[str, Any]) -> tuple[str, Any]:
    lines = [
        "# CPU collectives handed to Gloo, announced on fairring's engine",
        "",
        f"`{data['command']}` at {_commit(data['stamp'])}, {data['iters']} iterations"
        " each, medians of the slowest rank's time per call; ratio = Gloo's median over"
        " fairring's (below 1: what the announcement costs); IQR = the middle half.",
        "",
        "| shape | call | bytes per rank | Gloo ms (IQR) | fairring ms (IQR) | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for shape, rows in data["shapes"].items():
        for r in rows:
            gq, fq = r["gloo_iqr_ms"], r["fairring_iqr_ms"]
            lines.append(
                f"| {shape} | {r['call']} | {common.show_size(r['bytes'])} |"
                f" {r['gloo_ms']:.3f} ({gq[0]:.3f}–{gq[1]:.3f}) |"
                f" {r['fairring_ms']:.3f} ({fq[0]:.3f}–{fq[1]:.3f}) | {r['ratio']:.2f} |"
            )
    return "\n".join(lines) + "\n", lambda path: None


def driver(args: argparse.Namespace) -> int:
    place = common.placement(args, BENCHMARK)
    forwarded = ["--sizes", args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    shapes: dict[str, Any] = {}
    for shape in args.shapes.split(","):
        machines, local = common.parse_shape(shape)
        code, raw = common.run_workers(
            Path(__file__), args, place, shape, forwarded, machines, local, f"{BENCHMARK}_{shape}"
        )
        if raw is None:
            return code
        shapes[shape] = raw["rows"]
    command = "python bench/delegated_calls.py " + " ".join(sys.argv[1:])
    common.stamp_and_save(
        BENCHMARK,
        place.name,
        {"shapes": args.shapes, "sizes": args.sizes, "iters": args.iters, "rate": args.rate},
        _render,
        {"shapes": shapes, "command": command, "iters": args.iters},
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
