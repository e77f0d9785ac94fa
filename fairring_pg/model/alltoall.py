"""The rail all-to-all as NCCL runs it, charged as NCCL charges its own algorithms.

fairring's rail exchange is NCCL's grouped send/recv: one message of s bytes (my shard
of a piece) to each of the other M-1 ranks of my rail, and one from each. NCCL's tuning
model (src/graph/tuning.cc) has no all-to-all, so each of its terms is taken from what
NCCL charges its own collectives, by message (NCCL 2.28.9, commit dbc86fd):

- protocol: LL for messages up to NCCL_P2P_LL_THRESHOLD (16 KiB per channel, one
  channel per peer taken), else Simple (src/enqueue.cc, addP2pToPlan; NCCL 2.11's
  send/recv is always Simple);
- a hop's latency: the ring's base latency and one network step of that protocol
  (baseLatencies, hwLatencies; with one GPU per node NCCL takes the tree's network
  latency, as here);
- payload rate: the rail's share of the NICs x the protocol's factor in NCCL's ring (LL:
  x1/2, capped by llMaxBw; Simple: x1) x ``treeCorrectionFactor[protocol][log2(s/64)]``,
  the efficiency by size NCCL applies to its tree ("Trees are not perfectly sticking to
  the model for medium sizes"), indexed by the bytes one rank sends one peer, as the
  tree's is by the bytes one rank sends its parent;
- the proxy's time per message posted: ``getNetOverhead`` (1 us on Intel hosts, 2 on
  AMD) x3 for Simple, x1 for LL, the floor NCCL puts under each step of a ring across
  nodes. With the vendor unknown, AMD's (the dearer for fairring).

A GPU measurement replaces the last two (fairring_pg.model.constants).
"""

from __future__ import annotations

from dataclasses import dataclass

from fairring_pg.model import nccl


def protocol(tuning: nccl.NcclTuning, message: int) -> int:
    """NCCL's protocol for a send/recv of ``message`` bytes."""
    return nccl.LL if 0 < message <= tuning.p2p_ll_threshold else nccl.SIMPLE


def hop_latency_s(tuning: nccl.NcclTuning, message: int) -> float:
    """One all-to-all hop's fixed time: a collective's base and one network step."""
    p = protocol(tuning, message)
    net = nccl.TREE if tuning.one_ppn_inter_lat_from_tree else nccl.RING
    return (tuning.base_lat[nccl.RING][p] + tuning.hw_lat[nccl.NET][net][p]) * 1e-6


def message_cost_s(cpu: str, message: int) -> float:
    """NCCL's own cost of posting one message (2.28's getNetOverhead, whatever tuning
    the rest of the model takes: 2.11 states none); an unknown vendor pays AMD's."""
    tuning = nccl.NCCL_2_28
    vendor = cpu if cpu in nccl.CPU_VENDORS else nccl.AMD
    return nccl.net_overhead_s(tuning, vendor, protocol(tuning, message))


def nccl_efficiency(tuning: nccl.NcclTuning, rail: nccl.Fabric, nodes: int, message: int) -> float:
    """The share of the rail's NIC rate a message of ``message`` bytes gets, by NCCL's
    own protocol factor and size efficiency."""
    p = protocol(tuning, message)
    share = 1.0
    if p == nccl.LL:
        capped = min(nccl.ll_max_bw(tuning, rail, nodes), rail.inter * tuning.ring_ll_factor)
        share = capped / rail.inter
    return share * nccl.tree_correction(tuning, p, message)


@dataclass(frozen=True)
class MessageEfficiency:
    """The all-to-all's payload rate as a share of the NICs', by message size.

    ``measured``: (from message bytes, share) rows, ascending, from a GPU run; empty:
    NCCL's own figures (``nccl_efficiency``). ``scale`` multiplies either (fairring-plan
    varies it to find where a verdict turns)."""

    measured: tuple[tuple[int, float], ...] = ()
    scale: float = 1.0

    def __post_init__(self) -> None:
        starts = [start for start, _ in self.measured]
        if starts != sorted(set(starts)) or any(not 0 < s <= 1 for _, s in self.measured):
            raise ValueError(f"MessageEfficiency: rows must ascend, shares in (0, 1]: {self}")
        if self.scale <= 0:
            raise ValueError(f"MessageEfficiency: scale must be positive, got {self.scale}")

    def at(self, tuning: nccl.NcclTuning, rail: nccl.Fabric, nodes: int, message: int) -> float:
        if not self.measured:
            return self.scale * nccl_efficiency(tuning, rail, nodes, message)
        share = self.measured[0][1]
        for start, value in self.measured:
            if start <= message:
                share = value
        return self.scale * share
