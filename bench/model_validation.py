"""The cost model (fairring_pg.model) against the namespace cluster: predicted vs measured.

    python bench/model_validation.py --out bench/results      # both links, all shapes
    python bench/model_validation.py --rates 1gbit --shapes 2x2 --cases 1M,25M

For each link rate and M x L shape, the ranks run on namespace hosts with tc-shaped
links (scripts/netns_cluster.py) and time fairring and Gloo in the same processes
(bench/common.py): one allreduce of 1, 25 and 100 MiB, and a burst of 16 x 25 MiB issued
at once. The model predicts each from this machine's primitives (copy and reduction
bandwidth, loopback message and TCP costs, one TCP stream's share of a shaped link),
measured by fairring_pg.model.calibration before the runs, never from the runs
themselves. Run it alone on the host (flock -x /tmp/fairring-cpu.lock): the primitives
and the runs are both timings.

The report also sets the model beside the CUDA runs on one H100 (bench/results/cuda/).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report  # noqa: E402

import common  # noqa: E402

sys.path.insert(0, str(common.REPO))
from fairring_pg.model import calibration  # noqa: E402
from fairring_pg.model.cpu import CpuCluster, predict_cpu  # noqa: E402

TOLERANCE = 0.15
DEFAULT_CASES = "1M,25M,100M,16x25M"
# Timed iterations per case: a 1 MiB allreduce is cheap, a burst at 300 Mbit/s is not.
ITERATIONS = {1 << 20: 9, 25 << 20: 3}
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
    p.add_argument("--shapes", default="2x2,4x1,2x3", help="machines x ranks, comma-separated")
    p.add_argument("--cases", default=DEFAULT_CASES, help="sizes; NxSIZE: N issued at once")
    p.add_argument("--iters", type=int, default=None, help="timed iterations of every case")
    p.add_argument("--recalibrate", action="store_true", help="measure the primitives again")
    p.add_argument("--timeout", type=float, default=500.0, help="seconds per launch")
    p.add_argument("--name", default="model_validation")
    common.add_output_args(p)
    args = p.parse_args(argv)
    args.rate = None  # placement: always the shaped cluster, one rate per launch
    args.netns = True
    return args


def iterations(args: argparse.Namespace, size: int) -> int:
    return args.iters or ITERATIONS.get(size, DEFAULT_ITERATIONS)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    common.init_worker()
    groups = {"gloo": dist.group.WORLD, "fairring": common.fairring_group()}
    cases = [parse_case(c) for c in args.cases.split(",")]
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
    forwarded = ["--cases", args.cases]
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
        "timing": "median over iterations of the slowest rank",
    }
    results = {
        "runs": runs,
        "primitives": asdict(primitives),
        "calibration_file": str(calibration.cache_path()),
        "predictions": predictions(runs, primitives),
        "cuda": cuda_comparison(),
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
            row: dict[str, Any] = {"link": rate, "shape": shape, "count": count, "size": size}
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


def within(row: dict[str, Any]) -> bool:
    return all(abs(row[b]["error"]) <= TOLERANCE for b in ("fairring", "gloo"))


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
    p = data["primitives"]
    rows = data["predictions"]
    misses = [r for r in rows if not within(r)]
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
        f"**{len(rows) - len(misses)} of {len(rows)} cases within ±{TOLERANCE:.0%} for both"
        " backends.**\n\n",
    ]
    table_rows = []
    for r in rows:
        cells = [r["link"], r["shape"], case_name(r["count"], r["size"])]
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
    parts.append(
        report.table(
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
    )
    cuda = data.get("cuda") or []
    if cuda:
        parts.append(
            "\n## Beside the CUDA runs on one H100 (bench/results/cuda/)\n\n"
            "M simulated machines x 1 GPU rank on one H100 under MPS, NCCL over sockets on"
            " loopback. Nothing there was calibrated: the link is what NCCL's ring moved at"
            " 100 MiB in the same run, and the model predicts fairring's time from it.\n\n"
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

    def plot(path: Path) -> None:
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

    return "".join(parts), plot


if __name__ == "__main__":
    sys.exit(common.role_main(sys.argv[1:], parse_args, worker, driver))
