"""``FAIRRING_CUDA_ALLREDUCE``'s decision, per call, as a table made once.

From the job's node facts (fairring_pg.cuda.node_facts, merged across ranks), its shape (M
machines of L ranks) and its configuration, the plan is a sorted table of rows

    (from_bytes, path, pieces, exchange, reason)

computed in Python from the cost model; the C++ takes it at the group's creation and,
for a call whose reduced buffer has ``b`` bytes (numel x the element size it reduces
in: int16 travels as int32), applies the last row with ``from_bytes <= b``: ``nccl``,
one NCCL allreduce on the world group; ``compose``, at least ``pieces`` pieces (none
larger than the plan's ``largest_piece``) through the steps of
fairring_pg.model.composition with that rail ``exchange`` (src/subgroups/call_cut.h
applies the same rule); ``measure`` (``auto`` only), a size class of the measured choice
(src/measured/): its first calls run both ways, NCCL's allreduce and that composition,
timed, until every rank runs the faster. Every rank uses the same table (rank 0
publishes it), so every rank takes the same path for the same call.

A row composes only where the model predicts NCCL's own allreduce at least
1 + ``COMPOSE_MARGIN`` times the composition's time, for one call alone, at both ends of its
size range
(with several in flight the composition gains more, NCCL runs them one after
another); elsewhere, where the node is unknown, and with one rank per machine
(measured: bench/results/cuda/), it is NCCL's. That is ``model``'s plan. ``auto``'s
(``measured=True``) measures instead every grid size whose best composition the model
predicts at least 1 / (1 + ``COMPOSE_MARGIN``) of NCCL's speed at both ends: those it
would compose and those within its error.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
from dataclasses import asdict, dataclass

from fairring_pg.config import Config
from fairring_pg.model import nccl
from fairring_pg.model.composition import (
    ALLTOALL,
    FAIRRING_PG,
    REDUCE_SCATTER,
    Implementation,
    Unit,
    call_pieces,
    cut_pieces,
    group_elements,
    nccl_time,
    world_fabric,
)
from fairring_pg.model.nodes import GpuNode
from fairring_pg.model.pipeline import schedule
from fairring_pg.sizing import PIECE_ALIGNMENT

NCCL, COMPOSE, MEASURE = "nccl", "compose", "measure"
# Compose only where the model predicts NCCL's time at least (1 + this) x fairring's: a
# predicted win larger than the model's measured error. Against the committed CPU
# validation (bench/results/model_validation.json) the model overstates fairring's
# speedup by up to 9.2% (tests/test_model_validation.py holds the margin above that); no
# GPU measurement of the composition exists yet.
COMPOSE_MARGIN = 0.10
# The sizes at which the decision is made: 1, 2, 3, 4, 6, ... 48, 64 MiB, then powers of
# two up to 1 GiB; a call between two takes the row of the one below, a larger one the
# last row.
_GRID = tuple(
    sorted(
        {m << 20 for k in range(7) for m in (1 << k, 3 << k >> 1)} | {m << 27 for m in (1, 2, 4, 8)}
    )
)
# Pieces per call the planner tries (each piece a multiple of 16·L·M bytes).
_PIECE_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
_SMALLEST_PIECE = 256 << 10


@dataclass(frozen=True)
class PlanRow:
    from_bytes: int
    path: str  # NCCL, COMPOSE or MEASURE (NCCL's or this composition, as measured)
    pieces: int = 0  # how many pieces a call is cut into, at least (COMPOSE, MEASURE)
    exchange: str = ""  # the rail exchange (COMPOSE, MEASURE)
    reason: str = ""

    def same_choice(self, other: PlanRow) -> bool:
        return (self.path, self.pieces, self.exchange) == (
            other.path,
            other.pieces,
            other.exchange,
        )


@dataclass(frozen=True)
class CudaPlan:
    machines: int
    local_size: int
    node: str  # what the plan was made for ("unknown": no facts)
    rows: tuple[PlanRow, ...]  # sorted by from_bytes, the first from 0
    largest_piece: int = 0  # bytes, a multiple of 16·L·M: no piece is larger

    def row_for(self, nbytes: int) -> PlanRow:
        """The row a call of ``nbytes`` (of its reduced buffer) takes."""
        starts = [row.from_bytes for row in self.rows]
        return self.rows[bisect.bisect_right(starts, nbytes) - 1]

    def units(self, nbytes: int, elem_size: int = 4) -> list[Unit]:
        """How a call of ``nbytes`` is cut: pieces and a direct tail, or one direct
        unit (NCCL's allreduce)."""
        row = self.row_for(nbytes)
        numel = nbytes // elem_size
        if row.path not in (COMPOSE, MEASURE) or numel < group_elements(
            elem_size, self.local_size, self.machines
        ):
            return [Unit(0, numel, True)] if numel else []
        return cut_pieces(
            numel, elem_size, row.pieces, self.largest_piece, self.local_size, self.machines
        )

    @property
    def composes(self) -> bool:
        """Whether any call may be composed (else no lane or local group is needed)."""
        return any(row.path in (COMPOSE, MEASURE) for row in self.rows)

    @property
    def measures(self) -> bool:
        """Whether any size is left to the measured choice."""
        return any(row.path == MEASURE for row in self.rows)

    def core_rows(self) -> list[tuple[int, str, int, str]]:
        """The rows as the C++ core takes them (SubgroupOptions::plan)."""
        return [(row.from_bytes, row.path, row.pieces, row.exchange) for row in self.rows]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CudaPlan:
        data = json.loads(text)
        rows = tuple(PlanRow(**row) for row in data.pop("rows"))
        return cls(rows=rows, **data)

    def describe(self) -> str:
        lines = [f"fairring CUDA allreduce plan, {self.machines} x {self.local_size}, {self.node}:"]
        for i, row in enumerate(self.rows):
            upper = self.rows[i + 1].from_bytes if i + 1 < len(self.rows) else None
            span = f"{row.from_bytes} B .. {upper - 1 if upper else 'any'}"
            composition = f"compose, {row.pieces}+ pieces, rail {row.exchange}"
            what = {
                COMPOSE: composition,
                MEASURE: f"measured: NCCL's allreduce or {composition}",
            }.get(row.path, "NCCL's allreduce")
            lines.append(f"  {span}: {what} ({row.reason})")
        return "\n".join(lines)


TEST_PLAN_VARIABLE = "FAIRRING_TEST_CUDA_PLAN"


def forced_rows(text: str) -> tuple[PlanRow, ...]:
    """The rows of FAIRRING_TEST_CUDA_PLAN (tests): comma-separated
    ``FROM:nccl`` or ``FROM:compose|measure:PIECES:alltoall|reduce_scatter``, FROM in bytes
    (K/M suffixes), the first 0, ascending. Raises ValueError naming the variable."""
    from fairring_pg.config import parse_byte_size

    rows: list[PlanRow] = []
    for item in text.strip().split(","):
        fields = item.strip().split(":")
        where = f"{TEST_PLAN_VARIABLE}={text!r}: {item.strip()!r}"
        try:
            raw = fields[0].strip()
            start = 0 if raw == "0" else parse_byte_size(TEST_PLAN_VARIABLE, raw)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if fields[1:] == [NCCL]:
            rows.append(PlanRow(start, NCCL, reason="forced (tests)"))
        elif (
            len(fields) == 4
            and fields[1] in (COMPOSE, MEASURE)
            and fields[2].isdigit()
            and int(fields[2]) >= 1
            and fields[3] in (ALLTOALL, REDUCE_SCATTER)
        ):
            rows.append(PlanRow(start, fields[1], int(fields[2]), fields[3], "forced (tests)"))
        else:
            raise ValueError(
                f"{where}: expected FROM:nccl or "
                "FROM:compose|measure:PIECES:alltoall|reduce_scatter"
            )
    starts = [row.from_bytes for row in rows]
    if starts[0] != 0 or starts != sorted(set(starts)):
        raise ValueError(f"{TEST_PLAN_VARIABLE}={text!r}: rows must start at 0 and grow")
    return tuple(rows)


def forced_plan(text: str, machines: int, config: Config, local_size: int) -> CudaPlan:
    """The plan FAIRRING_TEST_CUDA_PLAN gives, for M = ``machines`` of L = ``local_size``."""
    rows = forced_rows(text)
    composes = any(row.path in (COMPOSE, MEASURE) for row in rows)
    largest = config.subgroup_slice_size(machines, local_size) if composes else 0
    if composes and (machines == 1 or local_size * machines == 1):
        rows = (PlanRow(0, NCCL, reason="one machine: nothing to compose"),)
        largest = 0
    return CudaPlan(machines, local_size, TEST_PLAN_VARIABLE, rows, largest)


def only_nccl(machines: int, local_size: int, node: str, reason: str) -> CudaPlan:
    return CudaPlan(machines, local_size, node, (PlanRow(0, NCCL, reason=reason),))


def plan_allreduce(
    node: GpuNode | None,
    machines: int,
    config: Config,
    tuning: nccl.NcclTuning = nccl.NCCL_2_28,
    impl: Implementation = FAIRRING_PG,
    local_size: int | None = None,
    measured: bool = False,
) -> CudaPlan:
    """The plan for M = ``machines`` of L = ``local_size`` ranks (``node.gpus`` when
    not given); ``node`` None: the facts are unknown. ``measured``: ``auto``'s plan, in
    which the sizes the model is not sure of (or would compose) are measured (MEASURE
    rows); else the model's alone."""
    L = local_size if local_size is not None else node.gpus if node else 1
    if node is not None and node.gpus != L:
        raise ValueError(f"plan_allreduce: node has {node.gpus} GPUs but L = {L}")
    return _plan(node, machines, L, config, tuning.version, impl, measured)


@functools.lru_cache(maxsize=256)
def _plan(
    node: GpuNode | None,
    M: int,
    L: int,
    config: Config,
    version: str,
    impl: Implementation,
    measured: bool = False,
) -> CudaPlan:
    tuning = nccl.TUNINGS[version]
    name = node.name if node else "unknown"
    mode = config.cuda_allreduce
    if L * M == 1:
        return only_nccl(M, L, name, "one rank: nothing to reduce")
    if mode == "direct":
        return only_nccl(M, L, name, "FAIRRING_CUDA_ALLREDUCE=direct")
    if M == 1 and impl.single_machine_allreduce:
        return only_nccl(M, L, name, "one machine: NCCL's allreduce over NVLink")
    if node is None and mode == "lanes":
        # Composed as asked, without a model to cut by: one piece per largest piece.
        largest = config.subgroup_slice_size(M, L)
        why = "FAIRRING_CUDA_ALLREDUCE=lanes, node facts unknown: as many pieces as fit"
        rows = [PlanRow(config.direct_below, COMPOSE, 1, ALLTOALL, why)]
        below = PlanRow(0, NCCL, reason=f"below FAIRRING_DIRECT_BELOW={config.direct_below}")
        if config.direct_below:
            rows.insert(0, below)
        else:
            rows[0] = dataclasses.replace(rows[0], from_bytes=0)
        return CudaPlan(M, L, name, tuple(rows), largest)
    if node is None:
        return only_nccl(M, L, name, "node facts unknown (FAIRRING_NODE, or detection)")
    if mode in ("auto", "model") and L == 1:
        return only_nccl(
            M,
            L,
            name,
            "one rank per machine: the composition sends a ring's bytes, and lost on an "
            "H100 at 4x1 (bench/results/cuda/)",
        )
    forced = mode == "lanes"
    largest = config.subgroup_slice_size(M, L)  # raises where the staging cannot fit
    below = PlanRow(
        0, NCCL, reason=f"below FAIRRING_DIRECT_BELOW={config.direct_below}: latency rules"
    )
    if not impl.planned:
        exchange = impl.exchanges[0]
        why = "an unplanned implementation: every allreduce of FAIRRING_DIRECT_BELOW and more"
        rows = [PlanRow(config.direct_below, COMPOSE, 1, exchange, why)]
        start = [below] if config.direct_below else []
        return CudaPlan(M, L, name, tuple(start + rows), largest)
    # Below FAIRRING_DIRECT_BELOW, NCCL's allreduce; from it, what the model decides at
    # each size of the grid for the sizes up to the next.
    rows: list[PlanRow] = [below] if config.direct_below else []
    grid = [s for s in _GRID if s >= config.direct_below]
    if not grid or grid[0] > config.direct_below:
        grid.insert(0, max(config.direct_below, PIECE_ALIGNMENT * L * M))
    for i, size in enumerate(grid):
        upper = grid[i + 1] - 1 if i + 1 < len(grid) else size
        row = _decide(node, M, size, upper, largest, forced, tuning, impl, config.lanes, measured)
        if not rows:
            row = dataclasses.replace(row, from_bytes=0)
        if rows and rows[-1] is not below and rows[-1].same_choice(row) and row.path != MEASURE:
            continue  # the same choice as the sizes below: one row (a measured size: a class)
        rows.append(row)
    return CudaPlan(M, L, name, tuple(rows), largest)


def _decide(
    node: GpuNode,
    M: int,
    size: int,
    upper: int,
    largest: int,
    forced: bool,
    tuning: nccl.NcclTuning,
    impl: Implementation,
    lanes: int,
    measured: bool = False,
) -> PlanRow:
    theirs = nccl_time(tuning, world_fabric(node), M, size, nccl.ALLREDUCE)
    best: tuple[float, int, str] | None = None
    # No piece may exceed the largest: fewer pieces than that allows are the same cut.
    fewest = max(1, -(-size // largest)) if largest else 1
    counts = sorted({max(count, fewest) for count in _PIECE_COUNTS})
    for exchange in impl.exchanges:
        worse = 0  # more pieces help up to a point, then cost more than they hide
        for count in counts:
            if count > 1 and size // count < _SMALLEST_PIECE or worse == 2:
                break
            seconds = composed_seconds(node, M, size, count, exchange, largest, tuning, impl, lanes)
            if best is None or seconds < best[0]:
                best, worse = (seconds, count, exchange), 0
            else:
                worse += 1
    if best is None:
        # Every piece the staging allows is below the smallest worth sending.
        why = f"pieces of at most {largest} bytes (FAIRRING_TOTAL_MEMORY) are too small to compose"
        return PlanRow(
            size,
            COMPOSE if forced else NCCL,
            fewest if forced else 0,
            impl.exchanges[0] if forced else "",
            why,
        )
    seconds, count, exchange = best
    speedup = theirs.seconds / seconds
    nccl_name = f"{theirs.algorithm}/{theirs.protocol}"
    if forced:
        return PlanRow(
            size, COMPOSE, count, exchange, f"FAIRRING_CUDA_ALLREDUCE=lanes ({speedup:.2f}x)"
        )
    at_upper = nccl_time(tuning, world_fabric(node), M, upper, nccl.ALLREDUCE).seconds / (
        composed_seconds(node, M, upper, count, exchange, largest, tuning, impl, lanes)
    )
    worst = min(speedup, at_upper)
    if measured and worst * (1 + COMPOSE_MARGIN) >= 1:
        verdict = "it would compose" if composes(worst) else "within its error"
        why = f"the model predicts {worst:.2f}x NCCL's {nccl_name} ({verdict})"
        return PlanRow(size, MEASURE, count, exchange, why)
    if composes(worst):
        return PlanRow(size, COMPOSE, count, exchange, f"predicted {worst:.2f}x NCCL's {nccl_name}")
    why = f"composing predicted {worst:.2f}x NCCL's {nccl_name}, under {1 + COMPOSE_MARGIN:.2f}x"
    return PlanRow(size, NCCL, reason=why)


def composes(speedup: float) -> bool:
    """Whether a predicted speedup over NCCL's allreduce is enough to compose on."""
    return speedup >= 1.0 + COMPOSE_MARGIN


def composed_seconds(
    node: GpuNode,
    M: int,
    size: int,
    count: int,
    exchange: str,
    largest: int,
    tuning: nccl.NcclTuning,
    impl: Implementation,
    lanes: int,
) -> float:
    """One composed call alone, as scheduled."""
    calls = [(size, count, exchange)]
    pieces, order = call_pieces(node, M, calls, lanes, largest, tuning, impl)
    return schedule(pieces, order).seconds
