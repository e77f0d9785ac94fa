"""CUDA tensors: fairring's sub-group allreduce (src/subgroups/) against NCCL's.

fairring, per slice of s bytes (FAIRRING_SLICE_SIZE, grown with M and cut to fit
FAIRRING_LANES slots in FAIRRING_TOTAL_MEMORY: Config.subgroup_slice_size), on lane k:
  1. NCCL reduce-scatter over the machine's L GPUs          NVLink, (L-1)/L of s
  2. collect: all-to-all of my chunk's M shards on the rail  NICs, (M-1)/M of s per machine
  3. a reduction kernel over the M received shards          HBM, (M+1)/(L·M) of s
  4. diffuse: all-gather of the reduced shards on the rail   NICs, (M-1)/M of s per machine
  5. NCCL all-gather over the machine's L GPUs               NVLink, (L-1)/L of s
Each step's time is NCCL's own model of that collective (fairring_pg.model.nccl) on the
sub-communicator's ranks; the all-to-all, which NCCL's tuning does not model, takes the
network latency plus one message cost per peer. Lanes are FAIRRING_LANES slices in
flight; the two local communicators each run one collective at a time; a machine's
NICs carry the collect and diffuse of all its GPUs; the proxy (the CPU side that posts
network messages for a GPU) pays a cost per message. Below FAIRRING_DIRECT_BELOW, and
on one machine, an allreduce is one NCCL allreduce, as in the code.

NCCL's side: the faster of its ring and tree (NVLS tree on Hopper with NVLink SHARP)
for each call, and several calls one after the other: NCCL runs a stream's
collectives in order, so K allreduces in flight take K times one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fairring_pg.config import Config
from fairring_pg.model import nccl
from fairring_pg.model.nodes import GpuNode
from fairring_pg.model.pipeline import FlowTime, Piece, Stage, flow_time


@dataclass(frozen=True)
class Implementation:
    """Which reduction-server allreduce: this project's, or the Fairring seed's."""

    name: str
    message_s: float  # proxy (CPU) seconds per rail message sent or received, one GPU's
    nccl_collectives: bool  # the diffuse is an NCCL all-gather (else M-1 plain sends)
    single_machine_allreduce: bool = True  # M = 1 is one NCCL allreduce
    launch_s: float = 5e-6  # a kernel launch: the reduction of step 3
    host_s: float = 10e-6  # the host's cost of issuing one sub-group collective (torch)


# fairring_pg: every step an NCCL collective on a ProcessGroupNCCL sub-group. A message
# costs NCCL's network post overhead: 1 us on Intel hosts, x3 for the Simple protocol
# (NCCL 2.28 src/graph/tuning.cc, getNetOverhead).
FAIRRING_PG = Implementation("fairring_pg (NCCL sub-groups)", message_s=3e-6, nccl_collectives=True)


@dataclass(frozen=True)
class GpuPrediction:
    fairring: FlowTime
    ring: nccl.AlgoTime  # one call
    tree: nccl.AlgoTime
    chosen: nccl.AlgoTime  # what NCCL would run
    in_flight: int
    direct: bool  # every call was one NCCL allreduce on fairring too
    slice_bytes: int
    assumptions: list[str] = field(default_factory=list)

    @property
    def fairring_s(self) -> float:
        return self.fairring.seconds

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


def world_fabric(node: GpuNode) -> nccl.Fabric:
    return nccl.Fabric(
        arch=node.arch,
        ranks_per_node=node.gpus,
        intra=node.intra,
        inter=node.inter,
        channels=node.channels,
        nvls=node.nvls,
        nvls_channels=node.nics,
    )


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
    chosen = nccl.best(times)
    fairring, direct, slice_bytes = fairring_time(
        node, machines, [size] * in_flight, config, tuning, impl, elem_size
    )
    return GpuPrediction(
        fairring=fairring,
        ring=ring,
        tree=tree,
        chosen=chosen,
        in_flight=in_flight,
        direct=direct,
        slice_bytes=slice_bytes,
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
) -> tuple[FlowTime, bool, int]:
    """(time, whether every call went to one NCCL allreduce, the slice in bytes)."""
    L, M = node.gpus, machines
    if L * M == 1:
        return flow_time([]), True, 0
    slice_bytes = config.subgroup_slice_size(M, L)
    if M == 1 and not impl.single_machine_allreduce:
        slice_bytes = config.slice_size
    pieces: list[Piece] = []
    direct = True
    for size in sizes:
        numel = size // elem_size
        one_machine = M == 1 and impl.single_machine_allreduce
        if one_machine or size < config.direct_below or numel < L * M:
            pieces.append(_direct(node, M, size, tuning))
            continue
        direct = False
        slice_elems = slice_bytes // elem_size
        aligned = numel - numel % (L * M)
        for begin in range(0, aligned, slice_elems):
            length = min(slice_elems, aligned - begin)
            pieces.append(slice_stages(node, M, length * elem_size, tuning, impl))
        if aligned < numel:
            pieces.append(_direct(node, M, (numel - aligned) * elem_size, tuning))
    sliced = [p for p in pieces if len(p.stages) > 1]
    windows = {"lanes": sum(p.critical_path for p in sliced) / config.lanes} if sliced else {}
    return flow_time(pieces, windows), direct, slice_bytes


def _direct(node: GpuNode, M: int, nbytes: int, tuning: nccl.NcclTuning) -> Piece:
    seconds = nccl.best(nccl.collective_times(tuning, world_fabric(node), M, nbytes)).seconds
    return Piece((Stage("NCCL allreduce", {"world communicator": seconds}),))


def slice_stages(
    node: GpuNode, M: int, nbytes: int, tuning: nccl.NcclTuning, impl: Implementation
) -> Piece:
    L = node.gpus
    host = {"host": impl.host_s}
    stages = []
    local = nccl.Fabric(node.arch, L, node.intra, node.inter, node.channels)
    if L > 1:
        rs = nccl.best(nccl.collective_times(tuning, local, 1, nbytes, nccl.REDUCE_SCATTER))
        stages.append(
            Stage(
                "reduce-scatter",
                {"local reduce-scatter": rs.seconds, "nvlink": rs.seconds - rs.latency_s, **host},
            )
        )
    chunk = nbytes / L
    wire = (M - 1) / M * nbytes / node.inter  # the machine's NICs, collect or diffuse
    messages = 2 * (M - 1) * impl.message_s  # M-1 sent and M-1 received
    one_ppn = tuning.one_ppn_inter_lat_from_tree
    net_lat = tuning.hw_lat[nccl.NET][nccl.TREE if one_ppn else nccl.RING][nccl.SIMPLE] * 1e-6
    post = (M - 1) * impl.message_s
    stages.append(
        Stage("collect", {"nic": wire, "proxy": messages, **host}, net_lat + post),
    )
    reduce_s = (M + 1) * chunk / M / node.hbm
    stages.append(Stage("reduce", {"gpu": reduce_s, **host}, impl.launch_s))
    if impl.nccl_collectives:
        rail = nccl.Fabric(node.arch, 1, node.intra, node.inter / L, node.channels)
        ag = nccl.best(nccl.collective_times(tuning, rail, M, int(chunk), nccl.ALL_GATHER))
        diffuse_lat = ag.latency_s
        wire = max(wire, ag.seconds - ag.latency_s)
    else:
        diffuse_lat = net_lat + post
    stages.append(Stage("diffuse", {"nic": wire, "proxy": messages, **host}, diffuse_lat))
    if L > 1:
        ag = nccl.best(nccl.collective_times(tuning, local, 1, nbytes, nccl.ALL_GATHER))
        stages.append(
            Stage(
                "all-gather",
                {"local all-gather": ag.seconds, "nvlink": ag.seconds - ag.latency_s, **host},
            )
        )
    return Piece(tuple(stages))


def assumptions(
    node: GpuNode, config: Config, tuning: nccl.NcclTuning, impl: Implementation
) -> list[str]:
    return [
        f"node: {node.describe()}",
        f"NCCL {tuning.version}'s tuning model (src/graph/tuning.cc) for NCCL's ring and tree "
        f"{'and NVLS tree ' if node.nvls and tuning.nvls_efficiency_hopper else ''}"
        "and for fairring's sub-collectives; NCCL runs allreduces in flight one after another",
        f"fairring: slice FAIRRING_SLICE_SIZE={config.slice_size} (scaling "
        f"{'on' if config.slice_scaling else 'off'}), {config.lanes} lanes, direct below "
        f"{config.direct_below} B; {impl.name}, "
        f"{impl.message_s * 1e6:.0f} us of proxy time per message",
        "not modelled: congestion in the fabric (every machine's NICs at full rate), "
        "compute running beside the collectives, NCCL's CollNet (SHARP switches)",
    ]
