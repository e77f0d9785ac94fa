"""fairring-plan: will fairring be faster on my cluster? The cost model's answer.

    fairring-plan --machines 2 --ranks-per-machine 2 --link 1gbit --size 25M --device cpu --json
    fairring-plan --machines 16 --gpus-per-machine 8 --nic 400gbit --nics-per-machine 8 \\
                  --intra 370GB/s --size 25M --in-flight 4
    fairring-plan --size 25M --in-flight 4 --plot speedup.png

CPU tensors: predicted for machines simulated on this host (the netns cluster of
fairring_pg/tools/netns_cluster.py, against which the model is validated), from this machine's
measured primitives (measured on first use and cached). GPU clusters: a table over 1 to
128 machines of fairring, NCCL's ring and tree, and the predicted speedup. fairring's
own FAIRRING_* variables are read from the environment, as the backend reads them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from fairring_pg.config import Config
from fairring_pg.model import calibration, nccl
from fairring_pg.model.cpu import CpuCluster, predict_cpu
from fairring_pg.model.cuda_plan import CudaPlan, plan_allreduce
from fairring_pg.model.gpu import GpuPrediction, predict_gpu
from fairring_pg.model.nodes import IB_EFFICIENCY, NODE_TYPES, GpuNode
from fairring_pg.model.sensitivity import Turn, nearest, turning_points
from fairring_pg.model.units import parse_rate, parse_size, show_rate, show_size

MACHINE_STEPS = (1, 2, 4, 8, 16, 32, 64, 128)
_HBM = {"volta": 0.9e12, "ampere": 2.0e12, "hopper": 3.35e12}
_CHANNELS = {"volta": 8, "ampere": 16, "hopper": 16}
_TUNINGS = {"2.28": nccl.NCCL_2_28, "2.11": nccl.NCCL_2_11}
_GPU_OPTIONS = (
    "gpus_per_machine",
    "nic",
    "nics_per_machine",
    "intra",
    "node",
    "plot",
    "show_plan",
    "cpu",
)
_CPU_OPTIONS = ("ranks_per_machine", "link")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fairring-plan",
        description="Predict fairring's allreduce time against Gloo (CPU tensors) or NCCL "
        "(GPU clusters) from the cost model of docs/design.md, 'The cost model'.",
        epilog="Sizes take K/M/G (powers of 1024) as FAIRRING_* variables do; rates take tc's "
        "notation (1gbit, 300mbit; 'mbps' is megabytes/s there) or GB/s. fairring's own "
        "settings come from FAIRRING_* variables in the environment.",
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), help="default: cuda if a GPU option is given"
    )
    p.add_argument("--machines", type=int, help="machines (GPU: the row to report; default 16)")
    p.add_argument("--size", default="25M", help="bytes per allreduce (default 25M)")
    p.add_argument("--in-flight", type=int, default=1, help="allreduces issued at once (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    cpu = p.add_argument_group("CPU tensors (machines simulated on this host)")
    cpu.add_argument("--ranks-per-machine", type=int, help="ranks per machine (default 1)")
    cpu.add_argument(
        "--link", help="each machine's link rate, as tc takes it (1gbit); 'loopback': none"
    )
    cpu.add_argument(
        "--separate-hosts",
        action="store_true",
        help="each machine has this host's cores to itself (default: they share them, as "
        "in the netns cluster)",
    )
    cpu.add_argument("--recalibrate", action="store_true", help="measure the primitives again")
    _add_gpu_options(p.add_argument_group("GPU clusters"))
    return p


def _add_gpu_options(gpu: argparse._ArgumentGroup) -> None:
    gpu.add_argument("--node", choices=sorted(NODE_TYPES), help="a node type (sets all below)")
    gpu.add_argument("--gpus-per-machine", type=int, help="GPUs per machine (default 8)")
    gpu.add_argument("--nic", help="one NIC's rate, e.g. 400gbit")
    gpu.add_argument("--nics-per-machine", type=int, help="NICs per machine (default 8)")
    gpu.add_argument("--intra", help="allreduce bus bandwidth inside a machine, e.g. 370GB/s")
    gpu.add_argument("--arch", choices=nccl.ARCHS, help="GPU generation (default hopper)")
    gpu.add_argument(
        "--nic-efficiency",
        type=float,
        help=f"payload share of a NIC's rate (default {IB_EFFICIENCY}: NDR's 46-48 of 50 GB/s)",
    )
    gpu.add_argument("--nvls", choices=("on", "off"), help="NVLink SHARP (default: on for hopper)")
    gpu.add_argument(
        "--cpu",
        choices=nccl.CPU_VENDORS + (nccl.UNKNOWN_CPU,),
        help="the hosts' CPU vendor (default: the node type's; unknown for a custom node): "
        "NCCL's figures and fairring's cost per rail message depend on it",
    )
    gpu.add_argument("--nccl", choices=sorted(_TUNINGS), default="2.28", help="NCCL's tuning")
    gpu.add_argument("--max-machines", type=int, default=128, help="the table's last row")
    gpu.add_argument(
        "--show-plan",
        action="store_true",
        help="also print the plan FAIRRING_CUDA_ALLREDUCE=model would use at --machines "
        "(per size, NCCL's allreduce or how many pieces with which rail exchange), and the "
        "sizes auto measures instead of deciding",
    )
    gpu.add_argument(
        "--plot",
        metavar="PNG",
        help="write speedup against machines for H100+8x400G, H100+2x200G, A100+4x200G and "
        "V100+4x100G (at --size, one at a time and --in-flight) to this file",
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = _parser()
    args = p.parse_args(argv)
    given = {k for k, v in vars(args).items() if v not in (None, False)}
    if args.device is None:
        args.device = "cuda" if given & set(_GPU_OPTIONS) else "cpu"
    wrong = given & set(_GPU_OPTIONS if args.device == "cpu" else _CPU_OPTIONS)
    if wrong:
        names = ", ".join("--" + w.replace("_", "-") for w in sorted(wrong))
        p.error(f"{names} do(es) not apply to --device {args.device}")
    if args.in_flight < 1:
        p.error(f"--in-flight must be at least 1, got {args.in_flight}")
    if args.machines is not None and args.machines < 1:
        p.error(f"--machines must be at least 1, got {args.machines}")
    try:
        args.size_bytes = parse_size("--size", args.size)
        if args.device == "cpu":
            if args.machines is None:
                p.error("--device cpu needs --machines")
            if args.ranks_per_machine is not None and args.ranks_per_machine < 1:
                p.error(f"--ranks-per-machine must be at least 1, got {args.ranks_per_machine}")
            if args.link not in (None, "loopback"):
                args.link_bytes = parse_rate("--link", args.link)
        else:
            args.gpu_node = gpu_node(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def gpu_node(args: argparse.Namespace) -> GpuNode:
    if args.node:
        base = NODE_TYPES[args.node]
    else:
        base = NODE_TYPES["h100-8x400g"]
    arch = args.arch or (base.arch if args.node else "hopper")
    gpus = args.gpus_per_machine or base.gpus
    if gpus < 1:
        raise ValueError(f"--gpus-per-machine must be at least 1, got {gpus}")
    nics = args.nics_per_machine or base.nics
    if nics < 1:
        raise ValueError(f"--nics-per-machine must be at least 1, got {nics}")
    efficiency = args.nic_efficiency if args.nic_efficiency is not None else base.nic_efficiency
    if not 0 < efficiency <= 1:
        raise ValueError(f"--nic-efficiency must be in (0, 1], got {efficiency}")
    custom = any(
        v is not None
        for v in (args.gpus_per_machine, args.nic, args.nics_per_machine, args.intra, args.arch)
    )
    cpu = args.cpu or (base.cpu if not custom else nccl.UNKNOWN_CPU)
    return GpuNode(
        name=base.name if not custom else "custom",
        gpus=gpus,
        arch=arch,
        nic=parse_rate("--nic", args.nic) if args.nic else base.nic,
        nics=nics,
        intra=parse_rate("--intra", args.intra) if args.intra else base.intra,
        hbm=base.hbm if arch == base.arch else _HBM[arch],
        channels=base.channels if arch == base.arch else _CHANNELS[arch],
        nvls=(args.nvls == "on") if args.nvls else (arch == "hopper" and gpus > 1),
        nic_efficiency=efficiency,
        sources=base.sources if not custom else (),
        cpu=cpu,
    )


# --- CPU --------------------------------------------------------------------------


def run_cpu(args: argparse.Namespace, config: Config) -> dict[str, Any]:
    links = (args.link,) if args.link not in (None, "loopback") else ()
    primitives = calibration.calibrate(links, force=args.recalibrate, log=sys.stderr)
    cluster = CpuCluster(
        machines=args.machines,
        ranks_per_machine=args.ranks_per_machine or 1,
        link_bytes_per_s=getattr(args, "link_bytes", None),
        link_efficiency=primitives.efficiency(args.link) if links else 1.0,
        shared_host=not args.separate_hosts,
    )
    prediction = predict_cpu(cluster, [args.size_bytes] * args.in_flight, primitives, config)
    return {
        "device": "cpu",
        "machines": cluster.machines,
        "ranks_per_machine": cluster.ranks_per_machine,
        "link": args.link or "loopback",
        "size": args.size_bytes,
        "in_flight": args.in_flight,
        "fairring_ms": prediction.fairring_s * 1e3,
        "reference_ms": prediction.reference_s * 1e3,
        "reference": prediction.reference,
        "speedup": prediction.speedup,
        "fairring_bottleneck": prediction.fairring.bottleneck,
        "reference_bottleneck": prediction.gloo.bottleneck,
        "assumptions": prediction.assumptions,
        "calibration": str(calibration.cache_path()),
    }


def show_cpu(result: dict[str, Any]) -> str:
    speedup = result["speedup"]
    verdict = "faster" if speedup >= 1.02 else "slower" if speedup <= 0.98 else "even"
    return (
        f"allreduce of {show_size(result['size'])} x {result['in_flight']} on "
        f"{result['machines']} x {result['ranks_per_machine']} CPU ranks, link "
        f"{result['link']}:\n"
        f"  fairring {result['fairring_ms']:.1f} ms (bound by {result['fairring_bottleneck']}), "
        f"Gloo's ring {result['reference_ms']:.1f} ms: fairring {speedup:.2f}x, "
        f"{verdict}\n"
        "assumptions:\n" + "".join(f"  - {a}\n" for a in result["assumptions"])
    )


# --- GPU --------------------------------------------------------------------------


def machine_range(highlight: int, last: int) -> list[int]:
    return sorted({m for m in MACHINE_STEPS if m <= last} | {highlight})


def row(p: GpuPrediction, machines: int, gpus: int, size: int, turns: list[Turn]) -> dict[str, Any]:
    pieces = [u.numel * 4 for u in p.plan.units(size) if not u.direct]
    first = nearest(turns)
    runs = f"{len(pieces)} x {show_size(max(pieces))}, {p.row.exchange}" if pieces else ""
    return {
        "machines": machines,
        "gpus": machines * gpus,
        "fairring_ms": p.fairring_s * 1e3,
        "nccl_ring_ms": p.nccl_ring_s * 1e3,
        "nccl_tree_ms": p.nccl_tree_s * 1e3,
        "nccl_tree_algorithm": f"{p.tree.algorithm}/{p.tree.protocol}",
        "nccl_ms": p.nccl_s * 1e3,
        "nccl_algorithm": f"{p.chosen.algorithm}/{p.chosen.protocol}",
        "speedup": p.speedup,
        "fairring_bottleneck": p.fairring.bottleneck,
        "direct": p.direct,
        "runs": runs or "NCCL's allreduce",
        "pieces": len(pieces),
        "exchange": p.row.exchange,
        "reason": p.row.reason,
        "turns": [
            {
                "constant": t.constant,
                "used": t.used,
                "now": t.now,
                "turns_at": t.turns_at,
                "speedup_there": t.speedup_there,
                "text": t.describe(),
            }
            for t in turns
        ],
        "turns_first": first.describe() if first else None,
    }


def run_gpu(args: argparse.Namespace, config: Config) -> dict[str, Any]:
    node: GpuNode = args.gpu_node
    tuning = _TUNINGS[args.nccl]
    highlight = args.machines or 16
    rows = []
    predictions = {}
    for m in machine_range(highlight, max(args.max_machines, 1)):
        predictions[m] = predict_gpu(node, m, args.size_bytes, args.in_flight, config, tuning)
        turns = turning_points(node, m, args.size_bytes, args.in_flight, config, tuning)
        rows.append(row(predictions[m], m, node.gpus, args.size_bytes, turns))
    chosen = predictions[highlight]
    return {
        "device": "cuda",
        "node": {
            "name": node.name,
            "gpus": node.gpus,
            "arch": node.arch,
            "nic_bytes_per_s": node.nic,
            "nics": node.nics,
            "nic_efficiency": node.nic_efficiency,
            "intra_bytes_per_s": node.intra,
            "nvls": node.nvls,
        },
        "machines": highlight,
        "size": args.size_bytes,
        "in_flight": args.in_flight,
        "fairring_ms": chosen.fairring_s * 1e3,
        "reference_ms": chosen.reference_s * 1e3,
        "reference": chosen.reference,
        "speedup": chosen.speedup,
        "rows": rows,
        "plan": json.loads(chosen.plan.to_json()),
        # What auto runs: the same candidates, the sizes the model is not sure of measured.
        "measured_plan": json.loads(
            plan_allreduce(node, highlight, config, tuning, measured=True).to_json()
        ),
        "assumptions": chosen.assumptions + list(node.sources),
    }


def verdict(r: dict[str, Any]) -> str:
    if r["direct"]:
        return "same: NCCL's allreduce"
    if r["speedup"] >= 1.02:
        return "fairring faster"
    if r["speedup"] > 0.98:
        return "even"
    return f"fairring LOSES (bound by {r['fairring_bottleneck']})"


def show_gpu(result: dict[str, Any]) -> str:
    node = result["node"]
    lines = [
        f"allreduce of {show_size(result['size'])}, {result['in_flight']} in flight, on machines "
        f"of {node['gpus']} {node['arch']} GPUs, {node['nics']} x "
        f"{node['nic_bytes_per_s'] * 8 / 1e9:.0f} Gbit/s NICs, intra-machine "
        f"{show_rate(node['intra_bytes_per_s'])}"
        f"{', NVLink SHARP' if node['nvls'] else ''}:",
        "",
        "   machines  GPUs  fairring ms  NCCL ring ms  NCCL tree ms  NCCL picks       "
        "fairring runs                    speedup  verdict",
    ]
    for r in result["rows"]:
        mark = ">" if r["machines"] == result["machines"] else " "
        lines.append(
            f" {mark} {r['machines']:>7}  {r['gpus']:>4}  {r['fairring_ms']:>11.3f}  "
            f"{r['nccl_ring_ms']:>12.3f}  {r['nccl_tree_ms']:>12.3f}  "
            f"{r['nccl_algorithm']:<15}  {r['runs']:<31}  {r['speedup']:>6.2f}x  {verdict(r)}"
        )
    losses = [r for r in result["rows"] if not r["direct"] and r["speedup"] <= 0.98]
    lines.append("")
    lines.append(
        "speedup = NCCL's time (the algorithm it would pick) / fairring's; NCCL runs the "
        "allreduces in flight one after another. fairring runs what its plan "
        "(FAIRRING_CUDA_ALLREDUCE=auto) picks for one call of this size: NCCL's allreduce, or "
        "pieces through the composition with that rail exchange."
    )
    turning = [r for r in result["rows"] if r["turns"]]
    if turning:
        lines.append(
            "where each composed row's verdict turns: each constant of fairring's own "
            "(fairring_pg/model/constants.py) changed alone, on the plan as it runs, until "
            "fairring's time reaches NCCL's:"
        )
        for r in turning:
            texts = "; ".join(t["text"] for t in r["turns"] if t["used"])
            unused = [t["constant"] for t in r["turns"] if not t["used"]]
            if unused:
                texts += f" ({', '.join(unused)}: not used by the rail {r['exchange']})"
            first = f" First to turn: {r['turns_first']}." if r["turns_first"] else ""
            lines.append(f"  M = {r['machines']}, {r['speedup']:.2f}x: {texts}.{first}")
    if losses:
        where = ", ".join(str(r["machines"]) for r in losses)
        causes = sorted({r["fairring_bottleneck"] for r in losses})
        lines.append(
            f"fairring loses at M = {where}: bound by {', '.join(causes)} ({_explain(causes)})."
        )
    else:
        lines.append("fairring does not lose in this range.")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in result["assumptions"]]
    return "\n".join(lines) + "\n"


_CAUSES = {
    "nic": "the machines' NICs: both move about the same bytes",
    "nvlink": "NVLink inside the machine",
    "critical path": "one piece's steps, one after the other",
    "host": "the calling thread issuing every step",
    "local reduce-scatter": "the machine's reduce-scatter communicator, a latency per piece",
    "local all-gather": "the machine's all-gather communicator, a latency per piece",
}


def _explain(causes: list[str]) -> str:
    def why(cause: str) -> str:
        if cause.startswith("lane"):
            return f"{cause}: the rail exchange's latency per piece, on one communicator"
        if cause.startswith("proxy"):
            return f"{cause}: a message to every other machine per piece (NCCL's proxy)"
        return _CAUSES.get(cause, cause)

    return "; ".join(why(c) for c in causes)


def plot(path: str, size: int, in_flight: int, config: Config, tuning: nccl.NcclTuning) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "fairring-plan: --plot needs matplotlib (pip install matplotlib, or the 'bench' extra)"
        ) from None
    machines = list(MACHINE_STEPS)
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    counts = sorted({1, in_flight})
    for index, node in enumerate(NODE_TYPES.values()):
        color = f"C{index}"
        for count in counts:
            speedups = [predict_gpu(node, m, size, count, config, tuning).speedup for m in machines]
            style = "-" if count == 1 else "--"
            label = f"{node.name}, {count} in flight"
            ax.plot(machines, speedups, style, marker="o", color=color, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(machines, [str(m) for m in machines])
    ax.set_xlabel("machines (8 GPUs each)")
    ax.set_ylabel("predicted speedup over NCCL")
    ax.set_title(
        f"fairring (FAIRRING_CUDA_ALLREDUCE=auto) vs NCCL {tuning.version}: "
        f"allreduce of {show_size(size)}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = Config.from_env()
    except ValueError as exc:
        print(f"fairring-plan: {exc}", file=sys.stderr)
        return 2
    try:
        if args.device == "cpu":
            result = run_cpu(args, config)
            text = show_cpu(result)
        else:
            result = run_gpu(args, config)
            text = show_gpu(result)
            if args.show_plan:
                text += "FAIRRING_CUDA_ALLREDUCE=model (the predictions above):\n"
                text += CudaPlan.from_json(json.dumps(result["plan"])).describe() + "\n"
                text += "FAIRRING_CUDA_ALLREDUCE=auto (measured: timed both ways on the cluster):\n"
                text += CudaPlan.from_json(json.dumps(result["measured_plan"])).describe() + "\n"
            if args.plot:
                plot(args.plot, args.size_bytes, args.in_flight, config, _TUNINGS[args.nccl])
                result["plot"] = args.plot
                text += f"wrote {args.plot}\n"
    except (RuntimeError, ValueError) as exc:
        print(f"fairring-plan: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=1) if args.json else text, end="" if not args.json else "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
