"""CUDA tensors: what fairring runs (its plan, fairring_pg.model.cuda_plan) against NCCL.

fairring's side follows the code's choice per call: the plan's row for the call's size
says NCCL's own allreduce, or pieces of a given size through the composition
(fairring_pg.model.composition) with a given rail exchange; the calls in flight are
issued at once, their pieces share the communicators, lanes, NICs and NVLink, and the
time is the schedule of fairring_pg.model.pipeline (never below its lower bound, which
also names the busiest resource).

NCCL's side: the faster of its ring and tree (NVLS tree on Hopper with NVLink SHARP)
by its own tuning model (fairring_pg.model.nccl), and several calls one after the
other: NCCL runs a stream's collectives in order, so K allreduces in flight take K
times one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fairring_pg.config import Config
from fairring_pg.model import alltoall, nccl
from fairring_pg.model.composition import (
    FAIRRING_PG,
    Implementation,
    call_pieces,
    world_fabric,
)
from fairring_pg.model.cuda_plan import COMPOSE, COMPOSE_MARGIN, CudaPlan, PlanRow, plan_allreduce
from fairring_pg.model.nodes import GpuNode
from fairring_pg.model.pipeline import FlowTime, Scheduled, flow_time, schedule


@dataclass(frozen=True)
class GpuPrediction:
    scheduled: Scheduled  # fairring's time
    bound: FlowTime  # its lower bound, and the resource that gives it
    ring: nccl.AlgoTime  # one call
    tree: nccl.AlgoTime
    chosen: nccl.AlgoTime  # what NCCL would run
    in_flight: int
    row: PlanRow  # what fairring's plan runs for a call of this size
    plan: CudaPlan
    assumptions: list[str] = field(default_factory=list)

    @property
    def fairring_s(self) -> float:
        return self.scheduled.seconds

    @property
    def fairring(self) -> FlowTime:
        return self.bound

    @property
    def direct(self) -> bool:
        """Every call is one NCCL allreduce on fairring too."""
        return self.row.path != COMPOSE

    @property
    def nccl_ring_s(self) -> float:
        return self.in_flight * self.ring.seconds

    @property
    def nccl_tree_s(self) -> float:
        return self.in_flight * self.tree.seconds

    @property
    def nccl_s(self) -> float:
        return self.in_flight * self.chosen.seconds

    @property
    def reference_s(self) -> float:
        return self.nccl_s

    @property
    def reference(self) -> str:
        return f"nccl {self.chosen.algorithm}/{self.chosen.protocol}"

    @property
    def speedup(self) -> float:
        """NCCL's time over fairring's (above 1: fairring is faster)."""
        return self.nccl_s / self.fairring_s if self.fairring_s > 0 else 1.0


def predict_gpu(
    node: GpuNode,
    machines: int,
    size: int,
    in_flight: int = 1,
    config: Config | None = None,
    tuning: nccl.NcclTuning = nccl.NCCL_2_28,
    impl: Implementation = FAIRRING_PG,
    elem_size: int = 4,
) -> GpuPrediction:
    """``in_flight`` allreduces of ``size`` bytes issued at once, on M machines."""
    if machines < 1 or in_flight < 1 or size < 0:
        raise ValueError(
            f"predict_gpu: expected machines >= 1, in_flight >= 1, size >= 0; got {machines}, "
            f"{in_flight}, {size}"
        )
    config = config or Config()
    times = nccl.collective_times(tuning, world_fabric(node), machines, size)
    ring = nccl.best(times, (nccl.RING,))
    tree_algos = (nccl.TREE, nccl.NVLS_TREE)
    tree = nccl.best(times, tree_algos) if any(t.algorithm in tree_algos for t in times) else ring
    plan = plan_allreduce(node, machines, config, tuning, impl)
    scheduled, bound = fairring_time(
        node, machines, [size] * in_flight, config, tuning, impl, elem_size
    )
    return GpuPrediction(
        scheduled=scheduled,
        bound=bound,
        ring=ring,
        tree=tree,
        chosen=nccl.best(times),
        in_flight=in_flight,
        row=plan.row_for(size),
        plan=plan,
        assumptions=assumptions(node, config, tuning, impl),
    )


def fairring_time(
    node: GpuNode,
    machines: int,
    sizes: Sequence[int],
    config: Config,
    tuning: nccl.NcclTuning = nccl.NCCL_2_28,
    impl: Implementation = FAIRRING_PG,
    elem_size: int = 4,
    plan: CudaPlan | None = None,
) -> tuple[Scheduled, FlowTime]:
    """Allreduces of ``sizes`` bytes issued at once, each as fairring's plan runs it:
    (the schedule, its lower bound). ``plan``: the plan to run (default: the one
    ``impl``'s own costs make), so that a cost can change under a plan made without it."""
    plan = plan or plan_allreduce(node, machines, config, tuning, impl)
    calls = []
    for size in sizes:
        row = plan.row_for(size)
        calls.append((size, row.pieces if row.path == COMPOSE else 0, row.exchange))
    pieces, order = call_pieces(
        node, machines, calls, config.lanes, plan.largest_piece, tuning, impl, elem_size
    )
    return schedule(pieces, order), flow_time(pieces)


def assumptions(
    node: GpuNode, config: Config, tuning: nccl.NcclTuning, impl: Implementation
) -> list[str]:
    return [
        f"node: {node.describe()}",
        f"NCCL {tuning.version}'s tuning model (src/graph/tuning.cc) for NCCL's ring and tree "
        f"{'and NVLS tree ' if node.nvls and tuning.nvls_efficiency_hopper else ''}"
        "and for fairring's sub-collectives; NCCL runs allreduces in flight one after another",
        f"fairring: {impl.name}; FAIRRING_CUDA_ALLREDUCE={config.cuda_allreduce}, "
        f"{config.lanes} lanes, largest piece FAIRRING_SLICE_SIZE={config.slice_size} (scaling "
        f"{'on' if config.slice_scaling else 'off'}), NCCL's allreduce below "
        f"FAIRRING_DIRECT_BELOW={config.direct_below} B; the host issues each step in "
        f"{impl.host_s * 1e6:.0f} us, an all-to-all posts each message in {_per_message(impl)}, "
        f"compose only where NCCL's predicted time is {1 + COMPOSE_MARGIN:.2f}x fairring's or more",
        "the rail all-to-all as NCCL charges its own algorithms: its protocol's latency and "
        "bandwidth factor, "
        + (
            "a measured efficiency by message size"
            if impl.alltoall_efficiency.measured
            else "treeCorrectionFactor by message size"
        ),
        "not modelled: congestion in the fabric (every machine's NICs at full rate), "
        "compute beside the collectives (SMs and HBM shared with training), NCCL's CollNet "
        "(SHARP switches), NVLS for fairring's own local steps (ring only: conservative)",
    ]


def _per_message(impl: Implementation) -> str:
    if impl.message_s is not None:
        return f"{impl.message_s * 1e6:.1f} us"
    simple = 1 << 20  # a message NCCL sends with its Simple protocol
    intel, amd = (alltoall.message_cost_s(cpu, simple) * 1e6 for cpu in (nccl.INTEL, nccl.AMD))
    return (
        f"NCCL's network overhead ({intel:g} us on Intel hosts, {amd:g} on AMD or unknown; "
        "LL messages a third)"
    )
