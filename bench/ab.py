"""A/B of two commits on the same benchmarks, in the same hour, alternating.

    python bench/ab.py --base 791b652 -- fsdp.py --shape 2x2 -- e2e.py --shape 2x2
    python bench/ab.py --base 791b652 --work /tmp/ab --rounds 0   # build both sides now
    python bench/ab.py --base 791b652 --work /tmp/ab -- ...       # later, reusing them

Each benchmark (a script of bench/ with its arguments; groups separated by ``--``) runs
``--rounds`` times for each side, base and this checkout alternating (A B A B ...), each
run from its own tree (a git worktree of the base commit, made here and removed after)
with its own build directory. Every benchmark already reports fairring against Gloo
measured in the same run and processes; the A/B compares those ratios (the "speedup" or
"vs gloo" column of each table row), so that load that drifts between runs cancels, and
prints per row the base's and this checkout's mean ratio and their quotient. Run it
under the exclusive CPU lock on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
_RATIO_COLUMNS = ("speedup", "vs gloo", "speedup vs gloo")
# Where a table has it: Gloo's fastest iteration over fairring's. Other jobs on a shared
# host only ever slow an iteration down, so this one moves least with load.
_BEST_COLUMN = "speedup (best of)"


def ratios(markdown: str) -> dict[str, float]:
    """Row label -> fairring's ratio against Gloo, from every table of a results file."""
    out: dict[str, float] = {}
    header: list[str] | None = None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set(cells[0]) <= {"-"}:
            continue
        label = " ".join(cells[: 2 if header[1] in ("size",) else 1])
        if label in ("gloo", "gloo gloo"):
            continue
        median = next((header.index(c) for c in _RATIO_COLUMNS if c in header), None)
        for column, suffix in ((median, ""), (_index(header, _BEST_COLUMN), " (best of)")):
            match = re.match(r"([0-9.]+)x", cells[column]) if column is not None else None
            if match:
                out[label + suffix] = float(match.group(1))
    return out


def _index(header: list[str], name: str) -> int | None:
    return header.index(name) if name in header else None


def run(tree: Path, build: Path, script: str, args: list[str], out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "FAIRRING_BUILD_DIR": str(build)}
    cmd = [sys.executable, str(tree / "bench" / script), *args, "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, cwd=tree)
    found: dict[str, float] = {}
    for md in sorted(out.glob("*.md")):
        found.update({f"{md.stem}: {k}": v for k, v in ratios(md.read_text()).items()})
    return found


def _rounds(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _commit(tree: Path, rev: str) -> str:
    return subprocess.run(
        ["git", "-C", str(tree), "rev-parse", rev], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--work",
        type=Path,
        help="keep the base's worktree and both builds here (0 rounds: only build them), "
        "for a later run on an idle host",
    )
    parser.add_argument("benchmarks", nargs=argparse.REMAINDER, help="-- script args [-- ...]")
    opts = parser.parse_args()
    groups: list[list[str]] = []
    for word in opts.benchmarks:
        if word == "--":
            groups.append([])
        elif groups:
            groups[-1].append(word)
    groups = [g for g in groups if g]
    if not groups and opts.rounds > 0:
        parser.error("name at least one benchmark after --")
    work = opts.work or Path(tempfile.mkdtemp(prefix="fairring_ab_"))
    base_tree = work / "base"
    if not base_tree.exists():
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree), opts.base],
            check=True,
        )
    elif _commit(base_tree, "HEAD") != _commit(REPO, opts.base):
        parser.error(f"{base_tree} holds another commit than {opts.base}")
    sides = {"base": base_tree, "new": REPO}
    results: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    try:
        for side, tree in sides.items():
            # Built before the first run: a first build takes minutes on a busy host and
            # would eat into that benchmark's own time limit.
            print(f"== building {side}", flush=True)
            env = {
                **os.environ,
                "PYTHONPATH": str(tree),
                "FAIRRING_BUILD_DIR": str(work / f"build-{side}"),
            }
            build = "import fairring_pg._build as b; b.load_extension()"
            subprocess.run([sys.executable, "-c", build], env=env, check=True, cwd=tree)
        for round_ in range(opts.rounds):
            for index, (script, *args) in enumerate(groups):
                for side, tree in sides.items():
                    out = work / f"{side}-{round_}-{index}-{script}"
                    print(
                        f"== round {round_ + 1}/{opts.rounds}: {side}: {script} {' '.join(args)}",
                        flush=True,
                    )
                    for label, value in run(
                        tree, work / f"build-{side}", script, args, out
                    ).items():
                        results[side].setdefault(label, []).append(value)
    finally:
        if opts.work is None:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)],
                check=False,
            )
            shutil.rmtree(work, ignore_errors=True)
    if opts.rounds == 0:
        return 0
    print(f"\nfairring / Gloo ratio (higher is faster), {opts.rounds} rounds; base {opts.base}")
    print(f"{'row':<56} {'base (rounds)':>22} {'new (rounds)':>22} {'new/base':>9}")
    for label in results["new"]:
        if label not in results["base"]:
            continue
        b, n = results["base"][label], results["new"][label]
        q = statistics.mean(n) / statistics.mean(b)
        print(f"{label:<56} {_rounds(b):>22} {_rounds(n):>22} {q:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
