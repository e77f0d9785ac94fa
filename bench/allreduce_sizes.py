"""One-shot allreduce vs size, fairring and Gloo side by side, for several M x L shapes.

    python bench/allreduce_sizes.py                       # loopback, 2x2 4x1 1x4
    python bench/allreduce_sizes.py --shapes 4x1 --rate 1gbit --max-size 100M

Each iteration is one allreduce (or, for small sizes, a run of back-to-back ones, each
waited, timed together to get above the clock's and the barrier's noise), started
right after a barrier; the figure is the median over iterations of the slowest rank.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import mpi_allreduce
import report

import common

DEFAULT_SIZES = "4K,64K,256K,1M,4M,16M,25M,64M,100M,256M"
SMALL_RUN_BYTES = 4 * common.MIB  # small sizes repeat until an iteration moves this much
MAX_REPS = 50


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--shapes", default="2x2,4x1,1x4", help="machines x ranks, comma-separated")
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--max-size", default=None, help="drop sizes above this")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rate", default=None, help="netns cluster with tbf-shaped links (1gbit)")
    p.add_argument("--netns", action="store_true", help="netns cluster, unshaped")
    p.add_argument("--name", default=None, help="results file stem")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per shape")
    common.add_output_args(p)
    return p.parse_args(argv)


def sizes_of(args: argparse.Namespace) -> list[int]:
    sizes = [common.parse_size(s) for s in args.sizes.split(",")]
    if args.max_size:
        sizes = [s for s in sizes if s <= common.parse_size(args.max_size)]
    return sizes


def reps_for(size: int) -> int:
    return max(1, min(MAX_REPS, SMALL_RUN_BYTES // max(size, 1)))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    common.init_worker()
    groups = {"gloo": dist.group.WORLD, "fairring": common.fairring_group()}
    results: dict[str, Any] = {}
    for size in sizes_of(args):
        # Zeros: summing them repeatedly never overflows, and costs what any float does.
        tensor = torch.zeros(size // 4, dtype=torch.float32)
        reps = reps_for(size)

        def run(group: Any, tensor: torch.Tensor = tensor, reps: int = reps) -> None:
            for _ in range(reps):
                dist.all_reduce(tensor, group=group)

        variants = {name: (lambda g=g: run(g)) for name, g in groups.items()}
        times = common.time_iterations(variants, args.iters, args.warmup, dist.barrier)
        results[str(size)] = {"reps": reps, **{k: [t / reps for t in v] for k, v in times.items()}}
    common.write_worker_result(args.raw_out, {"world": dist.get_world_size(), "sizes": results})
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> int:
    shapes = [common.parse_shape(s) for s in args.shapes.split(",")]
    place = common.placement(args, "allreduce_sizes")
    forwarded = [
        "--sizes",
        ",".join(str(s) for s in sizes_of(args)),
        "--iters",
        str(args.iters),
        "--warmup",
        str(args.warmup),
    ]
    runs = {}
    goodput = None
    if place.netns:
        # What one TCP stream gets through such a link: the practical ceiling.
        with common.netns_cluster.running_cluster(2, args.rate) as cluster:
            goodput = common.netns_cluster.tcp_goodput(cluster)
        print(f"== link goodput (1 TCP stream): {goodput / 1e6:.1f} MB/s", flush=True)
    for machines, ranks in shapes:
        shape = f"{machines}x{ranks}"
        code, result = common.run_workers(
            Path(__file__), args, place, shape, forwarded, machines, ranks, f"{place.name}_{shape}"
        )
        runs[shape] = result if result is not None else {"error": f"exit status {code}"}
        runs[shape]["mpi"] = _mpi(place.netns, machines, ranks, args)
    config = {
        "where": place.where,
        "rate": args.rate,
        "iters": args.iters,
        "warmup": args.warmup,
        "shapes": args.shapes,
        "timing": "median over iterations of the slowest rank",
    }
    common.stamp_and_save(
        "allreduce_sizes",
        place.name,
        config,
        render,
        {"runs": runs, "link_goodput": goodput},
        args.out,
    )
    return 0 if all("error" not in r for r in runs.values()) else 1


def _mpi(netns: bool, machines: int, ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """MPICH's times of the same sizes (bench/mpi_allreduce.py), or why there are none."""
    if netns:
        return {"error": "not run on the namespace cluster (mpiexec places no rank there)"}
    sizes = sizes_of(args)
    reps = [reps_for(s) for s in sizes]
    result = mpi_allreduce.run(machines, ranks, sizes, reps, args.iters, args.warmup)
    print(f"== mpi {machines}x{ranks}: {result.get('error', 'done')}", flush=True)
    return result


def summarize(run: dict[str, Any]) -> list[dict[str, float]]:
    """Per size: median seconds, algbw, busbw for each backend, and the ratio."""
    rows = []
    world = run["world"]
    for size_text, per in run["sizes"].items():
        size = int(size_text)
        row: dict[str, float] = {"size": size}
        for backend in ("gloo", "fairring"):
            t = common.median(per[backend])
            row[f"{backend}_s"] = t
            row[f"{backend}_algbw"] = common.algbw(size, t)
            row[f"{backend}_busbw"] = common.busbw(size, t, world)
            row[f"{backend}_best_s"] = min(per[backend])
        row["speedup"] = row["gloo_s"] / row["fairring_s"]
        # Other jobs on a shared host only ever slow an iteration down: the best-of ratio
        # shows how much of a gap is noise.
        row["speedup_best"] = row["gloo_best_s"] / row["fairring_best_s"]
        mpi = run.get("mpi", {}).get("sizes", {}).get(size_text)
        if mpi:
            row["mpi_s"] = common.median(mpi)
            row["vs_mpi"] = row["mpi_s"] / row["fairring_s"]
        rows.append(row)
    return rows


def render(data: dict[str, Any]) -> tuple[str, Any]:
    stamp = data["stamp"]
    rate = stamp["config"].get("rate")
    parts = [
        f"# One-shot allreduce vs size ({stamp['config']['where']})\n\n",
        report.stamp_lines(stamp),
        "\n",
        "Times are per allreduce; bandwidths in MB/s (10^6 B/s); algbw = S/t, "
        "busbw = 2(N-1)/N·S/t; speedup = Gloo time / fairring time (medians; best of:"
        " fastest iterations); vs MPI = MPICH's time / fairring's (bench/mpi_allreduce.py,"
        " started by its own mpiexec after the other two).\n\n",
    ]
    goodput = data.get("link_goodput")
    if goodput:
        parts.append(
            f"Link: {rate} per host and direction (tc tbf); one TCP stream between two"
            f" hosts moves {report.mbps(goodput)} MB/s of payload.\n\n"
        )
    panels = {}
    for shape, run in data["runs"].items():
        parts.append(f"## {shape} (machines x ranks)\n\n")
        if "error" in run:
            parts.append(f"failed: {run['error']}\n\n")
            continue
        rows = summarize(run)
        parts.append(_table(rows))
        mpi_error = run.get("mpi", {}).get("error")
        if mpi_error:
            parts.append(f"\nMPI: {mpi_error}.\n")
        parts.append("\n")
        panels[shape] = {
            b: ([r["size"] for r in rows], [r[f"{b}_busbw"] / 1e6 for r in rows])
            for b in ("gloo", "fairring")
        }
    hlines = {f"link {rate}": _rate_bytes(rate) / 1e6} if rate else {}
    if goodput:
        hlines["TCP goodput"] = goodput / 1e6

    def plot(path: Path) -> None:
        report.line_plot(
            path,
            panels,
            "allreduce size (bytes)",
            "bus bandwidth (MB/s)",
            logx=True,
            hlines=hlines,
            title="one-shot allreduce",
        )

    return "".join(parts), plot


def _table(rows: list[dict[str, float]]) -> str:
    """One shape's table: Gloo, fairring and (where it ran) MPICH; "vs MPI" is MPICH's
    time / fairring's (above 1: fairring is faster)."""
    mpi = any("mpi_s" in r for r in rows)
    head = ["size", "gloo ms", "fairring ms"] + (["mpi ms"] if mpi else [])
    head += ["gloo algbw", "fairring algbw", "gloo busbw", "fairring busbw", "speedup"]
    head += ["speedup (best of)"] + (["vs MPI"] if mpi else [])

    def line(r: dict[str, float]) -> list[str]:
        cells = [
            common.show_size(int(r["size"])),
            report.ms(r["gloo_s"]),
            report.ms(r["fairring_s"]),
        ]
        cells += [report.ms(r["mpi_s"]) if "mpi_s" in r else "-"] if mpi else []
        cells += [
            report.mbps(r[f"{b}_{w}"]) for w in ("algbw", "busbw") for b in ("gloo", "fairring")
        ]
        cells += [report.ratio(r["speedup"]), report.ratio(r["speedup_best"])]
        cells += [report.ratio(r["vs_mpi"]) if "vs_mpi" in r else "-"] if mpi else []
        return cells

    return report.table(head, [line(r) for r in rows])


def _rate_bytes(rate: str) -> float:
    """tc rate ('1gbit', '500mbit') in bytes/s."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, scale in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"unknown rate {rate!r}")


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
