"""NCCL's side of the cost model (fairring_pg.model.nccl): its tuning terms with exact
values from known inputs, and its predictions for one 25 MiB allreduce pinned per node
type.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from test_model import A100, S25

from fairring_pg.config import MIB
from fairring_pg.model import nccl
from fairring_pg.model.alltoall import MessageEfficiency
from fairring_pg.model.composition import (
    FAIRRING_PG,
    piece_stages,
)
from fairring_pg.model.gpu import predict_gpu
from fairring_pg.model.nodes import NODE_TYPES

# --- NCCL's tuning terms ----------------------------------------------------------


def _v100() -> nccl.Fabric:
    return nccl.Fabric("volta", 8, 130e9, 47e9, channels=8)


def _time(times: list[nccl.AlgoTime], algorithm: str, protocol: str) -> nccl.AlgoTime:
    (found,) = [t for t in times if (t.algorithm, t.protocol) == (algorithm, protocol)]
    return found


def test_nccl_2_11_ring_simple() -> None:
    size = 100 * MIB
    t = _time(nccl.collective_times(nccl.NCCL_2_11, _v100(), 8, size), "ring", "Simple")
    # baseLat 8.4 + 112 NVLink steps x 3.4 + 14 network steps x 9.6, x1.9 past the plateau
    latency = (8.4 + 112 * 3.4 + 14 * 9.6) * 1.9e-6
    algbw = 47e9 * 64 / 126  # min(NVLink, NICs), bus to algorithm bandwidth
    assert t.latency_s == pytest.approx(latency, rel=1e-9)
    assert t.seconds == pytest.approx(latency + size / algbw, rel=1e-9)


def test_nccl_2_28_tree_ll128() -> None:
    f = nccl.Fabric("hopper", 8, 370e9, 376e9, channels=16)
    size = 1 << 24  # log2(size / 64) = 18: LL128's tree correction is 0.9
    t = _time(nccl.collective_times(nccl.NCCL_2_28, f, 8, size), "tree", "LL128")
    assert t.latency_s == pytest.approx((14.0 + 2 * (7 * 1.25 + 3 * 8.5)) * 1e-6, rel=1e-9)
    bus = min(0.92 * 370e9, 16 * 36.0e9)  # x0.92, capped by 16 channels x 36 GB/s (N4)
    bus = min(bus * 120 / 128, 16 * 29.0e9)  # LL128
    assert t.algbw == pytest.approx(bus * 0.9 * 0.5, rel=1e-9)


def test_nvls_tree_matches_published_2x8_h100() -> None:
    # 2 x 8 H100 allreduce bus bandwidth is published at about 435-470 GB/s
    size = 1 << 30
    fabric = nccl.Fabric("hopper", 8, 370e9, 376e9, channels=16, nvls=True, nvls_channels=8)
    best = nccl.best(nccl.collective_times(nccl.NCCL_2_28, fabric, 2, size))
    busbw = 2 * 15 / 16 * size / best.seconds
    assert best.algorithm == "nvls tree"
    assert 435e9 <= busbw <= 470e9


def test_pat_only_for_one_gpu_per_node() -> None:
    rail = nccl.Fabric("hopper", 1, 370e9, 47e9, channels=16)
    for tuning, algorithms in ((nccl.NCCL_2_28, {"ring", "pat"}), (nccl.NCCL_2_11, {"ring"})):
        times = nccl.collective_times(tuning, rail, 16, MIB, "all-gather")
        assert {t.algorithm for t in times} == algorithms


def test_nccl_counts_the_hosts_cpu_vendor() -> None:
    # Across nodes NCCL 2.28 floors each NVLink step of a ring at its network overhead
    # (1 us on Intel, 2 on AMD, x3 for Simple) and takes llMaxBw's AMD row on AMD hosts.
    size = 100 * MIB
    for cpu, step_us, ll_n4 in (("intel", 3.4, 20.4), ("amd", 6.0, 19.0), ("other", 3.4, 20.4)):
        fabric = nccl.Fabric("ampere", 8, 230e9, 94e9, channels=16, cpu=cpu)
        t = _time(nccl.collective_times(nccl.NCCL_2_28, fabric, 2, size), "ring", "Simple")
        # 30 steps over 16 ranks, 2 of them across the network (14 us), past the plateau
        assert t.latency_s == pytest.approx((8.4 + 28 * step_us + 2 * 14.0) * 1.4e-6, rel=1e-9)
        ll = _time(nccl.collective_times(nccl.NCCL_2_28, fabric, 4, size), "ring", "LL")
        assert ll.algbw == pytest.approx(ll_n4 * 1e9 * 32 / 62, rel=1e-9)  # capped


def test_the_rail_all_to_all_is_charged_as_nccl_charges_its_own() -> None:
    # A piece of 1 MiB on 16 A100 machines (AMD hosts): messages of 1 MiB / 8 / 16 = 8 KiB,
    # under NCCL's 16 KiB threshold, so LL: the ring's LL latency with the tree's network
    # step (6.6 + 5.0 us), half the rail's 94/8 GB/s (llMaxBw's AMD N4 row, 19 GB/s, does
    # not cap it) at treeCorrectionFactor[LL][log2(8 KiB / 64) = 7] = 0.7, and 30 messages
    # posted at NCCL's 2 us (AMD, LL: no x3).
    tuning = nccl.NCCL_2_28
    stages = piece_stages(A100, 16, MIB, "alltoall", 0, tuning, FAIRRING_PG).stages
    collect = stages[1]
    assert collect.latency == pytest.approx(11.6e-6, rel=1e-12)
    assert collect.busy["nic"] == pytest.approx(15 / 16 * MIB / 94e9 / (0.5 * 0.7), rel=1e-12)
    assert collect.busy["proxy of lane 0"] == pytest.approx(30 * 2e-6, rel=1e-12)
    # An Intel host posts each at 1 us; an unknown vendor pays AMD's.
    for cpu, per_message in (("intel", 1e-6), ("unknown", 2e-6)):
        node = dataclasses.replace(A100, cpu=cpu)
        other = piece_stages(node, 16, MIB, "alltoall", 0, tuning, FAIRRING_PG).stages[1]
        assert other.busy["proxy of lane 0"] == pytest.approx(30 * per_message, rel=1e-12)
    # H100 + 8 x 400G: half of a rail's 376/8 GB/s is over llMaxBw's Intel N4 cap, 20.4.
    h100 = NODE_TYPES["h100-8x400g"]
    capped = piece_stages(h100, 16, MIB, "alltoall", 0, tuning, FAIRRING_PG).stages[1]
    share = 20.4e9 / (376e9 / 8) * 0.7
    assert capped.busy["nic"] == pytest.approx(15 / 16 * MIB / 376e9 / share, rel=1e-12)
    # A measured efficiency replaces NCCL's figures by message size.
    measured = dataclasses.replace(
        FAIRRING_PG, alltoall_efficiency=MessageEfficiency(((0, 0.4), (16 << 10, 0.8)))
    )
    for piece, share in ((MIB, 0.4), (4 * MIB, 0.8)):
        hop = piece_stages(A100, 16, piece, "alltoall", 0, tuning, measured).stages[1]
        assert hop.busy["nic"] == pytest.approx(15 / 16 * piece / 94e9 / share, rel=1e-12)
    with pytest.raises(ValueError, match="ascend"):
        MessageEfficiency(((16, 0.5), (0, 0.4)))


# --- GPU: NCCL's side, pinned ------------------------------------------------------

# NCCL 2.28's predictions for one 25 MiB allreduce on the three node types of issue 34,
# written out from the constants of its src/graph/tuning.cc: fairring's gains may only
# come from fairring's side, so these move only with a source.
_LL128_CORRECTION_25M = 0.9  # treeCorrectionFactor[LL128][log2(25 MiB / 64) = 18]


def _nvls_tree_us(nics: int, nic_gbps: float, machines: int) -> float:
    inter = nics * nic_gbps / 8 * 0.94  # GB/s of payload per machine
    intra = 2 * 0.85 * 370 * (nics - 1) / nics  # NVLS on NVLink, one head per NIC
    cap = nics * (57.7 if machines == 2 else 45.5)  # perChMaxNVLSTreeBw, N2 / N4
    bus = min(intra, inter * (2 if machines == 2 else 1), cap)
    n = 8 * machines
    latency = 25 + 2 * math.log2(machines) * 20.9
    return latency + S25 / (bus * n / (2 * (n - 1))) / 1e3


def _tree_ll128_us(intra: float, inter: float, machines: int, per_ch: float) -> float:
    bus = min(intra, 2 * inter if machines == 2 else inter) * 0.92  # GB/s
    bus = min(bus, 16 * per_ch)  # perChMaxTreeBw x 16 channels: not reached here
    bus = min(bus * 120 / 128, 16 * 20.0) * _LL128_CORRECTION_25M
    latency = 14 + 2 * (7 * 1.25 + math.log2(machines) * 8.5)
    return latency + S25 / (bus * 0.5) / 1e3


@pytest.mark.parametrize(
    ("node", "machines", "algorithm", "expected_us"),
    [
        ("h100-8x400g", 2, "nvls tree/Simple", _nvls_tree_us(8, 400, 2)),
        ("h100-8x400g", 16, "tree/LL128", _tree_ll128_us(370, 376, 16, 36.0)),
        ("h100-8x400g", 128, "tree/LL128", _tree_ll128_us(370, 376, 128, 36.0)),
        ("h100-2x200g", 2, "nvls tree/Simple", _nvls_tree_us(2, 200, 2)),
        ("h100-2x200g", 16, "nvls tree/Simple", _nvls_tree_us(2, 200, 16)),
        ("h100-2x200g", 128, "nvls tree/Simple", _nvls_tree_us(2, 200, 128)),
        ("a100-4x200g", 2, "tree/LL128", _tree_ll128_us(230, 94, 2, 23.6)),
        ("a100-4x200g", 16, "tree/LL128", _tree_ll128_us(230, 94, 16, 17.8)),
        ("a100-4x200g", 128, "tree/LL128", _tree_ll128_us(230, 94, 128, 17.8)),
    ],
)
def test_nccl_side_is_pinned(node: str, machines: int, algorithm: str, expected_us: float) -> None:
    p = predict_gpu(NODE_TYPES[node], machines, S25)
    assert f"{p.chosen.algorithm}/{p.chosen.protocol}" == algorithm
    assert p.nccl_s == pytest.approx(expected_us * 1e-6, rel=1e-9)
