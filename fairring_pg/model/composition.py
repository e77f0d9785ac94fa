"""How fairring's CUDA allreduce runs a call: its pieces, their stages and resources.

A composed call of S bytes is cut into pieces (``cut_pieces``, the rule the C++ applies;
the plan, fairring_pg.model.cuda_plan, says how large). Each piece of p bytes, on lane k
(the unit counter mod FAIRRING_LANES), on M machines of L GPUs:

  reduce-scatter   (L > 1) NCCL's reduce-scatter of the piece over the machine's L
                   GPUs, in place: holds the local reduce-scatter communicator, NVLink
  rail exchange    of my chunk (p/L) with the M ranks of my rail, on lane k's
                   communicator; the machine's NICs carry 2(M-1)/M of p per direction:
                   "alltoall": all-to-all of the M shards, one kernel that reduces the M
                   received copies and writes the result M times (HBM), all-to-all of
                   those: two direct hops;
                   "reduce_scatter": NCCL's reduce-scatter then all-gather on the rail
                   (NCCL runs them as a ring or, with one GPU per node, PAT);
  all-gather       (L > 1) NCCL's all-gather over the machine, in place: the local
                   all-gather communicator, NVLink.

Each step's time is NCCL's own model of that collective on that communicator
(fairring_pg.model.nccl); the all-to-all, which NCCL's tuning does not model, is
charged by message as NCCL charges its own algorithms (fairring_pg.model.alltoall):
protocol, latency, payload rate by message size, and its proxy posts 2(M-1) messages
at NCCL's network overhead each. With ``overlap`` each step runs on a stream of its
own and waits only for the step before it, so the reduce-scatter of a piece, the rail
exchange of the one before and the all-gather of the one before that run at once;
without it (whole slices, as on the H100 of bench/results/cuda/, and the Fairring seed)
a slice's steps run one after another on its lane. The host issues every step
(``Implementation.host_s``) in the order of ``issue_order``; a lane is one communicator,
so its pieces take turns, and the transfers of all lanes share the machine's NICs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from fairring_pg.model import alltoall, nccl
from fairring_pg.model.alltoall import MessageEfficiency
from fairring_pg.model.constants import ALLTOALL_EFFICIENCY, HOST_STEP, KERNEL_START, OVERLAP
from fairring_pg.model.nodes import GpuNode
from fairring_pg.model.pipeline import Piece, Stage
from fairring_pg.sizing import PIECE_ALIGNMENT

ALLTOALL, REDUCE_SCATTER = "alltoall", "reduce_scatter"
# Only for whole slices (FAIRRING_PG_SLICES, the runs of bench/results/cuda/) and the
# Fairring seed:
ALLTOALL_ALLGATHER, MESSAGES = "alltoall_allgather", "messages"


@dataclass(frozen=True)
class Implementation:
    """A reduction-server allreduce on GPUs: this project's (pieces overlapped, or whole
    slices as on the H100 of bench/results/cuda/), or the Fairring seed's. The defaults
    of fairring's own costs are fairring_pg.model.constants'."""

    name: str
    # Proxy (CPU) seconds per rail message posted, one GPU's; None: NCCL's own, by
    # protocol and the hosts' CPU vendor (fairring_pg.model.alltoall.message_cost_s).
    message_s: float | None
    exchanges: tuple[str, ...]  # rail exchanges it can run
    overlap: bool  # the steps of consecutive pieces overlap (streams per step)
    planned: bool  # pieces and exchange per call from the model (else whole slices)
    single_machine_allreduce: bool = True  # M = 1 is one NCCL allreduce
    # Who posts the rail messages: each lane's communicator its own NCCL proxy thread
    # (NCCL 2.28.9 src/init.cc: a split shares its parent's only when asked to), or
    # one CPU thread for the process (the Fairring seed's TensorPipe loop).
    proxy_per_lane: bool = True
    host_s: float = HOST_STEP.value
    launch_s: float = KERNEL_START.value
    # The NCCL all-to-all's payload rate by message size (not the seed's messages).
    alltoall_efficiency: MessageEfficiency = ALLTOALL_EFFICIENCY.value


FAIRRING_PG = Implementation(
    "fairring_pg (NCCL sub-groups, steps of pieces overlapped)",
    message_s=None,
    exchanges=(ALLTOALL, REDUCE_SCATTER),
    overlap=OVERLAP.value,
    planned=True,
)
# What ran on the H100 in bench/results/cuda/: whole slices, the five steps in a row on
# a lane, the all-to-all; bench/model_validation.py holds those runs to it.
FAIRRING_PG_SLICES = Implementation(
    "fairring_pg in whole slices (five steps in a row)",
    message_s=None,
    exchanges=(ALLTOALL_ALLGATHER,),
    overlap=False,
    planned=False,
)


@dataclass(frozen=True)
class Unit:
    begin: int  # element offset
    numel: int
    direct: bool  # one NCCL allreduce on the world group


def group_elements(elem_size: int, L: int, M: int) -> int:
    """The elements of one group: L·M times those that make PIECE_ALIGNMENT bytes (at
    least one), so that whole groups split into L chunks of M shards, each aligned."""
    return max(1, PIECE_ALIGNMENT // max(1, elem_size)) * L * M


def cut_pieces(
    numel: int, elem_size: int, pieces: int, largest_piece: int, L: int, M: int
) -> list[Unit]:
    """How a composed call is cut, the same on every rank (the C++ applies this rule:
    src/subgroups/call_cut.h). The call's whole groups (group_elements) go into
    P = min(groups, max(pieces, ceil(groups / G))) pieces, G the groups that fit in
    ``largest_piece`` bytes (0: no limit), as even as can be (the first ``groups mod P`` one group
    longer); the fewer than a group's elements left over are one direct unit."""
    unit = group_elements(elem_size, L, M)
    groups, tail = divmod(numel, unit)
    units: list[Unit] = []
    if groups:
        fit = max(1, largest_piece // (elem_size * unit)) if largest_piece else groups
        count = min(groups, max(pieces, -(-groups // fit)))
        base, longer = divmod(groups, count)
        begin = 0
        for i in range(count):
            n = (base + (1 if i < longer else 0)) * unit
            units.append(Unit(begin, n, False))
            begin += n
    if tail:
        units.append(Unit(groups * unit, tail, True))
    return units


_CACHE: dict[tuple[object, ...], nccl.AlgoTime] = {}


def nccl_time(
    tuning: nccl.NcclTuning, fabric: nccl.Fabric, nodes: int, nbytes: int, coll: str
) -> nccl.AlgoTime:
    """What NCCL would run for this collective, by its own model (memoised)."""
    key = (tuning.version, fabric, nodes, nbytes, coll)
    found = _CACHE.get(key)
    if found is None:
        found = nccl.best(nccl.collective_times(tuning, fabric, nodes, nbytes, coll))
        if len(_CACHE) > 100_000:
            _CACHE.clear()
        _CACHE[key] = found
    return found


def nccl_cpu(node: GpuNode) -> str:
    """The vendor NCCL's side is modelled with: Intel's figures where unknown (the
    faster for NCCL)."""
    return node.cpu if node.cpu in nccl.CPU_VENDORS else nccl.INTEL


def world_fabric(node: GpuNode) -> nccl.Fabric:
    return nccl.Fabric(
        arch=node.arch,
        ranks_per_node=node.gpus,
        intra=node.intra,
        inter=node.inter,
        channels=node.channels,
        nvls=node.nvls,
        nvls_channels=node.nics,
        cpu=nccl_cpu(node),
    )


def local_fabric(node: GpuNode) -> nccl.Fabric:
    return nccl.Fabric(
        node.arch, node.gpus, node.intra, node.inter, node.channels, cpu=nccl_cpu(node)
    )


def rail_fabric(node: GpuNode) -> nccl.Fabric:
    """One rank per node; every rail of a machine runs at once, so each gets 1/L of
    the machine's NICs."""
    return nccl.Fabric(
        node.arch, 1, node.intra, node.inter / node.gpus, node.channels, cpu=nccl_cpu(node)
    )


def direct_piece(
    node: GpuNode, M: int, nbytes: int, tuning: nccl.NcclTuning, impl: Implementation, lane: str
) -> Piece:
    t = nccl_time(tuning, world_fabric(node), M, nbytes, nccl.ALLREDUCE)
    link = "nic" if M > 1 else "nvlink"
    return Piece(
        (
            Stage(
                "NCCL allreduce",
                {link: t.seconds - t.latency_s},
                t.latency_s,
                hold=("world communicator", lane),
                issue=impl.host_s,
            ),
        )
    )


def piece_stages(
    node: GpuNode,
    M: int,
    nbytes: int,
    exchange: str,
    lane: int,
    tuning: nccl.NcclTuning,
    impl: Implementation,
) -> Piece:
    """The stages of one piece of ``nbytes`` on lane ``lane``."""
    return _piece_stages(node, M, nbytes, exchange, lane, tuning.version, impl)


@functools.lru_cache(maxsize=4096)
def _piece_stages(
    node: GpuNode, M: int, nbytes: int, exchange: str, lane: int, version: str, impl: Implementation
) -> Piece:
    tuning = nccl.TUNINGS[version]
    L = node.gpus
    lane_queue = f"lane {lane}"
    # Without the overlap a slice's steps all run on its lane's stream.
    own = () if impl.overlap else (lane_queue,)
    stages: list[Stage] = []

    def local(name: str, coll: str) -> Stage:
        t = nccl_time(tuning, local_fabric(node), 1, nbytes, coll)
        return Stage(
            name,
            {"nvlink": t.seconds - t.latency_s},
            t.latency_s,
            hold=(f"local {name}", *own),
            issue=impl.host_s,
        )

    if L > 1:
        stages.append(local("reduce-scatter", nccl.REDUCE_SCATTER))
    stages += rail_stages(node, M, nbytes // L, exchange, lane_queue, tuning, impl)
    if L > 1:
        stages.append(local("all-gather", nccl.ALL_GATHER))
    return Piece(tuple(stages))


def rail_stages(
    node: GpuNode,
    M: int,
    chunk: int,
    exchange: str,
    lane: str,
    tuning: nccl.NcclTuning,
    impl: Implementation,
) -> list[Stage]:
    """My chunk's exchange with the M ranks of my rail, on the lane's communicator."""
    if M == 1:
        return []
    if exchange not in impl.exchanges:
        raise ValueError(f"{impl.name} has no rail exchange {exchange!r}")
    rail = rail_fabric(node)
    # What the machine's NICs carry, each way, for one half (the L rails together).
    wire = (M - 1) / M * chunk * node.gpus / node.inter
    held = (lane,)

    def collective(name: str, coll: str) -> Stage:
        t = nccl_time(tuning, rail, M, chunk, coll)
        return Stage(name, {"nic": t.seconds - t.latency_s}, t.latency_s, held, impl.host_s)

    if exchange == REDUCE_SCATTER:
        return [
            collective("rail reduce-scatter", nccl.REDUCE_SCATTER),
            collective("rail all-gather", nccl.ALL_GATHER),
        ]
    proxy = f"proxy of {lane}" if impl.proxy_per_lane else "proxy"
    if exchange == MESSAGES:
        # The Fairring seed: each shard a message its CPU thread posts and waits for,
        # over TensorPipe (not NCCL's protocols).
        assert impl.message_s is not None, "the seed's messages have a cost of their own"
        messages = 2 * (M - 1) * impl.message_s  # M-1 sent and M-1 received
        one_ppn = tuning.one_ppn_inter_lat_from_tree
        net = nccl.TREE if one_ppn else nccl.RING
        net_step = tuning.hw_lat[nccl.NET][net][nccl.SIMPLE] * 1e-6
        post = (M - 1) * impl.message_s
        hop = Stage("collect", {"nic": wire, proxy: messages}, net_step + post, held)
        reduce = Stage("reduce", {"hbm": (M + 1) / M * chunk / node.hbm}, impl.launch_s, held)
        return [hop, reduce, Stage("diffuse", hop.busy, hop.latency, held)]
    # NCCL's all-to-all of my M shards, charged by message as NCCL charges its own
    # algorithms: its fixed cost, the payload rate its protocol and size allow, and its
    # proxy's M-1 sends and M-1 receives.
    message = max(1, chunk // M)
    per_message = (
        impl.message_s if impl.message_s is not None else alltoall.message_cost_s(node.cpu, message)
    )
    share = impl.alltoall_efficiency.at(tuning, rail, M, message)
    busy = {"nic": wire / share, proxy: 2 * (M - 1) * per_message}
    latency = alltoall.hop_latency_s(tuning, message)
    collect = Stage("collect", busy, latency, held, impl.host_s)
    if exchange == ALLTOALL_ALLGATHER:
        hbm = (M + 1) / M * chunk  # read the M copies, write my shard
        reduce = Stage("reduce", {"hbm": hbm / node.hbm}, impl.launch_s, held, impl.host_s)
        return [collect, reduce, collective("diffuse", nccl.ALL_GATHER)]
    # Also write the reduced shard M times: the diffuse is an all-to-all of those copies.
    hbm = (2 * M + 1) / M * chunk
    reduce = Stage("reduce", {"hbm": hbm / node.hbm}, impl.launch_s, held, impl.host_s)
    return [collect, reduce, Stage("diffuse", collect.busy, collect.latency, held, impl.host_s)]


def call_pieces(
    node: GpuNode,
    M: int,
    calls: Sequence[tuple[int, int, str]],
    lanes: int,
    largest_piece: int,
    tuning: nccl.NcclTuning,
    impl: Implementation,
    elem_size: int = 4,
) -> tuple[list[Piece], list[tuple[int, int]]]:
    """The pieces of ``calls`` issued at once, and the order the host issues their
    stages in; each call is (bytes, pieces at least, or 0 for NCCL's own allreduce,
    exchange). Pieces take lanes in turn, across calls, as the C++ does; a call that is
    NCCL's allreduce takes the next lane too. With the steps overlapped (and several GPUs
    per machine) a composed call's tail (its last fewer than L·M elements) is issued
    first, on the all-gather stream, whose first all-gather comes much later: its
    latency hides under the pieces instead of adding to the end."""
    L = node.gpus
    wavefront = L > 1 and impl.overlap
    pieces: list[Piece] = []
    order: list[tuple[int, int]] = []
    counter = 0
    for nbytes, count, exchange in calls:
        numel = nbytes // elem_size
        if not count or numel < L * M:
            if numel:
                pieces.append(
                    direct_piece(node, M, nbytes, tuning, impl, f"lane {counter % lanes}")
                )
                order.append((len(pieces) - 1, 0))
                counter += 1
            continue
        units = cut_pieces(numel, elem_size, count, largest_piece, L, M)
        first = len(pieces)
        for unit in units:
            size = unit.numel * elem_size
            if unit.direct:
                stream = "local all-gather" if wavefront else f"lane {counter % lanes}"
                pieces.append(direct_piece(node, M, size, tuning, impl, stream))
                counter += 0 if wavefront else 1
            else:
                pieces.append(piece_stages(node, M, size, exchange, counter % lanes, tuning, impl))
                counter += 1
        order += issue_order(pieces, first, len(pieces), wavefront)
    return pieces, order


def issue_order(
    pieces: Sequence[Piece], first: int, end: int, wavefront: bool
) -> list[tuple[int, int]]:
    """The order one call's stages are issued in (pieces ``first`` to ``end``).

    With the steps overlapped (and a machine of several GPUs) the host issues a
    wavefront: at tick t the reduce-scatter of piece t, the rail exchange of piece t-1
    and the all-gather of piece t-2, so that it is never a whole piece ahead of the
    step a stream waits for; a direct unit (the tail) comes first. Otherwise piece after
    piece. Each communicator still sees its pieces in order, and every wait is on a
    step issued before, on every rank alike."""
    if not wavefront:
        return [(i, j) for i in range(first, end) for j in range(len(pieces[i].stages))]
    composed = [i for i in range(first, end) if len(pieces[i].stages) > 1]
    order = [(i, 0) for i in range(first, end) if len(pieces[i].stages) == 1]
    for tick in range(len(composed) + 2):
        if tick < len(composed):  # the reduce-scatter of piece t
            order.append((composed[tick], 0))
        if 0 <= tick - 1 < len(composed):  # the rail exchange of piece t-1
            i = composed[tick - 1]
            order += [(i, j) for j in range(1, len(pieces[i].stages) - 1)]
        if 0 <= tick - 2 < len(composed):  # the all-gather of piece t-2
            i = composed[tick - 2]
            order.append((i, len(pieces[i].stages) - 1))
    return order
