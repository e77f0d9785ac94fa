"""NCCL's own cost model: the latencies and bandwidth refinements of src/graph/tuning.cc.

NCCL picks an algorithm (ring, tree, NVLS tree) and a protocol (LL, LL128, Simple) per
call by predicting  time = latency + bytes / algorithm bandwidth  with constants that
are public in its source. This module takes those constants, for two versions, and
evaluates the same formulas; only the per-channel bandwidths, which NCCL gets from its
topology search, come from the hardware description instead (a node's NIC and NVLink
bandwidth, see fairring_pg/model/gpu.py). The constants are facts (numbers), cited from:

- NCCL 2.11.4-1 (Nov 2021, the Fairring seed's era), commit e11238b3029795d33f958b58
  68d47c90c4f22628, src/graph/tuning.cc;
- NCCL 2.28.9-1 (what ran on the H100 in bench/results/cuda/), commit
  dbc86fd06e8b0c4517b95d8958a09ccacf9520c9, src/graph/tuning.cc.

The host's CPU vendor counts where NCCL counts it: across machines, AMD hosts take
``llMaxBws``' second row (Intel and others the first) and, in 2.28, a network overhead
of 2 us per ring step instead of 1 (``getNetOverhead``). Where the vendor is unknown,
NCCL's side takes the Intel figures, the faster for NCCL.

Left out: CollNet (SHARP switches); NCCL's channel and thread-count choices below full
size; LL128 is taken as enabled (NVLink nodes with NICs next to the GPUs, as NCCL's
defaults do). PAT (NCCL 2.23+, all-gather and reduce-scatter with one GPU per node) is
in, since fairring's rail groups are exactly that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LL, LL128, SIMPLE = 0, 1, 2
PROTOCOLS = ("LL", "LL128", "Simple")
RING, TREE, NVLS_TREE, PAT = "ring", "tree", "nvls tree", "pat"
NVLINK, NET = "nvlink", "net"
ALLREDUCE, REDUCE_SCATTER, ALL_GATHER = "allreduce", "reduce-scatter", "all-gather"
ARCHS = ("volta", "ampere", "hopper")
# The host's CPU vendor, as NCCL's topology reports it (ncclTopoCpuType); UNKNOWN_CPU:
# not known to the model.
INTEL, AMD, OTHER_CPU, UNKNOWN_CPU = "intel", "amd", "other", "unknown"
CPU_VENDORS = (INTEL, AMD, OTHER_CPU)

Triple = tuple[float, float, float]  # LL, LL128, Simple; or N1, N2, N4 for the caps


@dataclass(frozen=True)
class NcclTuning:
    """One NCCL version's tuning constants (µs, GB/s) and the rules that differ."""

    version: str
    commit: str
    base_lat: dict[str, Triple]
    hw_lat: dict[str, dict[str, Triple]]  # NVLINK / NET -> algorithm -> per protocol
    ll_max_bw: dict[str, Triple]  # across nodes: "volta" row = Intel, "ampere" row = AMD
    per_ch_max_tree: dict[str, Triple]
    per_ch_max_ring_ll128: dict[str, Triple]
    per_ch_max_tree_ll128: dict[str, Triple]
    per_ch_max_nvls_tree: dict[str, Triple]
    tree_correction: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]
    ring_ll_factor: float  # ring LL: busBw * this (2.11: 1/4, 2.28: 1/2)
    ring_ll128_factor_one_ppn: float  # ring LL128 with one GPU per node
    ll_intra_lat_multinode: float  # 2.11 multiplies LL's intra latency by 1.8 across nodes
    # getNetOverhead by CPU vendor: floors each step of a ring across nodes (x3 Simple)
    net_overhead_us: dict[str, float]
    p2p_ll_threshold: int  # send/recv up to this many bytes per channel use LL (else Simple)
    one_ppn_inter_lat_from_tree: bool  # 2.28: one GPU per node exposes the tree's net latency
    plateau_per_channel_rank: bool  # 2.28: ring plateau when bytes/(channels*ranks) >= 64
    plateau: dict[str, float]  # the ring's latency factor past the plateau, per arch
    ring_ll_factor_one_node_rs_ag: float  # 2.11: 1/3 for one node's reduce-scatter/gather
    ampere_bus_cap: float  # 2.11 caps A100 bus bandwidth at 235 GB/s (0: none)
    nvls_efficiency_hopper: float  # 0 where the version has no NVLS
    pat: bool  # PAT for all-gather / reduce-scatter with one GPU per node (2.23+)


# treeCorrectionFactor: per protocol, for sizes 64 B x 2^i (the same in both versions)
_TREE_CORRECTION = (
    (1, 1, 1, 1, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1, 1, 1, 1),
    (1, 1, 1, 1, 1, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1, 1),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
)  # fmt: skip

NCCL_2_11 = NcclTuning(
    version="2.11.4-1",
    commit="e11238b3029795d33f958b5868d47c90c4f22628",
    base_lat={TREE: (4.4, 4.4, 0.0), RING: (3.6, 10.0, 8.4)},
    hw_lat={
        NVLINK: {TREE: (0.52, 1.25, 28.0), RING: (0.47, 1.9, 3.4)},
        NET: {TREE: (5.0, 8.5, 28.0), RING: (2.7, 4.0, 9.6)},
    },
    ll_max_bw={"volta": (39.0, 39.0, 20.4), "ampere": (87.7, 22.5, 19.0)},
    per_ch_max_tree={"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8)},
    per_ch_max_ring_ll128={"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0)},
    per_ch_max_tree_ll128={"volta": (20.0, 20.0, 20.0), "ampere": (20.0, 20.0, 20.0)},
    per_ch_max_nvls_tree={},
    tree_correction=_TREE_CORRECTION,
    ring_ll_factor=1 / 4,
    ring_ll128_factor_one_ppn=0.7,
    ll_intra_lat_multinode=1.8,
    net_overhead_us={INTEL: 0.0, AMD: 0.0, OTHER_CPU: 0.0},
    p2p_ll_threshold=0,  # p2p is always Simple before 2.14.3 (NCCL_P2P_LL_THRESHOLD)
    one_ppn_inter_lat_from_tree=False,
    plateau_per_channel_rank=False,
    plateau={"volta": 1.9, "ampere": 1.9, "hopper": 1.9},
    ring_ll_factor_one_node_rs_ag=1 / 3,
    ampere_bus_cap=235e9,
    nvls_efficiency_hopper=0.0,
    pat=False,
)

NCCL_2_28 = NcclTuning(
    version="2.28.9-1",
    commit="dbc86fd06e8b0c4517b95d8958a09ccacf9520c9",
    base_lat={
        TREE: (6.8, 14.0, 8.4),
        RING: (6.6, 14.0, 8.4),
        NVLS_TREE: (0.0, 0.0, 0.0),
        PAT: (8.0, 8.0, 8.0),
    },
    hw_lat={
        NVLINK: {
            TREE: (0.6, 1.25, 4.0),
            RING: (0.6, 1.9, 3.4),
            NVLS_TREE: (0.0, 0.0, 25.0),
            PAT: (0.0, 0.0, 4.0),
        },
        NET: {
            TREE: (5.0, 8.5, 14.0),
            RING: (2.7, 4.0, 14.0),
            NVLS_TREE: (0.0, 0.0, 20.9),
            PAT: (0.0, 0.0, 14.0),
        },
    },
    ll_max_bw={
        "volta": (39.0, 39.0, 20.4),
        "ampere": (87.7, 22.5, 19.0),
        "hopper": (141.0, 45.0, 35.0),
    },
    per_ch_max_tree={
        "volta": (26.5, 18.5, 10.0),
        "ampere": (24.0, 23.6, 17.8),
        "hopper": (38.7, 41.4, 36.0),
    },
    per_ch_max_ring_ll128={
        "volta": (20.0, 20.0, 20.0),
        "ampere": (20.0, 20.0, 20.0),
        "hopper": (36.7, 36.7, 36.7),
    },
    per_ch_max_tree_ll128={
        "volta": (20.0, 20.0, 20.0),
        "ampere": (20.0, 20.0, 20.0),
        "hopper": (36.7, 36.7, 29.0),
    },
    per_ch_max_nvls_tree={"hopper": (0.0, 57.7, 45.5)},
    tree_correction=_TREE_CORRECTION,
    ring_ll_factor=1 / 2,
    ring_ll128_factor_one_ppn=0.92,
    ll_intra_lat_multinode=1.0,
    net_overhead_us={INTEL: 1.0, AMD: 2.0, OTHER_CPU: 1.0},
    p2p_ll_threshold=16384,  # src/enqueue.cc, NCCL_P2P_LL_THRESHOLD
    one_ppn_inter_lat_from_tree=True,
    plateau_per_channel_rank=True,
    plateau={"volta": 1.9, "ampere": 1.4, "hopper": 1.4},
    ring_ll_factor_one_node_rs_ag=1 / 2,
    ampere_bus_cap=0.0,
    nvls_efficiency_hopper=0.85,
    pat=True,
)


# By version, for callers that cache by it (NcclTuning holds dicts: not hashable).
TUNINGS = {t.version: t for t in (NCCL_2_11, NCCL_2_28)}


@dataclass(frozen=True)
class Fabric:
    """What NCCL's topology search would find, as bus bandwidths in bytes/s."""

    arch: str  # volta, ampere, hopper
    ranks_per_node: int
    intra: float  # allreduce bus bandwidth inside a node (NVLink)
    inter: float  # payload bandwidth of all of a node's NICs together, per direction
    channels: int  # NCCL channels (rings / trees) per communicator
    nvls: bool = False  # NVLink SHARP (NVSwitch multicast), Hopper HGX
    nvls_channels: int = 0  # NVLS tree heads: one per NIC
    cpu: str = INTEL  # the hosts' CPU vendor (INTEL for unknown: NCCL's faster figures)


@dataclass(frozen=True)
class AlgoTime:
    algorithm: str
    protocol: str
    seconds: float
    latency_s: float
    algbw: float  # bytes/s


def collective_times(
    tuning: NcclTuning, fabric: Fabric, nodes: int, nbytes: int, coll: str = ALLREDUCE
) -> list[AlgoTime]:
    """NCCL's predicted time of every (algorithm, protocol) it would consider."""
    ppn = fabric.ranks_per_node
    ranks = nodes * ppn
    if ranks <= 1:
        return [AlgoTime(RING, "Simple", 0.0, 0.0, math.inf)]
    algorithms = [RING]
    if coll != ALLREDUCE and tuning.pat and ppn == 1 and nodes > 1:
        algorithms.append(PAT)
    if coll == ALLREDUCE:
        algorithms.append(TREE)
        if fabric.nvls and nodes > 1 and tuning.nvls_efficiency_hopper > 0 and ppn > 1:
            algorithms.append(NVLS_TREE)
    times = []
    for algorithm in algorithms:
        protocols = (SIMPLE,) if algorithm in (NVLS_TREE, PAT) else (LL, LL128, SIMPLE)
        for p in protocols:
            bw = _algbw(tuning, fabric, nodes, algorithm, p, coll, nbytes)
            lat = _latency(tuning, fabric, nodes, algorithm, p, coll, nbytes)
            if bw <= 0:
                continue
            times.append(AlgoTime(algorithm, PROTOCOLS[p], lat + nbytes / bw, lat, bw))
    return times


def best(times: list[AlgoTime], algorithms: tuple[str, ...] | None = None) -> AlgoTime:
    """What NCCL would run: the fastest of ``times`` (among ``algorithms``)."""
    chosen = [t for t in times if algorithms is None or t.algorithm in algorithms]
    return min(chosen, key=lambda t: t.seconds)


def _index2(nodes: int) -> int:
    return 0 if nodes == 1 else 1 if nodes == 2 else 2


def ll_max_bw(tuning: NcclTuning, fabric: Fabric, nodes: int) -> float:
    """llMaxBw (bytes/s): by GPU generation on one node, by CPU vendor across nodes."""
    row = fabric.arch if nodes == 1 else "ampere" if fabric.cpu == AMD else "volta"
    return tuning.ll_max_bw.get(row, tuning.ll_max_bw["volta"])[_index2(nodes)] * 1e9


def net_overhead_s(tuning: NcclTuning, cpu: str, protocol: int) -> float:
    """NCCL's cost of posting one network step (getNetOverhead, x3 for Simple)."""
    vendor = cpu if cpu in tuning.net_overhead_us else INTEL
    return tuning.net_overhead_us[vendor] * (3 if protocol == SIMPLE else 1) * 1e-6


def tree_correction(tuning: NcclTuning, protocol: int, nbytes: int) -> float:
    """treeCorrectionFactor: the tree's efficiency by size, 1 outside the table."""
    log_size = int(math.log2(nbytes >> 6)) if nbytes >= 64 else -1
    table = tuning.tree_correction[protocol]
    return table[log_size] if 0 <= log_size < len(table) else 1.0


def _bus_bandwidth(fabric: Fabric, nodes: int, algorithm: str) -> float:
    """Bytes/s of a node's links for this algorithm, in NCCL's bus-bandwidth convention.

    A ring, and a tree of more than two nodes, move about twice the tensor through each
    node's NICs; a tree of two nodes moves it once (each node is the other's child), so
    its bus bandwidth can be twice the NICs'. Inside a node both are NVLink-bound."""
    if nodes == 1:
        return fabric.intra
    if algorithm == TREE and nodes == 2:
        return min(fabric.intra, 2 * fabric.inter)
    return min(fabric.intra, fabric.inter)


def _algbw(
    t: NcclTuning, f: Fabric, nodes: int, algorithm: str, p: int, coll: str, nbytes: int
) -> float:
    ranks = nodes * f.ranks_per_node
    ch = f.channels
    i2 = _index2(nodes)
    ll_max = ll_max_bw(t, f, nodes)
    arch = f.arch if f.arch in t.per_ch_max_tree else "ampere"
    if algorithm == NVLS_TREE:
        intra = 2 * t.nvls_efficiency_hopper * f.intra * (f.nvls_channels - 1) / f.nvls_channels
        inter = f.inter * (2 if nodes <= 2 else 1)
        cap = f.nvls_channels * t.per_ch_max_nvls_tree["hopper"][i2] * 1e9
        bus = min(intra, inter, cap)
        return bus * ranks / (2 * (ranks - 1))
    bus = _bus_bandwidth(f, nodes, algorithm)
    if algorithm == PAT:
        return bus * 0.75  # no bus-to-algorithm conversion for PAT's all-gather
    if t.ampere_bus_cap and f.arch == "ampere":
        bus = min(bus, t.ampere_bus_cap)
    if algorithm == RING:
        if p == LL:
            one_node_rs_ag = nodes == 1 and coll != ALLREDUCE
            factor = t.ring_ll_factor_one_node_rs_ag if one_node_rs_ag else t.ring_ll_factor
            bus = min(ll_max, bus * factor)
        elif p == LL128:
            factor = t.ring_ll128_factor_one_ppn if f.ranks_per_node < 2 else 0.92
            bus = min(bus * factor, ch * t.per_ch_max_ring_ll128[arch][i2] * 1e9)
        steps = 2 * (ranks - 1) if coll == ALLREDUCE else ranks - 1
        return bus * ranks / steps
    bus = min(bus * 0.92, ch * t.per_ch_max_tree[arch][i2] * 1e9)
    if p == LL:
        bus = min(bus / 3.8, ll_max)
    elif p == LL128:
        bus = min(
            bus * (7 / 9 if nodes == 1 else 120 / 128),
            ch * t.per_ch_max_tree_ll128[arch][i2] * 1e9,
        )
    return bus * tree_correction(t, p, nbytes) * 0.5


def _latency(
    t: NcclTuning, f: Fabric, nodes: int, algorithm: str, p: int, coll: str, nbytes: int
) -> float:
    """Seconds."""
    ppn = f.ranks_per_node
    ranks = nodes * ppn
    intra = t.hw_lat[NVLINK][algorithm][p]
    if nodes > 1 and p == LL:
        intra *= t.ll_intra_lat_multinode
    net_algo = TREE if (ppn == 1 and t.one_ppn_inter_lat_from_tree) else algorithm
    inter = t.hw_lat[NET][net_algo][p]
    lat = t.base_lat[algorithm][p]
    if algorithm == RING:
        steps = 2 * (ranks - 1) if coll == ALLREDUCE else ranks - 1
        inter_steps = 0 if nodes == 1 else (2 * (nodes - 1) if coll == ALLREDUCE else nodes - 1)
        if nodes > 1:
            intra = max(intra, net_overhead_s(t, f.cpu, p) * 1e6)
        lat += (steps - inter_steps) * intra + inter_steps * inter
        if p == SIMPLE and nodes > 1 and coll == ALLREDUCE:
            plateau = (
                nbytes / (f.channels * ranks) >= 64
                if t.plateau_per_channel_rank
                else nbytes >= ranks / 16 * 65536
            )
            if plateau:
                lat *= t.plateau[f.arch]
    elif algorithm == TREE:
        lat += 2 * ((ppn - 1) * intra + _log2i(nodes) * inter)
    elif algorithm == PAT:
        lat += _log2i(nodes) * (inter / 3.5) + ranks * 2.8
    else:  # NVLS tree
        lat += intra + 2 * _log2i(nodes) * inter
    return lat * 1e-6


def _log2i(n: int) -> int:
    return n.bit_length() - 1
