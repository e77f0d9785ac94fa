"""The cost model (fairring_pg.model) against the namespace cluster: predicted vs measured.

    python bench/model_validation.py --out bench/results      # both links, all shapes
    python bench/model_validation.py --rates 1gbit --shapes 2x2 --cases 1M,25M

For each link rate and M x L shape, the ranks run on namespace hosts with tc-shaped
links (fairring_pg/tools/netns_cluster.py) and time fairring and Gloo in the same processes
(bench/common.py): one allreduce of 64 KiB, 256 KiB, 1, 25 and 100 MiB, and a burst of
16 x 25 MiB issued at once, each only where fairring's engine runs it: with one rank per
machine FAIRRING_CPU_ALLREDUCE=auto hands allreduces from 1 MiB to Gloo's ring, and
timing Gloo's ring against itself tests nothing of the engine. The model predicts each
from this machine's primitives (copy and reduction bandwidth, loopback message and TCP
costs, one TCP stream's share of a shaped link), measured by
fairring_pg.model.calibration before the runs, never from the runs themselves. Run it
alone on the host (flock -x /tmp/fairring-cpu.lock): the primitives and the runs are both
timings.

The report also sets the model beside the CUDA runs on one H100 (bench/results/cuda/)
and beside the loopback runs of bench/allreduce_sizes.py (no link: CPU-bound), which it
does not validate.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import common
from fairring_pg.config import Config
from fairring_pg.model import calibration
from fairring_pg.model.cpu import CpuCluster, predict_cpu

TOLERANCE = 0.15
DEFAULT_CASES = "1M,25M,100M,16x25M"
# With one rank per machine the engine runs only allreduces below 1 MiB (larger ones
# are Gloo's ring): these take the place of the others there.
ONE_RANK_CASES = "64K,256K"
# Timed iterations per case: a 1 MiB allreduce is cheap, a burst at 300 Mbit/s is not.
ITERATIONS = {64 << 10: 9, 256 << 10: 9, 1 << 20: 9, 25 << 20: 3}
DEFAULT_ITERATIONS = 2
CUDA_RESULTS = common.RESULTS / "cuda"


def parse_case(text: str) -> tuple[int, int]:
    """'25M' -> (1, 25 MiB); '16x25M' -> (16, 25 MiB): count issued at once, bytes each."""
    count, _, size = text.rpartition("x")
    return (int(count) if count else 1), common.parse_size(size)


def case_name(count: int, size: int) -> str:
    return common.show_size(size) if count == 1 else f"{count} x {common.show_size(size)}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--rates", default="1gbit,300mbit", help="link rates (tc), comma-separated")
    p.add_argument("--shapes", default="2x2,4x1,2x3,3x2", help="machines x ranks, comma-separated")
    p.add_argument("--cases", default=DEFAULT_CASES, help="sizes; NxSIZE: N issued at once")
    p.add_argument(
        "--one-rank-cases",
        default=ONE_RANK_CASES,
        help="sizes for shapes of one rank per machine, where the engine runs only small ones",
    )
    p.add_argument("--iters", type=int, default=None, help="timed iterations of every case")
    p.add_argument("--recalibrate", action="store_true", help="measure the primitives again")
    p.add_argument("--timeout", type=float, default=500.0, help="seconds per launch")
    p.add_argument("--name", default="model_validation")
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.rate = None  # placement: always the shaped cluster, one rate per launch
    args.netns = True
    return args


def engine_cases(cases: list[str], machines: int, ranks: int, config: Config) -> list[str]:
    """The cases fairring's engine runs on this shape: not those it hands to Gloo's ring
    (FAIRRING_CPU_ALLREDUCE, the same on every rank)."""
    ring_from = config.cpu_ring_from(machines, ranks)
    return [c for c in cases if not 0 <= ring_from <= parse_case(c)[1]]


def shape_cases(args: argparse.Namespace, machines: int, ranks: int, config: Config) -> list[str]:
    """What to time on this shape: the cases the engine runs, and with one rank per
    machine the small ones in place of those Gloo's ring takes."""
    small = args.one_rank_cases.split(",") if ranks == 1 and args.one_rank_cases else []
    return engine_cases(small + args.cases.split(","), machines, ranks, config)


def iterations(args: argparse.Namespace, size: int) -> int:
    return args.iters or ITERATIONS.get(size, DEFAULT_ITERATIONS)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    common.init_worker()
    groups = {"gloo": dist.group.WORLD, "fairring": common.fairring_group()}
    machines = int(os.environ["NNODES"])
    ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    cases = [parse_case(c) for c in shape_cases(args, machines, ranks, Config.from_env())]
    results: dict[str, Any] = {}
    for index, (count, size) in enumerate(cases):
        tensors = [torch.zeros(size // 4) for _ in range(count)]

        def run(group: Any, tensors: list[torch.Tensor] = tensors) -> None:
            works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
            for work in works:
                work.wait()

        variants = {name: (lambda g=g: run(g)) for name, g in groups.items()}
        # The first case also opens the connections; later ones need no warm-up.
        warmup = 1 if index == 0 else 0
        times = common.time_iterations(variants, iterations(args, size), warmup, dist.barrier)
        results[f"{count}x{size}"] = times
        del tensors
    common.write_worker_result(args.raw_out, {"world": dist.get_world_size(), "cases": results})
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> int:
    rates = args.rates.split(",")
    shapes = [common.parse_shape(s) for s in args.shapes.split(",")]
    print(f"== primitives (links {', '.join(rates)})", flush=True)
    primitives = calibration.calibrate(tuple(rates), force=args.recalibrate, log=sys.stdout)
    forwarded = ["--cases", args.cases, "--one-rank-cases", args.one_rank_cases]
    if args.iters:
        forwarded += ["--iters", str(args.iters)]
    runs: dict[str, Any] = {}
    failed = False
    for rate in rates:
        args.rate = rate
        place = common.placement(args, "model_validation")
        for machines, ranks in shapes:
            shape = f"{machines}x{ranks}"
            code, result = common.run_workers(
                Path(__file__), args, place, shape, forwarded, machines, ranks,
                f"model_validation_{rate}_{shape}",
            )  # fmt: skip
            runs[f"{rate} {shape}"] = result if result is not None else {"error": f"exit {code}"}
            failed |= result is None
    config = {
        "rates": args.rates,
        "shapes": args.shapes,
        "cases": args.cases,
        "one_rank_cases": args.one_rank_cases,
        "timing": "median over iterations of the slowest rank",
    }
    results = {
        "runs": runs,
        "primitives": asdict(primitives),
        "calibration_file": str(calibration.cache_path()),
        "predictions": predictions(runs, primitives),
        "cuda": cuda_comparison(),
        "loopback": loopback_comparison(primitives, common.stamp({})),
    }
    common.stamp_and_save("model_validation", args.name, config, render, results, args.out)
    return 1 if failed else 0


def predictions(runs: dict[str, Any], p: calibration.Primitives) -> list[dict[str, Any]]:
    """One row per (link, shape, case): the model's figure and the measured median."""
    from fairring_pg.model.units import parse_rate

    rows = []
    for key, run in runs.items():
        if "error" in run:
            continue
        rate, shape = key.split()
        machines, ranks = common.parse_shape(shape)
        cluster = CpuCluster(machines, ranks, parse_rate("rate", rate), p.efficiency(rate))
        for case, times in run["cases"].items():
            count, size = (int(x) for x in case.split("x"))
            model = predict_cpu(cluster, [size] * count, p)
            row: dict[str, Any] = {
                "link": rate,
                "shape": shape,
                "count": count,
                "size": size,
                "engine": bool(engine_cases([case_text(count, size)], machines, ranks, Config())),
            }
            for backend, seconds, bound in (
                ("fairring", model.fairring_s, model.fairring.bottleneck),
                ("gloo", model.reference_s, model.gloo.bottleneck),
            ):
                measured = common.median(times[backend])
                row[backend] = {
                    "predicted_s": seconds,
                    "measured_s": measured,
                    "error": (seconds - measured) / measured,
                    "bound": bound,
                }
            rows.append(row)
    return rows


def case_text(count: int, size: int) -> str:
    return f"{count}x{size}" if count > 1 else str(size)


def within(row: dict[str, Any]) -> bool:
    return all(abs(row[b]["error"]) <= TOLERANCE for b in ("fairring", "gloo"))


def counted(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that test fairring's engine (older runs also timed Gloo's ring twice)."""
    return [r for r in rows if r.get("engine", True)]


def tbf_burst() -> int:
    """The bytes tc's token bucket lets through a namespace host's link unshaped
    (fairring_pg/tools/netns_cluster.py), which the model knows nothing of."""
    args = common.netns_cluster._tbf_args("1gbit")
    return common.parse_size(args[args.index("burst") + 1])


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows the model claims to describe: fairring's engine's (``counted``), where
    each machine sends more per hop ((M-1)/M of the tensor) than tc's burst; smaller
    allreduces pass the shaper unshaped."""
    burst = tbf_burst()
    return [
        r
        for r in counted(rows)
        if (lambda m: (m - 1) / m * r["size"])(common.parse_shape(r["shape"])[0]) > burst
    ]


def speedup_error(row: dict[str, Any]) -> float:
    """How far the model overstates (> 0) or understates fairring's speedup over Gloo."""
    predicted = row["gloo"]["predicted_s"] / row["fairring"]["predicted_s"]
    measured = row["gloo"]["measured_s"] / row["fairring"]["measured_s"]
    return predicted / measured - 1


def loopback_comparison(p: calibration.Primitives, machine: dict[str, Any]) -> dict[str, Any]:
    """The model beside bench/allreduce_sizes.py's loopback runs (no link: CPU-bound,
    every rank on this host's cores), which it is not validated against: how far below
    the measured times it comes, for the engine's runs from 4 MiB up. Only where those
    runs were on the machine ``p`` was measured on (``machine``: its stamp)."""
    path = common.RESULTS / "allreduce_sizes.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    same = ("host", "cpu", "cores", "kernel")
    if any(data["stamp"].get(k) != machine.get(k) for k in same):
        return {"source": str(path.relative_to(common.REPO)), "other_machine": True}
    rows = []
    for shape, run in data["runs"].items():
        machines, ranks = common.parse_shape(shape)
        cluster = CpuCluster(machines, ranks, None)
        for size_text, times in run["sizes"].items():
            size = int(size_text)
            if not engine_cases([str(size)], machines, ranks, Config()):
                continue
            measured = common.median(times["fairring"])
            predicted = predict_cpu(cluster, [size], p).fairring_s
            rows.append({"shape": shape, "size": size, "error": (predicted - measured) / measured})
    large = [r["error"] for r in rows if r["size"] >= 4 << 20]
    return {
        "source": str(path.relative_to(common.REPO)),
        "measured": data["stamp"]["date"],
        "rows": rows,
        "median_error_from_4mib": statistics.median(large) if large else None,
        "range_from_4mib": [min(large), max(large)] if large else None,
    }


GPU_CHECKS = "model_check_*.json"


def gpu_checks() -> list[Path]:
    """GPU measurements of fairring's composition on machines of their own GPUs and NICs
    (bench/results/cuda/model_check_*.json), which the model is checked against; none
    exist yet (the one-H100 runs share one GPU among simulated machines: below)."""
    return sorted(CUDA_RESULTS.glob(GPU_CHECKS))


def gpu_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The model beside one GPU measurement: predicted and measured times of fairring's
    allreduce (as its plan ran) and of NCCL's, per case.

    ``data``: {"node": a node type of fairring-plan or the machine's facts (the JSON of
    fairring_pg.cuda.node_facts.NodeFacts), "machines": M, "local_size": L, "nccl": "2.28",
    "env": the job's FAIRRING_* variables, "plan": the plan that ran (CudaPlan's JSON;
    optional: else the model's own), "cases": [{"size": bytes, "in_flight": k,
    "fairring_s": seconds, "nccl_s": seconds}]}."""
    from fairring_pg.cuda.node_facts import NodeFacts
    from fairring_pg.model import nccl
    from fairring_pg.model.composition import world_fabric
    from fairring_pg.model.cuda_plan import CudaPlan
    from fairring_pg.model.gpu import fairring_time
    from fairring_pg.model.nodes import NODE_TYPES

    machines, local_size = data["machines"], data["local_size"]
    given = data["node"]
    if isinstance(given, str):
        node = NODE_TYPES[given]
    else:
        node = NodeFacts.from_json(json.dumps(given)).gpu_node(local_size)
    if node is None or node.gpus != local_size:
        raise ValueError(f"a GPU measurement whose machine the model cannot take: {given!r}")
    tuning = next(t for v, t in nccl.TUNINGS.items() if v.startswith(data["nccl"]))
    config = Config.from_env(data.get("env", {}))
    plan = CudaPlan.from_json(json.dumps(data["plan"])) if "plan" in data else None
    rows = []
    for case in data["cases"]:
        size, count = case["size"], case["in_flight"]
        ours, _ = fairring_time(node, machines, [size] * count, config, tuning, plan=plan)
        times = nccl.collective_times(tuning, world_fabric(node), machines, size)
        theirs = count * nccl.best(times).seconds
        row: dict[str, Any] = {"size": size, "in_flight": count}
        for side, predicted in (("fairring", ours.seconds), ("nccl", theirs)):
            measured = case[f"{side}_s"]
            row[side] = {
                "predicted_s": predicted,
                "measured_s": measured,
                "error": (predicted - measured) / measured,
            }
        speedups = [row["nccl"][k] / row["fairring"][k] for k in ("predicted_s", "measured_s")]
        row["speedup_error"] = speedups[0] / speedups[1] - 1
        rows.append(row)
    return rows


def cuda_comparison() -> list[dict[str, Any]]:
    """The model beside the CUDA runs on one H100 (M x 1, NCCL sockets on loopback).

    Nothing of that machine was calibrated (no GPU here): the link between simulated
    machines is taken as what NCCL's own ring moved at 100 MiB in the same run (its
    busbw), i.e. the reference sets the link and the model predicts fairring from it."""
    from fairring_pg.config import Config
    from fairring_pg.model.composition import FAIRRING_PG_SLICES
    from fairring_pg.model.gpu import fairring_time
    from fairring_pg.model.nodes import GpuNode

    rows = []
    for path in sorted(CUDA_RESULTS.glob("h100_lanes2_direct2m_*x1.json")):
        machines = int(path.stem.rsplit("_", 1)[1].split("x")[0])
        data = json.loads(path.read_text())
        nccl_100 = data["sizes"]["100M"]["nccl"]
        link = 2 * (machines - 1) / machines * (100 << 20) / nccl_100
        node = GpuNode(
            name=f"{machines} x 1 on one H100",
            gpus=1,
            arch="hopper",
            nic=link,
            nics=1,
            intra=link,
            hbm=3.35e12,
            channels=2,
            nic_efficiency=1.0,
        )
        cases = {
            "25M": [25 << 20],
            "100M": [100 << 20],
            "16 x 25M in flight": [25 << 20] * 16,
        }
        for name, sizes in cases.items():
            measured = data["in_flight"] if "flight" in name else data["sizes"][name]
            # What ran there: the five steps in a row per slice, forced at one rank
            # per machine (FAIRRING_CUDA_ALLREDUCE=lanes).
            config = Config(lanes=2, cuda_allreduce="lanes")
            predicted, _ = fairring_time(node, machines, sizes, config, impl=FAIRRING_PG_SLICES)
            rows.append(
                {
                    "shape": f"{machines}x1",
                    "case": name,
                    "link_from_nccl_bytes_per_s": link,
                    "fairring_predicted_s": predicted.seconds,
                    "fairring_measured_s": measured["fairring"],
                    "nccl_measured_s": measured["nccl"],
                }
            )
    return rows


def _when(measured: dict[str, str]) -> str:
    return ", ".join(f"{what} {when}" for what, when in measured.items())


def render(data: dict[str, Any]) -> tuple[str, Any]:
    import report

    p = data["primitives"]
    rows = data["predictions"]
    engine = counted(rows)
    misses = [r for r in engine if not within(r)]
    parts = [
        "# The cost model against the namespace cluster\n\n",
        report.stamp_lines(data["stamp"]),
        "\n",
        "Predicted by `fairring_pg.model` from this machine's primitives, measured before the"
        " runs (never fitted to them): one core copies"
        f" {p['copy_bytes_per_s'] / 1e9:.1f} GB/s and adds {p['reduce_bytes_per_s'] / 1e9:.1f}"
        f" GB/s, a loopback message takes {p['message_s'] * 1e6:.0f} us, TCP costs"
        f" {p['tcp_cpu_s_per_byte'] * 1e9:.2f} CPU-ns per byte, and one TCP stream gets "
        + ", ".join(f"{v:.1%} of a {k} link" for k, v in p["link_efficiency"].items())
        + f" ({p['cores']} cores; calibrated {_when(p['measured'])})."
        " Measured: fairring and Gloo in the same processes, median over iterations of the"
        " slowest rank. Error = (predicted - measured) / measured; bound = the resource the"
        " model finds limiting.\n\n",
        f"**{len(engine) - len(misses)} of {len(engine)} cases within ±{TOLERANCE:.0%} for both"
        " backends**"
        + (
            f" ({len(rows) - len(engine)} more rows time Gloo's ring on both sides, where"
            " FAIRRING_CPU_ALLREDUCE=auto hands it the allreduce: not counted)"
            if len(rows) > len(engine)
            else ""
        )
        + ".\n\n",
    ]
    parts.append(_cpu_table(rows))
    parts += _cuda_section(data.get("cuda") or [])
    parts += _loopback_section(data.get("loopback") or {})
    return "".join(parts), functools.partial(_plot, rows)


def _cpu_table(rows: list[dict[str, Any]]) -> str:
    import report

    table_rows = []
    for r in rows:
        case = case_name(r["count"], r["size"])
        cells = [r["link"], r["shape"], case if r.get("engine", True) else f"{case} (ring)"]
        for b in ("fairring", "gloo"):
            x = r[b]
            flag = "" if abs(x["error"]) <= TOLERANCE else " **MISS**"
            cells += [
                report.ms(x["predicted_s"]),
                report.ms(x["measured_s"]),
                f"{x['error']:+.1%}{flag}",
            ]
        cells.append(f"{r['fairring']['bound']} / {r['gloo']['bound']}")
        table_rows.append(cells)
    return report.table(
        [
            "link",
            "M x L",
            "case",
            "fairring predicted ms",
            "measured ms",
            "error",
            "Gloo predicted ms",
            "measured ms",
            "error",
            "bound (fairring / Gloo)",
        ],
        table_rows,
    )


def _cuda_section(cuda: list[dict[str, Any]]) -> list[str]:
    import report

    parts: list[str] = []
    if cuda:
        parts.append(
            "\n## Beside the CUDA runs on one H100 (bench/results/cuda/)\n\n"
            "M simulated machines x 1 GPU rank on one H100 under MPS, NCCL over sockets on"
            " loopback. Nothing there was calibrated: the link is what NCCL's ring moved at"
            " 100 MiB in the same run, and the model predicts fairring's time from it, as it"
            " ran then (whole slices, the five steps in a row on a lane, forced at one rank"
            " per machine).\n\n"
        )
        parts.append(
            report.table(
                [
                    "M x L",
                    "case",
                    "link (from NCCL)",
                    "fairring predicted ms",
                    "measured ms",
                    "error",
                    "NCCL measured ms",
                ],
                [
                    [
                        c["shape"],
                        c["case"],
                        f"{c['link_from_nccl_bytes_per_s'] / 1e9:.2f} GB/s",
                        report.ms(c["fairring_predicted_s"]),
                        report.ms(c["fairring_measured_s"]),
                        f"{c['fairring_predicted_s'] / c['fairring_measured_s'] - 1:+.1%}",
                        report.ms(c["nccl_measured_s"]),
                    ]
                    for c in cuda
                ],
            )  # fmt: skip
        )
    return parts


def _loopback_section(loop: dict[str, Any]) -> list[str]:
    import report

    parts: list[str] = []
    if loop.get("other_machine"):
        parts.append(
            "\n## Beside the loopback runs\n\n"
            f"`{loop['source']}` was measured on another machine than these primitives:"
            " not compared.\n"
        )
    if loop.get("rows"):
        low, high = loop["range_from_4mib"]
        parts.append(
            "\n## Beside the loopback runs (no link: CPU-bound; not validated)\n\n"
            f"`{loop['source']}` (measured {loop['measured']}): every rank on this host's"
            " cores, no link between machines. The model leaves out the scheduling and"
            " wake-ups of many threads on few cores beyond the measured message cost, so"
            " it comes out below the measured times: for the engine's runs from 4 MiB, by"
            f" {-loop['median_error_from_4mib']:.0%} (median; {-high:.0%} to {-low:.0%});"
            " below 4 MiB by far more. `fairring-plan --link loopback` says so.\n\n"
        )
        parts.append(
            report.table(
                ["M x L", "size", "fairring predicted - measured"],
                [
                    [r["shape"], common.show_size(r["size"]), f"{r['error']:+.0%}"]
                    for r in loop["rows"]
                ],
            )
        )
    return parts


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Predicted against measured, both backends, with the tolerance dashed."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for backend, marker in (("fairring", "o"), ("gloo", "s")):
        xs = [r[backend]["measured_s"] for r in rows]
        ys = [r[backend]["predicted_s"] for r in rows]
        ax.scatter(xs, ys, marker=marker, label=backend, alpha=0.8)
    if rows:
        lo = min(min(r[b]["measured_s"] for b in ("fairring", "gloo")) for r in rows) / 1.5
        hi = max(max(r[b]["measured_s"] for b in ("fairring", "gloo")) for r in rows) * 1.5
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
        for f in (1 - TOLERANCE, 1 + TOLERANCE):
            ax.plot([lo, hi], [lo * f, hi * f], color="grey", linewidth=0.6, linestyle="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (s)")
    ax.set_ylabel("predicted (s)")
    ax.set_title(f"cost model vs netns cluster (±{TOLERANCE:.0%} dashed)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
