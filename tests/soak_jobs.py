"""Soak: many allreduces of random sizes, dtypes, ops and concurrency on 2 simulated
machines x 2 ranks, every result checked exactly, resident memory and open
descriptors reported at the start and at the end.

    python scripts/soak.py                 # the full form: 10,000 allreduces
    python scripts/soak.py --ops 1500      # what tests/test_soak.py runs
    python scripts/soak.py --kinds all --ops 3000   # every kind and form, see below

Every rank draws the same plan from the seed: batches of 1 to --max-concurrency
allreduces posted asynchronously and waited in a random order (different on each
rank). Inputs are small integers drawn from (seed, operation, rank), so each rank
computes the exact expected result of every allreduce from all ranks' inputs. A
warm-up batch at the largest size in every dtype comes first, so that the allocators
have grown before the starting figures are taken; after it, resident memory may grow
by at most --rss-bound-mib and descriptors and threads not at all.

With ``--kinds all`` the plan is a random program of allreduces, reduce-scatters and
all-gathers in every form (tests/collective_forms.py), the same on every rank, and each
rank decides on its own, after every call, whether it was synchronous and which of its
pending operations it waits on before the next call (docs/design.md, "Message order
across kinds"); every rank checks every result exactly.

Exit status 0 when every result was exact and every figure within its bound.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import math
import os
import random
import time
from pathlib import Path
from typing import Any

FLOATS = ("float32", "float64", "float16", "bfloat16")
INTS = ("int8", "int16", "int32", "int64", "uint8")
DTYPES = FLOATS + INTS + ("bool",)
OPS = ("SUM", "AVG", "MIN", "MAX", "PRODUCT")
WORLD = 4


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    ops: int = 10_000
    seed: int = 0
    max_numel: int = 1 << 18
    max_concurrency: int = 16
    slice_size: int = 64 * 1024
    total_memory: int = 1024 * 1024
    rss_bound_mib: float = 32.0
    timeout_s: float = 1800.0
    kinds: str = "allreduce"  # or "all": every collective of the engine, every form


@dataclasses.dataclass(frozen=True)
class Figures:
    """One rank's resources at one moment."""

    after_ops: int
    rss_mib: float
    fds: int
    sockets: int
    threads: int
    thread_names: tuple[str, ...] = ()


def _thread_names() -> tuple[str, ...]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
    return tuple(sorted(names))


def _figures(after_ops: int) -> Figures:
    rss_kib = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    fds = sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return Figures(
        after_ops=after_ops,
        rss_mib=rss_kib / 1024,
        fds=fds,
        sockets=sockets,
        threads=len(os.listdir("/proc/self/task")),
        thread_names=_thread_names(),
    )


def _settled_figures(after_ops: int, start: Figures, patience_s: float = 3.0) -> Figures:
    """The figures once transient threads are gone, or after patience_s.

    A completion thread that has just completed the last future is still on its way
    out when wait() returns (one idle thread is kept, extra ones exit), so one sample
    can count it; a leaked thread, descriptor or socket stays through the patience."""
    deadline = time.monotonic() + patience_s
    while True:
        now = _figures(after_ops)
        settled = all(getattr(now, f) <= getattr(start, f) for f in ("fds", "sockets", "threads"))
        if settled or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


# ---------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Op:
    index: int
    numel: int
    dtype: str
    op: str


def plan(cfg: SoakConfig) -> list[list[Op]]:
    """Batches of allreduces, identical on every rank."""
    rng = random.Random(cfg.seed)
    # Warm-up: the largest size in every dtype, all in flight at once.
    batches = [[Op(i, cfg.max_numel, dtype, "MAX") for i, dtype in enumerate(DTYPES)]]
    index = len(batches[0])
    while index < cfg.ops:
        batch = []
        for _ in range(min(rng.randint(1, cfg.max_concurrency), cfg.ops - index)):
            # Log-uniform sizes: many small allreduces, some of many slices.
            numel = (
                0 if rng.random() < 0.02 else int(math.exp(rng.uniform(0, math.log(cfg.max_numel))))
            )
            dtype = rng.choice(DTYPES)
            op = rng.choice(OPS)
            if op == "AVG" and dtype not in FLOATS:
                op = "SUM"  # AVG on integers is refused (tests/test_bad_input.py)
            batch.append(Op(index, numel, dtype, op))
            index += 1
        batches.append(batch)
    return batches


def values(seed: int, op: Op, rank: int) -> Any:
    """tests/values.py's wide inputs: integers across their dtype's range, non-integer
    floats (bool: 0 and 1)."""
    from values import make_values

    return make_values(f"soak/{seed}/{op.index}", rank, op.op, op.dtype, op.numel, WORLD, "wide")


def digest(tensor: Any) -> str:
    """The result's bytes, hashed: ranks compare these instead of each recomputing
    every reference."""
    import torch

    raw = tensor.contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw).hexdigest()[:16]


def check(seed: int, op: Op, got: Any) -> str | None:
    """None if ``got`` is the reduction of every rank's input (within the dtype's
    rounding, for floats), else what differs."""
    from values import compare, reference

    want, tolerance = reference([values(seed, op, r) for r in range(WORLD)], op.op, op.dtype)
    return compare(got, want, tolerance, f"allreduce #{op.index} {op}")


# ---------------------------------------------------------------------- rank side


def soak_rank(rank: int, world: int, cfg: SoakConfig) -> dict[str, Any]:
    if cfg.kinds == "all":
        return _soak_kinds_rank(rank, world, cfg)
    if cfg.kinds != "allreduce":
        raise ValueError(f"--kinds {cfg.kinds!r}: expected allreduce or all")
    import torch.distributed as dist

    assert world == WORLD
    batches = plan(cfg)
    order = random.Random(f"{cfg.seed}/{rank}")  # wait order differs between ranks
    errors: list[str] = []
    series: list[Figures] = []
    digests: dict[int, str] = {}
    done = 0
    started = time.monotonic()
    for b, batch in enumerate(batches):
        posted = []
        for op in batch:
            tensor = values(cfg.seed, op, rank)
            work = dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.op), async_op=True)
            posted.append((op, tensor, work))
        order.shuffle(posted)
        for op, tensor, work in posted:
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - reported; the group is now broken
                errors.append(f"allreduce #{op.index} {op}: {exc}")
                return {"errors": errors, "series": series, "done": done}
            # Every result is checked: against the reference by one rank (each rank
            # its share: the reference needs every rank's input, four times the work
            # of making this rank's), and against every other rank's by digest.
            if op.index % world == rank and (err := check(cfg.seed, op, tensor)):
                errors.append(err)
            digests[op.index] = digest(tensor)
            done += 1
        if b == 0 or done // 1000 != (done - len(batch)) // 1000:
            series.append(_figures(done))
    # The final figures while every rank is still up (a peer that has finished and
    # closed its connections would make the counts drop and hide growth).
    dist.barrier()
    series.append(_settled_figures(done, series[0]))
    dist.barrier()
    return {
        "errors": errors[:20],
        "error_count": len(errors),
        "series": series,
        "done": done,
        "digests": digests,
        "elapsed_s": time.monotonic() - started,
    }


def _soak_kinds_rank(rank: int, world: int, cfg: SoakConfig) -> dict[str, Any]:
    import torch.distributed as dist
    from collective_forms import FORMS, issue

    program = random.Random(cfg.seed)  # the same collectives on every rank
    mine = random.Random(f"{cfg.seed}/{rank}")  # when this rank waits on what
    errors: list[str] = []
    # Warm-up: every form at the largest size, all in flight, so that the allocators,
    # the completion threads and the engines' buffers have grown before the first figures.
    warm = [issue(f, f"soak/{cfg.seed}/warm", cfg.max_numel // world) for f in FORMS]
    for op in warm:
        op.wait()
    errors += [err for op in warm if (err := op.check())]
    series: list[Figures] = [_figures(0)]
    pending: list[Any] = []
    done = 0
    started = time.monotonic()

    def finish(op: Any) -> None:
        nonlocal done
        op.wait()
        if err := op.check():
            errors.append(err)
        done += 1
        if done % 1000 == 0:
            series.append(_figures(done))

    for i in range(cfg.ops):
        numel = int(math.exp(program.uniform(0, math.log(cfg.max_numel // world))))
        op = issue(program.choice(FORMS), f"soak/{cfg.seed}/{i}", numel)
        if mine.random() < 0.2:
            finish(op)  # a synchronous call
        else:
            pending.append(op)
        while pending and (len(pending) > cfg.max_concurrency or mine.random() < 0.3):
            finish(pending.pop(mine.randrange(len(pending))))
    mine.shuffle(pending)
    for op in pending:
        finish(op)
    dist.barrier()
    series.append(_settled_figures(done, series[0]))
    dist.barrier()
    return {
        "errors": errors[:20],
        "error_count": len(errors),
        "series": series,
        "done": done,
        "digests": {},
        "elapsed_s": time.monotonic() - started,
    }


# ---------------------------------------------------------------------- parent side


@dataclasses.dataclass
class SoakReport:
    cfg: SoakConfig
    per_rank: list[dict[str, Any]]
    failures: list[str]
    wall_s: float

    def lines(self) -> list[str]:
        what = "collectives of every kind" if self.cfg.kinds == "all" else "allreduces"
        out = [
            f"soak: {self.cfg.ops} {what} on 2 machines x 2 ranks "
            f"(sizes 0..{self.cfg.max_numel} elements, up to {self.cfg.max_concurrency} in "
            f"flight, {self.cfg.slice_size} B slices, {self.cfg.total_memory} B staging), "
            f"{self.wall_s:.1f} s",
            "rank  checked  ops/s   rss MiB start -> end   fds start -> end   "
            "sockets start -> end   threads start -> end",
        ]
        for rank, r in enumerate(self.per_rank):
            if not r.get("series"):
                out.append(f"{rank:>4}  no figures")
                continue
            a, z = r["series"][0], r["series"][-1]
            rate = r["done"] / r["elapsed_s"] if r.get("elapsed_s") else float("nan")
            out.append(
                f"{rank:>4}  {r['done']:>7}  {rate:>5.0f}   {a.rss_mib:>7.1f} -> {z.rss_mib:>7.1f}"
                f"   {a.fds:>5} -> {z.fds:>5}   {a.sockets:>9} -> {z.sockets:>5}"
                f"   {a.threads:>11} -> {z.threads:>4}"
            )
        out.append(
            f"bounds: rss growth <= {self.cfg.rss_bound_mib} MiB after warm-up, "
            "no growth in descriptors, sockets or threads"
        )
        out += [f"FAIL: {f}" for f in self.failures] or ["all results exact, all bounds held"]
        return out


def run_soak(cfg: SoakConfig) -> SoakReport:
    from multiprocess import SHAPES, fairring_env, launch

    t0 = time.monotonic()
    outcomes = launch(
        soak_rank,
        WORLD,
        SHAPES["2x2"],
        env=fairring_env(slice_size=cfg.slice_size, total_memory=cfg.total_memory),
        timeout_s=cfg.timeout_s,
        cfg=cfg,
    )
    wall = time.monotonic() - t0
    failures: list[str] = []
    per_rank: list[dict[str, Any]] = []
    for o in outcomes:
        if not o.ok:
            failures.append(o.describe())
            per_rank.append(o.value or {})
            continue
        r = o.value
        per_rank.append(r)
        if r["done"] != cfg.ops:
            failures.append(f"rank {o.rank}: checked {r['done']} of {cfg.ops}")
        failures += [f"rank {o.rank}: {e}" for e in r["errors"]]
        first = per_rank[0].get("digests") or {}
        differ = sorted(i for i, d in r.get("digests", {}).items() if i in first and d != first[i])
        if o.rank > 0 and differ:
            failures.append(
                f"rank {o.rank}: {len(differ)} results differ from rank 0's, first "
                f"allreduce #{differ[0]}"
            )
        a, z = r["series"][0], r["series"][-1]
        if z.rss_mib - a.rss_mib > cfg.rss_bound_mib:
            failures.append(
                f"rank {o.rank}: resident memory grew {z.rss_mib - a.rss_mib:.1f} MiB "
                f"({a.rss_mib:.1f} -> {z.rss_mib:.1f}), bound {cfg.rss_bound_mib} MiB"
            )
        for field in ("fds", "sockets", "threads"):
            if getattr(z, field) > getattr(a, field):
                failures.append(
                    f"rank {o.rank}: {field} grew {getattr(a, field)} -> {getattr(z, field)}"
                    + (
                        f" (threads {a.thread_names} -> {z.thread_names})"
                        if field == "threads"
                        else ""
                    )
                )
    return SoakReport(cfg, per_rank, failures, wall)


def main(argv: list[str] | None = None) -> int:
    defaults = SoakConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(SoakConfig):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            type=type(getattr(defaults, field.name)),
            default=getattr(defaults, field.name),
        )
    args = parser.parse_args(argv)
    cfg = SoakConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SoakConfig)})
    report = run_soak(cfg)
    print("\n".join(report.lines()))
    for rank, r in enumerate(report.per_rank):
        trend = ", ".join(
            f"{f.after_ops}: {f.rss_mib:.0f} MiB/{f.fds} fds" for f in r.get("series", [])
        )
        print(f"rank {rank} over time: {trend}")
    return 1 if report.failures else 0
