"""The benchmark suite, sized for a 2-core machine (under 10 minutes), and its verdict.

    python bench/run_suite.py                    # everything, into bench/results/tmp/
    python bench/run_suite.py --out bench/results  # the same, replacing the committed results
    python bench/run_suite.py --targets-only --out DIR  # re-judge the JSON already in DIR

Runs, in order: one-shot allreduce vs size on loopback (2x2, 4x1, 1x4); the same on
4 namespace hosts x 1 rank with 1 Gbit/s links (only with root and iproute2); overlap
at 2x2; scaling with machines (1, 2, 4, 8 x 1); end-to-end DDP at 2x2; FSDP's
reduce-scatter and all-gather at 2x2, and FSDP2 training at 2x2 on 1 Gbit/s links; then the
cost model against the namespace cluster (2x2, 4x1, 2x3, 3x2 at 1 Gbit/s and 300 Mbit/s;
about 10 minutes of its own). Every figure is fairring against Gloo measured in the same run, in
the same processes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import report

import common

BENCH = Path(__file__).resolve().parent
LINK_RATE = "1gbit"
LINK_BYTES_PER_S = 1e9 / 8
STEPS: list[tuple[str, list[str], bool]] = [  # (script, arguments, needs the netns cluster)
    ("allreduce_sizes.py", ["--shapes", "2x2,4x1,1x4", "--iters", "6"], False),
    (
        "allreduce_sizes.py",
        ["--shapes", "4x1", "--rate", LINK_RATE, "--max-size", "100M", "--iters", "4"],
        True,
    ),
    (
        "overlap.py",
        [
            "--shape",
            "2x2",
            "--buckets",
            "64",
            "--parallelism",
            "1,2,4,8",
            "--iters",
            "3",
            "--inflight-iters",
            "6",
        ],
        False,
    ),
    ("scaling.py", ["--machines", "1,2,4,8", "--buckets", "16", "--iters", "2"], False),
    ("e2e.py", ["--shape", "2x2", "--blocks", "6", "--block-steps", "4"], False),
    (  # the main job's setting (scripts/main_job.sh): machines joined by a shaped link
        "e2e.py",
        ["--shape", "2x2", "--rate", LINK_RATE, "--blocks", "6", "--block-steps", "4"],
        True,
    ),
    ("fsdp.py", ["--shape", "2x2", "--iters", "7"], False),
    (
        "e2e.py",
        ["--fsdp", "--shape", "2x2", "--rate", LINK_RATE, "--blocks", "6", "--block-steps", "4"],
        True,
    ),
    # the cost model's predictions against fairring and Gloo on the shaped cluster; it
    # measures the model's primitives first (calibration), never from these runs
    ("model_validation.py", ["--recalibrate"], True),
]


def run_all(skip_netns: bool, out: Path) -> tuple[dict[str, float], list[str]]:
    from fairring_pg.tools.netns_cluster import unavailable_reason

    reason = unavailable_reason()
    durations = {}
    failed = []
    # Compile the C++ core up front (minutes, once per source change), outside the steps.
    start = time.monotonic()
    subprocess.check_call(
        [sys.executable, "-c", "import fairring_pg._build as b; b.load_extension()"]
    )
    durations["build the extension (cached)"] = time.monotonic() - start
    for script, args, needs_netns in STEPS:
        label = " ".join([script, *args])
        if needs_netns and (skip_netns or reason):
            print(f"== skipping {label}: {reason or '--skip-netns'}", flush=True)
            continue
        start = time.monotonic()
        code = subprocess.call([sys.executable, str(BENCH / script), *args, "--out", str(out)])
        durations[label] = time.monotonic() - start
        if code != 0:
            print(f"!! {label} exited with {code}", file=sys.stderr, flush=True)
            failed.append(label)
    return durations, failed


# --- targets -----------------------------------------------------------------------


def _load(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _sizes(data: dict[str, Any], shape: str) -> dict[int, dict[str, float]]:
    from allreduce_sizes import summarize

    run = data["runs"].get(shape, {"error": "not run"})
    return {} if "error" in run else {int(r["size"]): r for r in summarize(run)}


Row = list[str]


def _verdict(ok: bool) -> str:
    return "pass" if ok else "MISS"


_MISSING = "not measured"


def _row(target: str, measured: str, ok: bool | None) -> Row:
    return [target, measured, _MISSING if ok is None else _verdict(ok)]


def target_rows(out: Path) -> list[Row]:
    loop = _load(out, "allreduce_sizes")
    rows = _loopback_rows(out, loop)
    shaped = _load(out, f"allreduce_sizes_netns_{LINK_RATE}")
    rows += _shaped_rows(shaped)
    rows += _small_message_rows(loop, shaped)
    rows += _ddp_rows(out)
    rows += fsdp_target_rows(out)
    rows += model_target_rows(out)
    return rows


def _loopback_rows(out: Path, loop: Any) -> list[Row]:
    """Throughput at 2x2 on loopback, one allreduce and 16 in flight."""
    rows: list[Row] = []
    loop_2x2 = _sizes(loop, "2x2") if loop else {}
    for size in (25 * common.MIB, 100 * common.MIB):
        r = loop_2x2.get(size)
        rows.append(
            _row(
                f"loopback 2x2, {common.show_size(size)}: fairring >= 1.5x Gloo throughput",
                f"{r['speedup']:.2f}x ({report.mbps(r['fairring_algbw'])} vs "
                f"{report.mbps(r['gloo_algbw'])} MB/s algbw; best of: {r['speedup_best']:.2f}x)"
                if r
                else _MISSING,
                r["speedup"] >= 1.5 if r else None,
            )
        )

    overlap = _load(out, "overlap")
    if overlap:
        t = {k: common.median(v) for k, v in overlap["inflight"].items()}
        best = {k: min(v) for k, v in overlap["inflight"].items()}
        rows.append(
            _row(
                "16 x 25 MiB in flight at once (2x2 loopback): >= 1.5x Gloo",
                f"{t['gloo'] / t['fairring']:.2f}x ({report.ms(t['fairring'])} vs "
                f"{report.ms(t['gloo'])} ms; best of: {best['gloo'] / best['fairring']:.2f}x)",
                t["gloo"] / t["fairring"] >= 1.5,
            )
        )
    else:
        rows.append(_row("16 x 25 MiB in flight at once: >= 1.5x Gloo", _MISSING, None))
    return rows


def _shaped_rows(shaped: Any) -> list[Row]:
    """4x1 on a shaped 1 Gbit/s link: bus bandwidth and speed against Gloo."""
    rows: list[Row] = []
    net = _sizes(shaped, "4x1") if shaped else {}
    big = {s: r for s, r in net.items() if s >= 25 * common.MIB}
    worst_big = min(big.values(), key=lambda r: r["fairring_busbw"]) if big else None
    goodput = (shaped or {}).get("link_goodput") or float("nan")
    rows.append(
        _row(
            "4x1 at 1 Gbit/s (netns, tbf): busbw >= 90% of link rate from 25 MiB",
            f"worst {report.mbps(worst_big['fairring_busbw'])} MB/s = "
            f"{worst_big['fairring_busbw'] / LINK_BYTES_PER_S:.1%} of 125 MB/s at "
            f"{common.show_size(int(worst_big['size']))} (TCP goodput {report.mbps(goodput)} MB/s;"
            f" Gloo {report.mbps(worst_big['gloo_busbw'])})"
            if worst_big
            else _MISSING,
            worst_big["fairring_busbw"] >= 0.9 * LINK_BYTES_PER_S if worst_big else None,
        )
    )
    mid = {s: r for s, r in net.items() if s >= common.MIB}
    worst_mid = min(mid.values(), key=lambda r: r["speedup"]) if mid else None
    rows.append(
        _row(
            "4x1 at 1 Gbit/s: fairring >= Gloo at every size from 1 MiB",
            f"worst {worst_mid['speedup']:.2f}x at {common.show_size(int(worst_mid['size']))}"
            f" (best of: {worst_mid['speedup_best']:.2f}x)"
            if worst_mid
            else _MISSING,
            worst_mid["speedup"] >= 1.0 if worst_mid else None,
        )
    )
    return rows


def _small_message_rows(loop: Any, shaped: Any) -> list[Row]:
    """Latency of messages up to 64 KiB against Gloo's, on every shape measured."""
    rows: list[Row] = []
    small: list[tuple[str, dict[str, float]]] = []
    for data in (loop, shaped):
        for shape in (data or {}).get("runs", {}):
            where = data["stamp"]["config"]["where"] if data else ""
            small += [
                (f"{shape} {where} {common.show_size(s)}", r)
                for s, r in _sizes(data, shape).items()
                if s <= 64 * common.KIB
            ]
    if small:
        label, r = max(small, key=lambda x: x[1]["fairring_s"] / x[1]["gloo_s"])
        worst = r["fairring_s"] / r["gloo_s"]
        rows.append(
            _row(
                "messages <= 64 KiB: latency <= 1.5x Gloo's (every shape measured)",
                f"worst {worst:.2f}x Gloo's latency ({label}: {report.ms(r['fairring_s'])} vs "
                f"{report.ms(r['gloo_s'])} ms)",
                worst <= 1.5,
            )
        )
    else:
        rows.append(_row("messages <= 64 KiB: latency <= 1.5x Gloo's", _MISSING, None))
    return rows


def _ddp_rows(out: Path) -> list[Row]:
    """DDP training steps/s against Gloo's, on loopback and at 1 Gbit/s."""
    rows: list[Row] = []
    e2e = _load(out, "e2e")
    if e2e:
        from e2e import steps_per_s

        f, g = steps_per_s(e2e, "fairring"), steps_per_s(e2e, "gloo")
        rows.append(
            _row(
                "DDP Transformer 2x2: steps/s >= Gloo's",
                f"{f / g:.2f}x ({f:.3f} vs {g:.3f})",
                f >= g,
            )
        )
    else:
        rows.append(_row("DDP Transformer 2x2: steps/s >= Gloo's", _MISSING, None))

    e2e_link = _load(out, "e2e_netns_1gbit")
    label = "DDP Transformer 2x2 at 1 Gbit/s (the main job's setting): steps/s >= 1.1x Gloo's"
    if e2e_link:
        from e2e import steps_per_s

        f, g = steps_per_s(e2e_link, "fairring"), steps_per_s(e2e_link, "gloo")
        rows.append(_row(label, f"{f / g:.2f}x ({f:.3f} vs {g:.3f})", f >= 1.1 * g))
    else:
        rows.append(_row(label, _MISSING, None))
    return rows


def model_target_rows(out: Path) -> list[Row]:
    """Issue 27's target: the cost model within ±15% of every measurement."""
    from model_validation import TOLERANCE, counted, within

    data = _load(out, "model_validation")
    label = (
        f"cost model within ±{TOLERANCE:.0%} of fairring and Gloo (netns 2x2, 2x3, 3x2: 1, 25,"
        " 100 MiB, 16 x 25 MiB; 4x1: 64, 256 KiB, where the engine runs; 1 Gbit/s, 300 Mbit/s)"
    )
    if not data:
        return [[label, "not measured", "not measured"]]
    rows = counted(data["predictions"])
    errors = [abs(r[b]["error"]) for r in rows for b in ("fairring", "gloo")]
    misses = [r for r in rows if not within(r)]
    measured = f"{len(rows) - len(misses)} of {len(rows)} cases; worst error {max(errors):.1%}"
    return [[label, measured, _verdict(not misses and len(rows) > 0)]]


def fsdp_target_rows(out: Path) -> list[Row]:
    """Issue 20's targets: FSDP's collectives at 2x2 loopback, FSDP2 training at 1 Gbit/s."""
    from fsdp import summarize

    rows: list[Row] = []
    missing = "not measured"

    def add(target: str, measured: str, ok: bool | None) -> None:
        rows.append([target, measured, missing if ok is None else _verdict(ok)])

    data = _load(out, "fsdp")
    found = {(r["collective"], r["size"]): r for r in summarize(data)} if data else {}

    def measured(r: dict[str, Any]) -> str:
        return (
            f"{r['speedup']:.2f}x ({report.ms(r['fairring_s'])} vs {report.ms(r['gloo_s'])} ms;"
            f" best of: {r['speedup_best']:.2f}x)"
        )

    for size in (25 * common.MIB, 100 * common.MIB):
        r = found.get(("reduce_scatter", size))
        add(
            f"reduce-scatter 2x2 loopback, {common.show_size(size)}: >= 1.8x Gloo",
            measured(r) if r else missing,
            r["speedup"] >= 1.8 if r else None,
        )
        r = found.get(("all_gather", size))
        add(
            f"all-gather 2x2 loopback, {common.show_size(size)}: >= 1.0x Gloo (goal 1.3x)",
            measured(r) if r else missing,
            r["speedup"] >= 1.0 if r else None,
        )
    for name in ("reduce_scatter", "all_gather"):
        r = found.get((name, 64 * common.KIB))
        add(
            f"{name} 2x2 loopback, 64 KiB: <= 1.5x Gloo's time",
            f"{1 / r['speedup']:.2f}x Gloo's time ({report.ms(r['fairring_s'])} vs"
            f" {report.ms(r['gloo_s'])} ms)"
            if r
            else missing,
            1 / r["speedup"] <= 1.5 if r else None,
        )
    e2e = _load(out, f"e2e_fsdp_netns_{LINK_RATE}")
    label = "FSDP2 Transformer 2x2 at 1 Gbit/s: steps/s >= 1.3x Gloo's, same loss"
    if e2e:
        from e2e import steps_per_s

        f, g = steps_per_s(e2e, "fairring"), steps_per_s(e2e, "gloo")
        loss = e2e["final_loss"]
        same = abs(loss["fairring"] - loss["gloo"]) <= 1e-3 * abs(loss["gloo"])
        add(
            label,
            f"{f / g:.2f}x ({f:.3f} vs {g:.3f}); loss {loss['fairring']:.4f} vs {loss['gloo']:.4f}",
            f >= 1.3 * g and same,
        )
    else:
        add(label, missing, None)
    return rows


def write_targets(durations: dict[str, float] | None, out: Path) -> str:
    stamp = common.stamp({"suite": "bench/run_suite.py"})
    text = (
        "# Targets\n\n"
        + report.stamp_lines(stamp)
        + "\nEach figure is fairring against Gloo measured in the same run, in the same"
        " processes (see the per-benchmark .md files for every size). Verdicts use"
        " medians; 'best of' compares the fastest iterations, a hint of how much of a"
        " gap other jobs on this shared 2-core host put there.\n\n"
        + report.table(["target", "measured", "verdict"], target_rows(out))
    )
    if durations:
        text += "\n## Suite run\n\n" + report.table(
            ["step", "seconds"], [[k, f"{v:.0f}"] for k, v in durations.items()]
        )
        text += f"\ntotal: {sum(durations.values()):.0f} s\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "targets.md").write_text(text)
    return text


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets-only", action="store_true")
    p.add_argument("--skip-netns", action="store_true")
    p.add_argument(
        "--out",
        type=Path,
        default=common.DEFAULT_OUT,
        help=f"folder for every result and targets.md (default:"
        f" {common.DEFAULT_OUT.relative_to(common.REPO)}/, which git ignores;"
        " --out bench/results replaces the committed results)",
    )
    args = p.parse_args(argv)
    out = args.out.resolve()
    durations, failed = (None, []) if args.targets_only else run_all(args.skip_netns, out)
    print(write_targets(durations, out))
    print(f"wrote {out}/targets.md")
    for label in failed:
        print(f"!! failed: {label}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
