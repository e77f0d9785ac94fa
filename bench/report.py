"""Markdown tables and PNG plots for the benchmark results; re-renders saved JSON.

    python bench/report.py                  # every bench/results/*.json again
    python bench/report.py overlap          # just bench/results/overlap.json
    python bench/report.py --dir bench/results/tmp   # a run's default output folder

Each benchmark module has a `render(data) -> (markdown, plot)`; this module holds the
pieces they share, so the tables and figures of all benchmarks look alike.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on the benchmark machines
import matplotlib.pyplot as plt

import common

Series = Mapping[str, tuple[Sequence[float], Sequence[float]]]


def mbps(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:.1f}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.1f}"


def ratio(x: float) -> str:
    return f"{x:.2f}x"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def stamp_lines(stamp: Mapping[str, Any]) -> str:
    env = ", ".join(f"`{k}={v}`" for k, v in stamp.get("env", {}).items()) or "none"
    load = ", ".join(f"{x:.2f}" for x in stamp.get("load_avg", []))
    start = ", ".join(f"{x:.2f}" for x in stamp.get("load_avg_start", []))
    dirty = " (uncommitted changes)" if stamp.get("git_dirty") else ""
    config = ", ".join(f"{k}={v}" for k, v in stamp.get("config", {}).items())
    return (
        f"- measured {stamp['date']} on {stamp['host']}: {stamp['cpu']}, {stamp['cores']} cores,"
        f" kernel {stamp['kernel']}, load average (1, 5, 15 min) {start} at the start,"
        f" {load} at the end\n"
        f"- torch {stamp['torch']}, python {stamp['python']}, commit"
        f" {stamp['git_commit']}{dirty}\n"
        f"- environment: {env}\n"
        f"- configuration: {config}\n"
    )


def line_plot(
    path: Path,
    panels: Mapping[str, Series],
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    hlines: Mapping[str, float] | None = None,
    title: str = "",
) -> None:
    """One panel per entry, each with one line per series; hlines marks bounds."""
    n = len(panels)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False, sharey=False)
    for ax, (name, series) in zip(axes[0], panels.items(), strict=True):
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        for (label, y), style in zip((hlines or {}).items(), ("--", ":", "-."), strict=False):
            ax.axhline(y, linestyle=style, color="gray", label=label)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)  # differences read honestly only against zero
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def rerender(folder: Path, name: str) -> None:
    data = json.loads((folder / f"{name}.json").read_text())
    module = importlib.import_module(data["benchmark"])
    render: Callable[[dict[str, Any]], tuple[str, Callable[[Path], None]]] = module.render
    markdown, plot = render(data)
    (folder / f"{name}.md").write_text(markdown)
    plot(folder / f"{name}.png")
    print(f"re-rendered {folder / name}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=common.RESULTS, help="(default: bench/results)")
    p.add_argument("names", nargs="*", help="result stems (default: every *.json in --dir)")
    args = p.parse_args(argv)
    for name in args.names or sorted(p.stem for p in args.dir.glob("*.json")):
        rerender(args.dir, name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
