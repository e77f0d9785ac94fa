"""Seeded random programs on fairring's CUDA path, each judged against the NCCL stand-in.

    python scripts/cuda_fuzz.py --jobs N --seed S [--shapes 1x2,2x2,3x1,2x3]
        [--modes auto,model,lanes,direct] [--kinds K1,K2|-K3,...] [--ops K] [--keep DIR]
        [--device vehicle|cuda]

``--device cuda`` (scripts/run_cuda_tests.sh's ``fuzz`` part, on a lent GPU): the same
programs on ``cuda:0``, shared by every rank (simulated machines: 2x1 and 2x2 under MPS),
fairring against ``backend="nccl"`` itself; a GPU keeps no ledger, so there the verdict
is values, errors, hangs and crashes.

Job i draws a program (tests/cuda_fuzz_programs.py) from seed S+i at a shape and a mode
cycled from the lists, runs it on the stream vehicle twice, once on fairring and once
on the stand-in for ProcessGroupNCCL alone (what ``backend="nccl"`` would do), and
judges: no hang, no crash, no race on either run, every op's values equal bitwise to the
stand-in's, and where the stand-in raised for an op fairring raised too (same type);
fairring raised nothing the stand-in did not. A failing job prints the command that
replays it alone. ``--kinds`` takes kinds to use, or ``-kind`` entries to leave out of
all (e.g. ``--kinds=-send_recv,-batch_p2p``).

The modes (the environment each sets; the stream vehicle has no GPU, so no node facts
unless FAIRRING_NODE gives them, and the model alone composes nothing below ~1 MiB):
  auto:   FAIRRING_TEST_CUDA_PLAN with a ``measure`` row: below 1 KiB NCCL's allreduce,
          1-8 KiB the measured choice (its trials run both ways, then the faster), from
          8 KiB the composition with NCCL's reduce-scatter on the rail.
  model:  FAIRRING_TEST_CUDA_PLAN with compose rows, as the model writes them: 3 pieces
          with the all-to-all exchange from 1 KiB, 2 with the reduce-scatter from 8 KiB.
  lanes:  FAIRRING_CUDA_ALLREDUCE=lanes from the machines' facts (FAIRRING_NODE: an H100
          node type for even seeds, none for odd), FAIRRING_DIRECT_BELOW=1K: everything
          from 1 KiB composed of as many pieces as the staging allows, one piece per
          largest piece (reduce-scatter exchange with facts, all-to-all without).
  direct: FAIRRING_CUDA_ALLREDUCE=direct: no sub-group is made, every allreduce is the
          delegate's own Work, every other call delegated as before.
On one machine (1x2) every mode composes nothing (NCCL's allreduce over NVLink).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cuda_fuzz_programs as programs
import cuda_fuzz_rank
import torch

SHAPES: dict[str, list[str]] = {
    "1x2": ["m0", "m0"],
    "2x1": ["m0", "m1"],
    "2x2": ["m0", "m0", "m1", "m1"],
    "3x1": ["m0", "m1", "m2"],
    "2x3": ["m0", "m0", "m0", "m1", "m1", "m1"],
}
MODES = ("auto", "model", "lanes", "direct")
AUTO_PLAN = "0:nccl,1K:measure:3:alltoall,8K:compose:2:reduce_scatter"
MODEL_PLAN = "0:nccl,1K:compose:3:alltoall,8K:compose:2:reduce_scatter"
DEFAULT_OPS = 16
TIMEOUT_S = 90.0


def mode_env(mode: str, seed: int, device: str = "vehicle") -> dict[str, str | None]:
    """The vehicle's environment (tests/test_stream_order.vehicle_env) for ``mode``; on
    a GPU the same, with NCCL's channels lowered so that every communicator of the
    simulated machines fits on the one GPU at once (as scripts/run_cuda_tests.sh's
    tests part does)."""
    from test_stream_order import vehicle_env

    env = dict(vehicle_env())
    if device == "cuda":
        env.setdefault("NCCL_MAX_NCHANNELS", "4")
    if mode == "auto":
        env.update(FAIRRING_CUDA_ALLREDUCE="auto", FAIRRING_TEST_CUDA_PLAN=AUTO_PLAN)
    elif mode == "model":
        env.update(FAIRRING_CUDA_ALLREDUCE="model", FAIRRING_TEST_CUDA_PLAN=MODEL_PLAN)
    elif mode == "lanes":
        node = "h100-8x400g" if seed % 2 == 0 else "none"
        env.update(
            FAIRRING_CUDA_ALLREDUCE="lanes",
            FAIRRING_TEST_CUDA_PLAN=None,
            FAIRRING_NODE=node,
            FAIRRING_DIRECT_BELOW="1K",
        )
    elif mode == "direct":
        env.update(FAIRRING_CUDA_ALLREDUCE="direct", FAIRRING_TEST_CUDA_PLAN=None)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return env


@dataclasses.dataclass
class Verdict:
    seed: int
    shape: str
    mode: str
    kinds: list[str]
    failures: list[str]
    reference_raised: dict[str, int]  # kind -> ops the stand-in raised for
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.failures

    def replay(self, kinds_arg: str | None, ops: int, device: str = "vehicle") -> str:
        extra = f" --kinds={kinds_arg}" if kinds_arg else ""
        extra += f" --ops {ops}" if ops != DEFAULT_OPS else ""
        extra += f" --device {device}" if device != "vehicle" else ""
        return (
            f"python scripts/cuda_fuzz.py --jobs 1 --seed {self.seed} --shapes {self.shape} "
            f"--modes {self.mode}{extra}"
        )


def run_once(
    program: programs.Program,
    shape: str,
    mode: str,
    which: str,
    plant: int | None,
    device: str = "vehicle",
) -> tuple[list[Any] | None, str | None]:
    """(per-rank outcomes, None) or (None, what went wrong with the run as a whole)."""
    from multiprocess import RankFailure, run_ranks

    machines = SHAPES[shape]
    try:
        got = run_ranks(
            cuda_fuzz_rank.run_program,
            len(machines),
            machines,
            env=mode_env(mode, program.seed, device),
            timeout_s=TIMEOUT_S,
            init_group=False,
            program=program,
            mode=which,
            plant=plant,
            device=device,
        )
        return got, None
    except RankFailure as exc:
        statuses = {o.status for o in exc.outcomes if not o.ok}
        symptom = "hang" if statuses & {"killed", "hung_at_exit"} else "crash"
        if statuses == {"error"}:
            symptom = "error"
        first = str(exc).splitlines()
        return None, f"{which}: {symptom}: " + " | ".join(first[:4])[:1500]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def compare(
    program: programs.Program, mine: list[Any], theirs: list[Any]
) -> tuple[list[str], Counter[str]]:
    failures: list[str] = []
    raised: Counter[str] = Counter()
    kinds = {op.index: op.kind for op in program.ops}
    for rank, (m, t) in enumerate(zip(mine, theirs, strict=True)):
        # The same launch racing on both runs is the stand-in's (or the vehicle's) too.
        ours, ref = [_launch_of(r) for r in m["races"]], [_launch_of(r) for r in t["races"]]
        for which, got, other in (("fairring", m, ref), ("stand-in", t, ours)):
            for race in got["races"][:3]:
                also = "also on the other run" if _launch_of(race) in other else "only here"
                failures.append(f"race on {which} ({also}), rank {rank}: {race[:400]}")
        for index in sorted(t["ops"]):
            want, have = t["ops"][index], m["ops"].get(index)
            where = f"rank {rank} op {index} ({kinds[index]})"
            if want[0] == "error":
                raised[kinds[index]] += 1
                if have is None or have[0] != "error":
                    failures.append(f"{where}: the stand-in raised {want[1]}, fairring did not")
                elif have[1] != want[1]:
                    failures.append(f"{where}: fairring raised {have[1]}, stand-in {want[1]}")
                continue
            if have is None:
                failures.append(f"{where}: no outcome on fairring")
            elif have[0] == "error":
                failures.append(f"{where}: error only on fairring: {have[1]}: {have[2][:300]}")
            elif len(have[1]) != len(want[1]):
                failures.append(f"{where}: {len(have[1])} results, stand-in {len(want[1])}")
            else:
                for j, (a, b) in enumerate(zip(have[1], want[1], strict=True)):
                    if not same_bits(a, b):
                        failures.append(f"{where}: wrong values in result {j}: {diff(a, b)}")
    return failures, raised


def _launch_of(race: str) -> str:
    """The racing launch's name without its number (the runs number them differently)."""
    parts = race.split("'")
    name = parts[1] if len(parts) > 2 else race
    return name.split(": ", 1)[-1]


def diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    bad = (a.view(-1) != b.view(-1)).nonzero().flatten()[:3].tolist()
    got = [a.view(-1)[i].item() for i in bad]
    want = [b.view(-1)[i].item() for i in bad]
    return f"{a.dtype} at {bad}: got {got}, stand-in {want}"


def run_job(
    seed: int,
    shape: str,
    mode: str,
    kinds: set[str],
    ops: int = DEFAULT_OPS,
    plant: int | None = None,
    device: str = "vehicle",
) -> Verdict:
    start = time.monotonic()
    world = len(SHAPES[shape])
    program = programs.draw_program(seed, world, kinds, ops)
    failures: list[str] = []
    raised: Counter[str] = Counter()
    # The two runs at once: independent jobs (each its own store), mostly waiting.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        ours = pool.submit(run_once, program, shape, mode, "fairring", plant, device)
        reference = pool.submit(run_once, program, shape, mode, "stand_in", None, device)
        (mine, bad_mine), (theirs, bad_theirs) = ours.result(), reference.result()
    failures += [b for b in (bad_mine, bad_theirs) if b]
    if mine is not None and theirs is not None:
        more, raised = compare(program, mine, theirs)
        failures += more
    kinds_drawn = sorted(program.kinds())
    return Verdict(seed, shape, mode, kinds_drawn, failures, dict(raised), time.monotonic() - start)


def parse_kinds(arg: str | None) -> set[str]:
    if not arg:
        return set(programs.KINDS)
    items = [k.strip() for k in arg.split(",") if k.strip()]
    keep = {k for k in items if not k.startswith("-")}
    drop = {k[1:] for k in items if k.startswith("-")}
    chosen = (keep or set(programs.KINDS)) - drop
    unknown = (keep | drop) - set(programs.KINDS)
    if unknown:
        raise SystemExit(f"unknown kinds {sorted(unknown)}; known: {', '.join(programs.KINDS)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", default="1x2,2x2,3x1,2x3")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--kinds", default=None, help="kinds to use, or -kind to leave out")
    parser.add_argument("--ops", type=int, default=DEFAULT_OPS)
    parser.add_argument("--keep", default=None, help="keep every job's rank logs under DIR")
    parser.add_argument("--device", choices=("vehicle", "cuda"), default="vehicle")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    modes = args.modes.split(",")
    for s in shapes:
        if s not in SHAPES:
            raise SystemExit(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    kinds = parse_kinds(args.kinds)
    if args.keep:
        os.environ["FAIRRING_TEST_KEEP_JOBS"] = str(Path(args.keep).resolve())
    if args.device == "vehicle":
        import stream_vehicle

        stream_vehicle.ensure_built()
    else:
        from multiprocess import ensure_fairring_built

        ensure_fairring_built()
    verdicts: list[Verdict] = []
    start = time.monotonic()
    for i in range(args.jobs):
        seed = args.seed + i
        shape = shapes[i % len(shapes)]
        mode = modes[(i // len(shapes) + i) % len(modes)]
        with heartbeat(f"seed {seed} {shape} {mode}", start):
            verdict = run_job(seed, shape, mode, kinds, args.ops, device=args.device)
        verdicts.append(verdict)
        state = "ok" if verdict.ok else f"FAIL ({len(verdict.failures)})"
        print(
            f"[{time.monotonic() - start:6.1f}s] seed {seed} {shape} {mode}: {state} "
            f"in {verdict.seconds:.1f}s; kinds {','.join(verdict.kinds)}",
            flush=True,
        )
        for failure in verdict.failures[:8]:
            print(f"    {failure}", flush=True)
    summarise(verdicts, args.kinds, args.ops, args.device)
    return 0 if all(v.ok for v in verdicts) else 1


@contextlib.contextmanager
def heartbeat(what: str, start: float, every_s: float = 30.0) -> Iterator[None]:
    """A line every ``every_s`` while a job runs (a hang takes TIMEOUT_S to be judged)."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every_s):
            print(f"[{time.monotonic() - start:6.1f}s] {what}: still running", flush=True)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def summarise(
    verdicts: list[Verdict], kinds_arg: str | None, ops: int, device: str = "vehicle"
) -> None:
    jobs, failed, raised = Counter[str](), Counter[str](), Counter[str]()
    for v in verdicts:
        for kind in v.kinds:
            jobs[kind] += 1
            failed[kind] += 0 if v.ok else 1
        raised.update(v.reference_raised)
    print(f"\n{sum(v.ok for v in verdicts)}/{len(verdicts)} jobs clean")
    print(f"{'kind':24} {'jobs':>5} {'failed':>7} {'stand-in raised (ops x ranks)':>30}")
    for kind in programs.KINDS:
        if jobs[kind]:
            print(f"{kind:24} {jobs[kind]:5} {failed[kind]:7} {raised[kind]:30}")
    for v in verdicts:
        if not v.ok:
            print(f"replay: {v.replay(kinds_arg, ops, device)}")
