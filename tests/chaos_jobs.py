"""Chaos: many short jobs on simulated machines (2x2, 3x1, 2x3), each a seeded random
program of mixed collectives (allreduces of every dtype and op, reduce-scatters and
all-gathers in every form, barriers, broadcasts, DDP steps with hooks) posted alike on
every rank and waited in an order of each rank's own, with at most one seeded fault
(tests/chaos_plan.py): a rank killed (and, half the time, its machine-mates 0.15 s
later, as torchrun's agent does; at start-up; midway through 16 MiB), a rank leaving
(SIGTERM, handled or not; an early end), a connection cut under a body, a rank frozen,
a rank slow for most of the timeout, a skipped call, the store's host killed, a delay
at a fault point, or one rank getting a call wrong. Every job is judged by
tests/chaos_verdict.py's rules.

    python scripts/chaos.py --jobs 500 --seed 0      # by hand
    python scripts/chaos.py --seed 17 --jobs 1       # replay one seed
    python scripts/chaos.py --seeds 3,8,15           # given seeds (tests/test_chaos.py)
    python scripts/chaos.py --jobs 40 --load 2       # beside 2 busy processes
    python scripts/chaos.py --jobs 500 --shards 2    # two runs side by side, one report

Prints one line per failing job with the command that replays it, then a summary:
jobs, faults by kind, outcomes, the worst time to raise by fault, and Gloo's in the
same job beside it (kills and freezes run the same program on a Gloo group beside
fairring's).
Exit status 0 when no job failed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chaos_plan import Job, draw_job
from chaos_verdict import Verdict, judge

JOB_TIMEOUT_S = 120.0  # a job that is not over by then hangs: its ranks are killed


@dataclasses.dataclass
class JobResult:
    job: Job
    verdict: Verdict
    wall_s: float

    def replay(self) -> str:
        return f"python scripts/chaos.py --seed {self.job.seed} --jobs 1"


def _processes_left(directory: Path) -> list[str]:
    left = []
    for pid_file in sorted(directory.glob("rank*.pid")):
        status = Path(f"/proc/{pid_file.read_text().strip()}/status")
        try:
            state = next(
                line for line in status.read_text().splitlines() if line.startswith("State:")
            )
        except (OSError, StopIteration):
            continue  # gone
        if "zombie" not in state:
            left.append(
                f"{pid_file.stem}'s process {pid_file.read_text().strip()} is still alive ({state})"
            )
    return left


def run_job(seed: int) -> JobResult:
    from chaos_rank import chaos_rank
    from multiprocess import fairring_env, launch

    job = draw_job(seed)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"chaos_{seed}_") as tmp:
        directory = Path(tmp)
        outcomes = launch(
            chaos_rank,
            job.world,
            list(job.machines),
            env=fairring_env(**dict(job.env)),
            timeout_s=JOB_TIMEOUT_S,
            abort_grace_s=None,
            store_in_process=job.fault.kind == "store_death",
            job=job,
            job_dir=tmp,
        )
        names = ["kill_at", "freeze_at", "store_dead_at"]
        names += [f"mate_at_{r}" for r in range(job.world)]
        files = {
            name: float((directory / name).read_text())
            for name in names
            if (directory / name).exists()
        }
        verdict = judge(job, outcomes, files)
        verdict.problems += _processes_left(directory)
    if verdict.problems:
        verdict.outcome = "FAILED"
    return JobResult(job, verdict, time.monotonic() - t0)


def _worst(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summary(results: list[JobResult], wall_s: float) -> list[str]:
    faults = collections.Counter(r.job.fault.kind for r in results)
    outcomes = collections.Counter(f"{r.job.fault.kind}: {r.verdict.outcome}" for r in results)
    shapes = collections.Counter(r.job.shape for r in results)
    failed = [r for r in results if r.verdict.problems]
    lines = [
        f"chaos: {len(results)} jobs ({', '.join(f'{s} {n}' for s, n in sorted(shapes.items()))}), "
        f"{sum(len(r.job.calls) for r in results)} calls, {wall_s:.0f} s, {len(failed)} failed",
        "faults: " + ", ".join(f"{k} {n}" for k, n in sorted(faults.items())),
        "outcomes:",
        *(f"  {what}: {n}" for what, n in sorted(outcomes.items())),
        "worst time to raise, by fault (fairring / Gloo in the same jobs):",
    ]
    measures = {
        "kill": "after the kill",
        "leave": "after the rank left",
        "start_kill": "after a kill at start-up (bound: the group's timeout + 1 s)",
        "freeze": "after the freeze",
        "bad_call": "after the call was posted on every rank",
        "cut": "after the cut",
        "skip": "after the posting, from the skipped call on",
    }
    for kind, measure in measures.items():
        of_kind = [r for r in results if r.job.fault.kind == kind]
        ours = _worst([r.verdict.raise_s for r in of_kind])
        gloo = _worst([r.verdict.gloo_raise_s for r in of_kind])
        if ours is None:
            continue
        timeout = (
            f" (group timeout {of_kind[0].job.group_timeout_s:.0f} s)"
            if kind in ("freeze", "start_kill", "skip")
            else ""
        )
        versus = f" / Gloo {gloo:.3f} s" if gloo is not None else ""
        lines.append(f"  {kind}: {ours:.3f} s{versus} {measure}{timeout}")
    destroy = _worst([r.verdict.destroy_s for r in results if r.job.fault.kind != "freeze"])
    destroy_frozen = _worst([r.verdict.destroy_s for r in results if r.job.fault.kind == "freeze"])
    lines.append(
        f"worst destroy: {destroy or 0:.3f} s"
        + (f", {destroy_frozen:.3f} s with a peer frozen" if destroy_frozen is not None else "")
    )
    lines.append(f"slowest job: {max((r.wall_s for r in results), default=0):.1f} s")
    return lines


def _record(r: JobResult) -> dict[str, Any]:
    return {
        "seed": r.job.seed,
        "job": r.job.describe(),
        "fault": r.job.fault.kind,
        "outcome": r.verdict.outcome,
        "problems": r.verdict.problems,
        "raise_s": r.verdict.raise_s,
        "gloo_raise_s": r.verdict.gloo_raise_s,
        "destroy_s": r.verdict.destroy_s,
        "wall_s": r.wall_s,
    }


def run(seeds: list[int], quiet: bool = False) -> list[JobResult]:
    results = []
    for seed in seeds:
        try:
            result = run_job(seed)
        except KeyboardInterrupt:
            # Ctrl-C: the jobs done so far still make a summary (their count says so).
            print(f"interrupted before seed {seed}", flush=True)
            break
        results.append(result)
        if result.verdict.problems:
            print(
                f"FAIL seed {seed} ({result.job.describe()}): "
                + "; ".join(result.verdict.problems[:3])
                + f" -- replay: {result.replay()}",
                flush=True,
            )
        elif not quiet:
            print(
                f"ok   seed {seed} ({result.job.describe()}): {result.verdict.outcome}, "
                f"{result.wall_s:.1f} s",
                flush=True,
            )
    return results


def build_first() -> None:
    """Both extensions built before the first job: a job with a fault point loads the
    test module, and one compiled inside a job (minutes at load) is a hang to the
    verdict (the first sharded run lost five cuts and delays to it)."""
    from multiprocess import ensure_fairring_built
    from native_module import NATIVE

    ensure_fairring_built()
    code = (
        f"from fairring_pg._build import load_test_extension; load_test_extension({str(NATIVE)!r})"
    )
    print("chaos: building the test module (once)", flush=True)
    subprocess.run([sys.executable, "-c", code], check=True, stdin=subprocess.DEVNULL)


def _from_record(record: dict[str, Any]) -> JobResult:
    verdict = Verdict(
        record["problems"],
        record["outcome"],
        record["raise_s"],
        record["gloo_raise_s"],
        record["destroy_s"],
    )
    return JobResult(draw_job(record["seed"]), verdict, record["wall_s"])


def run_sharded(seeds: list[int], shards: int, quiet: bool) -> list[JobResult]:
    """The jobs in ``shards`` runs side by side (every ``shards``-th seed each), for a
    host whose jobs mostly wait (a freeze waits out the timeout): each shard is this
    command in a process of its own, and its jobs are load to the others'."""
    with tempfile.TemporaryDirectory(prefix="chaos_shards_") as tmp:
        outs = [Path(tmp) / f"shard{i}.json" for i in range(shards)]
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--seeds", ",".join(map(str, seeds[i::shards]))]
                + ["--json", str(out), "--shard"]
                + (["--quiet"] if quiet else [])
            )
            for i, out in enumerate(outs)
            if seeds[i::shards]
        ]
        for proc in procs:
            proc.wait()
        records = [rec for out in outs if out.exists() for rec in json.loads(out.read_text())]
    return sorted((_from_record(rec) for rec in records), key=lambda r: seeds.index(r.job.seed))


# A busy loop that dies with the run, however the run ends (a kill skips `finally`):
# prctl(PR_SET_PDEATHSIG, SIGKILL).
_BUSY = "import ctypes, signal; ctypes.CDLL(None).prctl(1, signal.SIGKILL)\nwhile True: pass"


@contextlib.contextmanager
def load_beside(processes: int) -> Iterator[None]:
    """``processes`` busy loops beside the jobs for the run's length (each wants a whole
    core): the jobs then wait for cores as on a machine that also compiles or trains."""
    busy = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(processes)]
    try:
        yield
    finally:
        for p in busy:
            p.kill()
            p.wait()


def markdown(results: list[JobResult], lines: list[str], command: str) -> str:
    """The run as bench/results/chaos.md keeps it: when, where, the command, the
    summary, and every failing job with its replay."""
    import os

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    failed = [r for r in results if r.verdict.problems]
    out = [
        "# Chaos run",
        "",
        f"`{command}` at {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"load average at the end {load} (a shared 2-core VM).",
        "",
        "```",
        *lines,
        "```",
        "",
    ]
    if failed:
        out += ["Failing jobs:", ""]
        out += [
            f"- {r.job.describe()}: {'; '.join(r.verdict.problems[:2])} (`{r.replay()}`)"
            for r in failed
        ]
    else:
        out.append("No job failed.")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--seeds", help="comma-separated seeds (instead of --jobs/--seed)")
    parser.add_argument("--json", type=Path, help="write every job's verdict here")
    parser.add_argument("--markdown", type=Path, help="write the run's report here (bench/results)")
    parser.add_argument(
        "--quiet", action="store_true", help="print only failing jobs and the summary"
    )
    parser.add_argument(
        "--load", type=int, default=0, help="busy processes beside the jobs (default: none)"
    )
    parser.add_argument(
        "--shards", type=int, default=1, help="runs side by side, each a share of the seeds"
    )
    parser.add_argument("--shard", action="store_true", help=argparse.SUPPRESS)  # no summary
    args = parser.parse_args(argv)
    seeds = (
        [int(s) for s in args.seeds.split(",")]
        if args.seeds
        else list(range(args.seed, args.seed + args.jobs))
    )
    if not args.shard:
        build_first()
    t0 = time.monotonic()
    with load_beside(args.load):
        if args.shards > 1:
            results = run_sharded(seeds, args.shards, args.quiet)
        else:
            results = run(seeds, args.quiet)
    wall = time.monotonic() - t0
    lines = summary(results, wall)
    if not args.shard:
        print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps([_record(r) for r in results], indent=1) + "\n")
    if args.markdown:
        command = "python scripts/chaos.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.markdown.write_text(markdown(results, lines, command))
    return 1 if any(r.verdict.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
