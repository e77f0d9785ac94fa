"""Where a composed verdict turns: each of fairring's own constants changed alone, on the
plan as it runs.

The plan (fairring_pg.model.cuda_plan) is made once, with the constants as they are
(fairring_pg.model.constants); a user's job runs that plan whatever the constants
really are. So each constant is changed alone under that fixed plan (not a plan made
again for each value, which would hide a loss behind NCCL's allreduce) until fairring's
predicted time reaches NCCL's: the value at which "fairring faster" turns into
"fairring loses". A cost (per message, host per step, kernel start) is raised, the
all-to-all's efficiency lowered, the overlap switched off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from fairring_pg.config import Config
from fairring_pg.model import alltoall, nccl
from fairring_pg.model.composition import ALLTOALL, FAIRRING_PG, Implementation, world_fabric
from fairring_pg.model.constants import (
    ALLTOALL_EFFICIENCY,
    FAIRRING_SIDE,
    HOST_STEP,
    KERNEL_START,
    MESSAGE,
    OVERLAP,
    Constant,
)
from fairring_pg.model.cuda_plan import COMPOSE, CudaPlan, plan_allreduce
from fairring_pg.model.gpu import fairring_time
from fairring_pg.model.nodes import GpuNode

# How far a constant is searched: costs up to this many times their value, the
# all-to-all's efficiency down to this fraction of it.
_FARTHEST = 1000.0
# Relative precision of a turning value.
_PRECISION = 0.005
# What only the all-to-all exchange pays (the rail reduce_scatter is NCCL's own).
_ALLTOALL_ONLY = (MESSAGE, KERNEL_START, ALLTOALL_EFFICIENCY)


@dataclass(frozen=True)
class Turn:
    """One constant's turning value for one row (None: it does not turn within the
    search, or, for the overlap, switching it off does not turn it)."""

    constant: str
    now: float  # its value in the plan (seconds, an efficiency scale, 1 for overlap on)
    turns_at: float | None
    speedup_there: float  # fairring's speedup at turns_at (overlap: with it off)
    used: bool = True  # False: the row's rail exchange does not use it

    @property
    def factor(self) -> float | None:
        """How far from ``now`` it turns (>= 1: how many times dearer, or less
        efficient); None: it does not turn."""
        if self.turns_at is None:
            return None
        if self.constant == OVERLAP.name:
            return 1.0
        ratio = self.turns_at / self.now
        return 1 / ratio if self.constant == ALLTOALL_EFFICIENCY.name else ratio

    def describe(self) -> str:
        if not self.used:
            return f"{self.constant}: not used"
        if self.constant == OVERLAP.name:
            verdict = "turns" if self.turns_at is not None else "holds"
            return f"overlap off: {self.speedup_there:.2f}x ({verdict})"
        if self.turns_at is None:
            return f"{self.constant}: does not turn"
        if self.constant == ALLTOALL_EFFICIENCY.name:
            return f"{self.constant} x{self.turns_at:.2f}"
        return f"{self.constant} {self.now * 1e6:.3g} -> {self.turns_at * 1e6:.3g} us"


def turning_points(
    node: GpuNode,
    machines: int,
    size: int,
    in_flight: int = 1,
    config: Config | None = None,
    tuning: nccl.NcclTuning = nccl.NCCL_2_28,
    impl: Implementation = FAIRRING_PG,
) -> list[Turn]:
    """For a call of ``size`` (``in_flight`` at once) that the plan composes, where each
    fairring-side constant turns the verdict; [] where the plan runs NCCL's allreduce
    (then no constant of fairring's changes what runs) or fairring already loses."""
    config = config or Config()
    plan = plan_allreduce(node, machines, config, tuning, impl)
    if plan.row_for(size).path != COMPOSE:
        return []
    times = nccl.collective_times(tuning, world_fabric(node), machines, size)
    nccl_s = in_flight * nccl.best(times).seconds

    def speedup(changed: Implementation) -> float:
        scheduled, _ = fairring_time(
            node, machines, [size] * in_flight, config, tuning, changed, plan=plan
        )
        return nccl_s / scheduled.seconds

    if speedup(impl) <= 1.0:
        return []
    return [_turn(constant, impl, node, plan, size, speedup) for constant in FAIRRING_SIDE]


def nearest(turns: list[Turn]) -> Turn | None:
    """The constant that turns the verdict with the least change."""
    turning = [t for t in turns if t.used and t.factor is not None]
    return min(turning, key=lambda t: t.factor or math.inf) if turning else None


def _turn(
    constant: Constant,
    impl: Implementation,
    node: GpuNode,
    plan: CudaPlan,
    size: int,
    speedup: Callable[[Implementation], float],
) -> Turn:
    if constant in _ALLTOALL_ONLY and plan.row_for(size).exchange != ALLTOALL:
        return Turn(constant.name, math.nan, None, math.nan, used=False)
    if constant is OVERLAP:
        off = speedup(dataclasses.replace(impl, overlap=False))
        return Turn(constant.name, 1.0, 0.0 if off <= 1.0 else None, off)
    if constant is ALLTOALL_EFFICIENCY:
        current = impl.alltoall_efficiency

        def less_efficient(x: float) -> Implementation:
            lower = dataclasses.replace(current, scale=current.scale / x)
            return dataclasses.replace(impl, alltoall_efficiency=lower)

        found = _search(lambda x: speedup(less_efficient(x)))
        at = None if found is None else 1 / found[0]
        return Turn(constant.name, 1.0, at, found[1] if found else math.nan)
    now = _value_now(constant, impl, node, plan, size)

    def dearer(x: float) -> Implementation:
        return dataclasses.replace(impl, **{constant.field: now * x})

    found = _search(lambda x: speedup(dearer(x)))
    return Turn(
        constant.name, now, None if found is None else now * found[0], found[1] if found else 0
    )


def _value_now(
    constant: Constant, impl: Implementation, node: GpuNode, plan: CudaPlan, size: int
) -> float:
    if constant is MESSAGE and impl.message_s is None:
        # NCCL's own figure for the messages of this call's largest piece.
        piece = max(u.numel for u in plan.units(size) if not u.direct) * 4
        message = piece // (plan.local_size * plan.machines)
        return alltoall.message_cost_s(node.cpu, message)
    if constant in (HOST_STEP, KERNEL_START, MESSAGE):
        return float(getattr(impl, constant.field))
    raise ValueError(f"no search for {constant.name}")


def _search(speedup_at: Callable[[float], float]) -> tuple[float, float] | None:
    """The least factor x in [1, _FARTHEST] at which ``speedup_at(x)`` falls to 1 (to
    _PRECISION), and the speedup there; None if it stays above."""
    if speedup_at(_FARTHEST) > 1.0:
        return None
    low, high = 1.0, _FARTHEST
    while high / low > 1 + _PRECISION:
        middle = math.sqrt(low * high)
        if speedup_at(middle) > 1.0:
            low = middle
        else:
            high = middle
    return high, speedup_at(high)
