"""What each size of CPU allreduce runs (``FAIRRING_CPU_ALLREDUCE``), as a table made once
per group from the job's shape and configuration, the same on every rank.

A row is ``(from_bytes, path, reason)``, sorted, the first from 0; a call of ``b`` bytes
takes the last row with ``from_bytes <= b`` (src/cpu/cpu_plan.h): ``engine``,
fairring's engine; ``ring``, Gloo's ring; ``measure``, a size class of the measured choice
(src/measured/), whose first calls run both ways, timed, until every rank runs the faster.
Calls whose dtype and op Gloo does not reduce, and calls issued from callbacks, are the
engine's whatever the row.

- ``engine`` / ``gloo``: one row, that path.
- ``model``: the model's verdict alone. With one rank per machine the engine sends a
  ring's bytes, and on a shaped link Gloo's ring (one flow per link) was faster from
  1 MiB: the ring from ``CPU_RING_FROM``, the engine below (``Config.cpu_ring_from``).
- ``auto`` (the default): the engine where the model is sure of it (``engine_is_sure``),
  else every class measured: one below 4 KiB, one per power of two up to 1 GiB, one above.
  The link's rate is not known at run time, so the model cannot place the point where
  latency stops ruling: with one rank per machine (the engine's 2 steps against the
  ring's 2(N-1), but the same bytes) it is never sure.
"""

from __future__ import annotations

from dataclasses import dataclass

from fairring_pg.config import Config
from fairring_pg.model.cuda_plan import COMPOSE_MARGIN

ENGINE, RING, MEASURE = "engine", "ring", "measure"
# Where each measured class starts: below 4 KiB one class, then powers of two to 1 GiB.
CLASS_STARTS = (0,) + tuple(4096 << k for k in range(19))
# The model's measured error (the margin the CUDA plan composes on, above the 9.2% by
# which the model overstated fairring's speedup in the committed CPU validation).
MODEL_ERROR = COMPOSE_MARGIN


@dataclass(frozen=True)
class CpuRow:
    from_bytes: int
    path: str  # ENGINE, RING or MEASURE
    reason: str = ""


@dataclass(frozen=True)
class CpuPlan:
    machines: int
    local_size: int
    rows: tuple[CpuRow, ...]  # sorted by from_bytes, the first from 0

    @property
    def measures(self) -> bool:
        return any(row.path == MEASURE for row in self.rows)

    @property
    def uses_ring(self) -> bool:
        """Whether some call may run on Gloo's ring (then the ring's group is made)."""
        return any(row.path != ENGINE for row in self.rows)

    def core_rows(self) -> list[tuple[int, str]]:
        """The rows as the C++ core takes them (BackendOptions::cpuPlan)."""
        return [(row.from_bytes, row.path) for row in self.rows]

    def describe(self) -> str:
        lines = [f"fairring CPU allreduce plan, {self.machines} x {self.local_size}:"]
        for i, row in enumerate(self.rows):
            upper = self.rows[i + 1].from_bytes - 1 if i + 1 < len(self.rows) else "any"
            lines.append(f"  {row.from_bytes} B .. {upper}: {row.path} ({row.reason})")
        return "\n".join(lines)


def engine_is_sure(machines: int, local_size: int) -> str | None:
    """Why the model is sure the engine is faster at M = ``machines`` of L =
    ``local_size`` ranks, whatever the size and the link, or None where it is not.

    Sure where nothing crosses a link (one machine: the engine moves each chunk once
    between local ranks, Gloo's ring N-1 times; measured 2-6x on 1 x 4,
    bench/results/allreduce_sizes.md), or where the engine is ahead by more than the
    model's error both where the link rules (bytes between machines per machine: the
    engine's 2(M-1)/M of the tensor, the ring's 2(N-1)/N) and where latency rules (the
    engine's 4 steps in a row against the ring's 2(N-1)): 2 x 2, 2 x 3, 3 x 2, 4 x 2 ...
    (measured 1.45-1.5x at 2 x 2 on 1 Gbit/s links, bench/results/HISTORY.md).
    """
    M, L = machines, local_size
    N = M * L
    if N == 1 or M == 1:
        return "one machine: nothing crosses a link, and the engine moves each chunk once"
    if L == 1:
        return None  # the same bytes as the ring
    bytes_ratio = ((M - 1) / M) / ((N - 1) / N)
    steps_ratio = 4 / (2 * (N - 1))
    worst = max(bytes_ratio, steps_ratio)
    if worst * (1 + MODEL_ERROR) <= 1:
        return (
            f"the engine sends {bytes_ratio:.2f}x the ring's bytes between machines in "
            f"{steps_ratio:.2f}x its steps: ahead by more than the model's error "
            f"({MODEL_ERROR:.0%})"
        )
    return None


def plan_cpu_allreduce(config: Config, machines: int, local_size: int) -> CpuPlan:
    """The plan of FAIRRING_CPU_ALLREDUCE (``config.cpu_allreduce``) for M x L."""
    M, L = machines, local_size
    mode = config.cpu_allreduce
    if mode == "engine":
        return CpuPlan(M, L, (CpuRow(0, ENGINE, "FAIRRING_CPU_ALLREDUCE=engine"),))
    if mode == "gloo":
        return CpuPlan(M, L, (CpuRow(0, RING, "FAIRRING_CPU_ALLREDUCE=gloo"),))
    sure = engine_is_sure(M, L)
    if mode == "model" or sure is not None:
        ring_from = config.cpu_ring_from(M, L)
        why = sure or "below the ring's rule"
        rows = [CpuRow(0, ENGINE, why if mode == "auto" else f"the model: {why}")]
        if ring_from >= 0:
            rows.append(
                CpuRow(
                    ring_from,
                    RING,
                    "the model: one rank per machine sends a ring's bytes; Gloo's one flow "
                    "per link was faster from 1 MiB",
                )
            )
        return CpuPlan(M, L, tuple(rows))
    why = (
        "measured: the engine sends a ring's bytes (one rank per machine)"
        if L == 1
        else "measured: the engine's saving is within the model's error"
    )
    return CpuPlan(M, L, tuple(CpuRow(start, MEASURE, why) for start in CLASS_STARTS))
