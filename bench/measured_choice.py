"""The measured choice (``FAIRRING_CPU_ALLREDUCE=auto``) against both of its ways, and
what its trials cost: one-shot allreduces, Gloo, fairring's engine and ``auto``, side by
side in the same processes.

    python bench/measured_choice.py --shapes 4x1,2x2 --rate 1gbit

Each size is a size class of its own. For each, the ``auto`` group first runs the class's
trials (its first ``TRIAL_CALLS`` calls and the decision call, in iterations of calls
back to back as the timing runs them, each after a barrier, the slowest rank's time),
then the three groups are timed interleaved as in allreduce_sizes.py, the order rotated
each iteration. The trials' cost is their time less as many calls at ``auto``'s median
after them. The target (issue 39): ``auto`` after its trials at least 0.97x the
better of the engine and Gloo at every size.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import allreduce_sizes
import report

import common

DEFAULT_SIZES = "64K,256K,1M,4M,25M,100M"  # one class each
TARGET = 0.97
VARIANTS = ("gloo", "engine", "auto")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--shapes", default="4x1,2x2", help="machines x ranks, comma-separated")
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument(
        "--small-iters",
        type=int,
        default=12,
        help="iterations below 4 MiB, where a loaded host's wake-ups spread the times most",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rate", default=None, help="netns cluster with tbf-shaped links (1gbit)")
    p.add_argument("--netns", action="store_true", help="netns cluster, unshaped")
    p.add_argument("--name", default=None, help="results file stem")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per shape")
    common.add_output_args(p)
    return p.parse_args(argv)


def sizes_of(args: argparse.Namespace) -> list[int]:
    return [common.parse_size(s) for s in args.sizes.split(",")]


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from fairring_pg.group_info import measured_choices
    from fairring_pg.measured import TRIAL_CALLS

    common.init_worker()
    groups = {
        "gloo": dist.group.WORLD,
        "engine": common.fairring_group(FAIRRING_CPU_ALLREDUCE="engine"),
        "auto": common.fairring_group(FAIRRING_CPU_ALLREDUCE="auto"),
    }
    results: dict[str, Any] = {}
    for size in sizes_of(args):
        tensor = torch.zeros(size // 4, dtype=torch.float32)
        reps = allreduce_sizes.reps_for(size)
        # The class's trials and its decision call, as the timing below runs its calls:
        # iterations of `reps` back to back, each after a barrier (the same load on the
        # link as the figures the trials decide).
        trial = []
        for _ in range(-(-(TRIAL_CALLS + 1) // reps)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(tensor, group=groups["auto"])
            trial.append(time.perf_counter() - start)
        slowest = torch.tensor(trial, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        decision = [
            d
            for d in measured_choices(groups["auto"])
            if d["from_bytes"] <= size and (d["to_bytes"] is None or size < d["to_bytes"])
        ]

        def run(group: Any, tensor: torch.Tensor = tensor, reps: int = reps) -> None:
            for _ in range(reps):
                dist.all_reduce(tensor, group=group)

        variants = {name: (lambda g=g: run(g)) for name, g in groups.items()}
        iters = args.iters if size >= 4 * common.MIB else max(args.iters, args.small_iters)
        times, losses = rotated_iterations(variants, iters, args.warmup)
        results[str(size)] = {
            "reps": reps,
            **{k: [t / reps for t in v] for k, v in times.items()},
            "tcp_losses": {"counters": list(LOSS_COUNTERS), **losses},
            "trial_s": slowest.tolist(),  # per iteration of `reps` calls
            "decision": decision[0] if decision else None,
        }
    common.write_worker_result(args.raw_out, {"world": dist.get_world_size(), "sizes": results})
    dist.destroy_process_group()


LOSS_COUNTERS = ("RetransSegs", "TCPTimeouts")


def tcp_losses() -> list[int]:
    """This namespace's TCP retransmitted segments and retransmission timeouts so far
    (/proc/net is the reading process's own network namespace: one simulated machine)."""
    found: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = Path(path).read_text().splitlines()
        for names, values in zip(lines[::2], lines[1::2], strict=False):
            for name, value in zip(names.split()[1:], values.split()[1:], strict=True):
                found.setdefault(name, int(value))
    return [found.get(name, 0) for name in LOSS_COUNTERS]


def rotated_iterations(
    variants: dict[str, Any], iters: int, warmup: int
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]]]:
    """common.time_iterations, with the variants' order rotated each iteration: two of
    them are the same engine at 2 x 2 (auto is sure of it), and a fixed order would give
    one the other's wake-ups. Also each iteration's TCP losses (LOSS_COUNTERS), summed
    over the ranks (ranks sharing a machine count its losses each: read as 0 or not)."""
    import torch
    import torch.distributed as dist

    names = list(variants)
    for _ in range(warmup):
        for name in names:
            dist.barrier()
            variants[name]()
    mine: dict[str, list[float]] = {name: [] for name in names}
    losses: dict[str, list[list[int]]] = {name: [] for name in names}
    for i in range(iters):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            dist.barrier()
            before = tcp_losses()
            start = time.perf_counter()
            variants[name]()
            mine[name].append(time.perf_counter() - start)
            losses[name].append([b - a for a, b in zip(before, tcp_losses(), strict=True)])
    flat = torch.tensor([t for name in names for t in mine[name]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # the slowest rank's
    values = flat.tolist()
    counts = torch.tensor([losses[name] for name in names], dtype=torch.int64)
    dist.all_reduce(counts)
    summed = counts.tolist()
    return (
        {name: values[i * iters : (i + 1) * iters] for i, name in enumerate(names)},
        {name: summed[i] for i, name in enumerate(names)},
    )


def driver(args: argparse.Namespace) -> int:
    shapes = [common.parse_shape(s) for s in args.shapes.split(",")]
    place = common.placement(args, "measured_choice")
    forwarded = [
        "--sizes",
        ",".join(str(s) for s in sizes_of(args)),
        "--iters",
        str(args.iters),
        "--small-iters",
        str(args.small_iters),
        "--warmup",
        str(args.warmup),
    ]
    runs = {}
    for machines, ranks in shapes:
        shape = f"{machines}x{ranks}"
        code, result = common.run_workers(
            Path(__file__), args, place, shape, forwarded, machines, ranks, f"{place.name}_{shape}"
        )
        runs[shape] = result if result is not None else {"error": f"exit status {code}"}
    config = {
        "where": place.where,
        "rate": args.rate,
        "iters": args.iters,
        "small_iters": args.small_iters,
        "warmup": args.warmup,
        "shapes": args.shapes,
        "timing": "median over iterations of the slowest rank",
    }
    common.stamp_and_save("measured_choice", place.name, config, render, {"runs": runs}, args.out)
    return 0 if all("error" not in r for r in runs.values()) else 1


def summarize(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size: each variant's median and best seconds, auto against the better of the
    other two, and what the trials cost."""
    rows = []
    for size_text, per in run["sizes"].items():
        row: dict[str, Any] = {"size": int(size_text), "decision": per["decision"]}
        for name in VARIANTS:
            row[f"{name}_s"] = common.median(per[name])
            row[f"{name}_best_s"] = min(per[name])
        row["vs_better"] = min(row["gloo_s"], row["engine_s"]) / row["auto_s"]
        row["vs_better_best"] = min(row["gloo_best_s"], row["engine_best_s"]) / row["auto_best_s"]
        trial = per["trial_s"]
        row["trial_s"] = sum(trial)
        row["trial_calls"] = len(trial) * per["reps"]
        row["trial_extra_s"] = sum(trial) - row["trial_calls"] * row["auto_s"]
        rows.append(row)
    return rows


def _chose(decision: dict[str, Any] | None) -> str:
    if decision is None:
        return "engine (sure: no trials)"
    seconds = " / ".join(report.ms(s) for s in decision["seconds"])
    return f"{decision['winner']} ({seconds} ms)"


def render(data: dict[str, Any]) -> tuple[str, Any]:
    stamp = data["stamp"]
    parts = [
        f"# The measured choice against both of its ways ({stamp['config']['where']})\n\n",
        report.stamp_lines(stamp),
        "\n",
        "Times are per allreduce, medians over iterations of the slowest rank; `auto` is "
        "timed after its trials. *vs better*: the better of the engine's and Gloo's time "
        f"over auto's (target at least {TARGET}x; best of: fastest iterations). *chose*: "
        "the winner, and the times it saw (engine / ring: a call at the slowest rank's "
        "median speed). *trials*: the first iterations of auto, which hold the class's 12 "
        "trial calls and its decision call (calls: how many they ran); *extra*: their time "
        "less as many calls at auto's median after them.\n\n",
    ]
    panels = {}
    for shape, run in data["runs"].items():
        parts.append(f"## {shape} (machines x ranks)\n\n")
        if "error" in run:
            parts.append(f"failed: {run['error']}\n\n")
            continue
        rows = summarize(run)
        parts.append(
            report.table(
                [
                    "size",
                    "gloo ms",
                    "engine ms",
                    "auto ms",
                    "chose",
                    "vs better",
                    "vs better (best of)",
                    "trials ms (calls)",
                    "extra ms",
                ],
                [
                    [
                        common.show_size(r["size"]),
                        report.ms(r["gloo_s"]),
                        report.ms(r["engine_s"]),
                        report.ms(r["auto_s"]),
                        _chose(r["decision"]),
                        report.ratio(r["vs_better"]),
                        report.ratio(r["vs_better_best"]),
                        f"{report.ms(r['trial_s'])} ({r['trial_calls']})",
                        report.ms(r["trial_extra_s"]),
                    ]
                    for r in rows
                ],
            )
        )
        parts.append("\n")
        panels[shape] = {
            name: ([r["size"] for r in rows], [r["size"] / r[f"{name}_s"] / 1e6 for r in rows])
            for name in VARIANTS
        }

    def plot(path: Path) -> None:
        report.line_plot(
            path,
            panels,
            "allreduce size (bytes)",
            "algorithm bandwidth (MB/s)",
            logx=True,
            title="the measured choice",
        )

    return "".join(parts), plot


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
