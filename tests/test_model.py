"""The cost model (fairring_pg.model) and fairring-plan: formulas with exact values from
known inputs, NCCL's tuning terms, the Fairring seed's published shape, the command line.

No timing here: the model is validated against the netns cluster by
bench/model_validation.py; these tests use fixed primitives.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from fairring_pg.config import MIB, Config
from fairring_pg.model import calibration, nccl, prefer_fairring, seed
from fairring_pg.model.alltoall import MessageEfficiency
from fairring_pg.model.composition import (
    FAIRRING_PG,
    Unit,
    cut_pieces,
    issue_order,
    piece_stages,
    world_fabric,
)
from fairring_pg.model.cpu import CpuCluster, gloo_time, predict_cpu, segment_size
from fairring_pg.model.cuda_plan import (
    _GRID,
    COMPOSE_MARGIN,
    CudaPlan,
    PlanRow,
    composed_seconds,
    plan_allreduce,
)
from fairring_pg.model.gpu import predict_gpu
from fairring_pg.model.nodes import NODE_TYPES, V100_4X100G, GpuNode
from fairring_pg.model.pipeline import Piece, Stage, flow_time, schedule
from fairring_pg.model.sensitivity import nearest, turning_points
from fairring_pg.model.units import parse_rate, parse_size
from fairring_pg.tools import plan_command as plan

REPO = Path(__file__).resolve().parent.parent

# Round primitives: 1 GB/s copies and adds, free messages and TCP, cores to spare.
ROUND = calibration.Primitives(
    copy_bytes_per_s=1e9,
    reduce_bytes_per_s=1e9,
    message_s=0.0,
    tcp_cpu_s_per_byte=0.0,
    cores=64,
    link_efficiency={"800mbit": 0.9},
)


# --- units ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("1gbit", 125e6),
        ("300mbit", 37.5e6),
        ("400gbit", 50e9),
        ("12mbps", 12e6),  # tc: bps is bytes per second
        ("370GB/s", 370e9),
        ("25Gbit/s", 25e9 / 8),
        ("2GiB/s", 2 * 1024**3),
    ],
)
def test_rates(text: str, bytes_per_s: float) -> None:
    assert parse_rate("--nic", text) == pytest.approx(bytes_per_s, rel=1e-12)


@pytest.mark.parametrize("text", ["fast", "370Gb/s", "-1gbit", "0mbit", ""])
def test_bad_rates_name_the_option(text: str) -> None:
    with pytest.raises(ValueError, match="--link"):
        parse_rate("--link", text)


def test_sizes_as_fairring_variables() -> None:
    assert parse_size("--size", "25M") == 25 * MIB
    assert parse_size("--size", "1.5K") == 1536
    with pytest.raises(ValueError, match="--size"):
        parse_size("--size", "25 parsecs")


# --- the pipeline bound -----------------------------------------------------------


def test_one_piece_is_its_critical_path() -> None:
    # collect, reduce, diffuse: the link idles while the one piece is reduced
    piece = Piece(
        (
            Stage("collect", {"link": 3.0}),
            Stage("reduce", {"cpu": 2.0}),
            Stage("diffuse", {"link": 3.0}),
        )
    )
    t = flow_time([piece])
    assert (t.seconds, t.bottleneck) == (8.0, "critical path")
    # with two pieces the second's collect fills that gap: 2 x 6 s of link
    assert flow_time([piece] * 2).seconds == 12.0


def test_many_pieces_fill_load_drain() -> None:
    piece = Piece(
        (
            Stage("rs", {"cpu": 1.0}),
            Stage("net", {"link": 3.0}, latency=0.5),
            Stage("ag", {"cpu": 1.0}),
        )
    )
    t = flow_time([piece] * 4)
    # link: 4 x 3 = 12 s, reached after rs + latency (1.5 s), left before ag (1 s)
    assert (t.bottleneck, t.fill, t.drain) == ("link", 1.5, 1.0)
    assert t.seconds == 14.5
    assert t.loads == {"cpu": 8.0, "link": 12.0}


def test_window_has_no_fill_or_drain() -> None:
    piece = Piece((Stage("rs", {"cpu": 1.0}), Stage("net", {"link": 3.0})))
    t = flow_time([piece] * 2, {"slots": 20.0})
    assert (t.seconds, t.bottleneck, t.fill, t.drain) == (20.0, "slots", 0.0, 0.0)
    assert flow_time([]).seconds == 0.0


def test_bound_holds_for_every_resource_not_only_the_busiest() -> None:
    # cpu is the busiest (10 s), used from the start to the end; the link carries 9 s
    # after 1 s of fill and before 3 s of drain: no schedule beats 13 s.
    piece = Piece(
        (
            Stage("before", {"cpu": 1.0}),
            Stage("wire", {"link": 4.5, "cpu": 1.0}),
            Stage("after", {"cpu": 3.0}),
        )
    )
    t = flow_time([piece] * 2)
    assert t.loads == {"cpu": 10.0, "link": 9.0}
    assert (t.seconds, t.bottleneck, t.fill, t.drain) == (13.0, "link", 1.0, 3.0)
    assert schedule([piece] * 2).seconds >= t.seconds


def test_schedule_streams_bandwidth_and_the_host() -> None:
    a = Stage("a", {"nic": 2.0}, latency=1.0, hold=("lane 0",), issue=0.5)
    b = Stage("b", {"nic": 2.0}, latency=1.0, hold=("lane 1",), issue=0.5)
    c = Stage("c", {"nvlink": 1.0}, hold=("local",), issue=0.5)
    # piece 0: a then c; piece 1: b then c, issued a, c, b, c. b starts once the host
    # has issued a and c (1 s); from 2 s a and b share the NIC, so a's last 1 s of work
    # takes 2 s and b's 2 s end at 5 s. Piece 0's c runs 4-5 s; piece 1's waits for b
    # and for the local stream, 5-6 s.
    done = schedule([Piece((a, c)), Piece((b, c))])
    assert done.stages == (("a", 0.0, 4.0), ("c", 4.0, 5.0), ("b", 1.0, 5.0), ("c", 5.0, 6.0))
    assert done.seconds == 6.0
    # A transfer issued later uses the NIC while an earlier one waits out its latency.
    late = Stage("late", {"nic": 1.0}, latency=5.0)
    early = Stage("early", {"nic": 1.0}, latency=0.5)
    gaps = schedule([Piece((late,)), Piece((early,))])
    assert gaps.stages == (("late", 0.0, 6.0), ("early", 0.0, 1.5))
    # ... and shares it once the earlier one starts.
    long = Stage("long", {"nic": 6.0})
    split = schedule([Piece((late,)), Piece((long,))])
    assert split.stages == (("late", 0.0, 7.0), ("long", 0.0, 7.0))
    # A custom issue order: the host issues piece 1 first.
    order = schedule([Piece((a,)), Piece((b,))], order=[(1, 0), (0, 0)])
    assert order.stages == (("b", 0.0, 4.5), ("a", 0.5, 5.0))


def test_schedule_is_never_below_the_bound() -> None:
    rng = random.Random(34)
    resources = ("nic", "nvlink", "hbm")
    for _ in range(200):
        pieces = []
        for _ in range(rng.randint(1, 6)):
            stages = tuple(
                Stage(
                    f"s{k}",
                    {r: rng.uniform(0, 3) for r in rng.sample(resources, rng.randint(0, 2))},
                    latency=rng.choice((0.0, rng.uniform(0, 2))),
                    hold=tuple(rng.sample(("q0", "q1"), rng.randint(0, 1))),
                    issue=rng.choice((0.0, rng.uniform(0, 1))),
                )
                for k in range(rng.randint(1, 4))
            )
            pieces.append(Piece(stages))
        assert schedule(pieces).seconds >= flow_time(pieces).seconds - 1e-9


# --- CPU: fairring's engine and Gloo's ring -----------------------------------------


def test_segment_size_follows_slice_plan() -> None:
    # SlicePlan::fitSegment: L chunks, rounded down to a multiple of L*M elements
    assert segment_size(6553600, 262144, 2, 2) == 524288
    assert segment_size(6553600, 262144, 3, 2) == 786432
    assert segment_size(6553600, 262144, 3, 5) == 786420  # 262144 * 3 // 15 * 15
    assert segment_size(6553600, 262144, 4, 1) == 6553600  # one machine: one segment
    assert segment_size(100, 262144, 2, 2) == 100  # a slice smaller than a segment


def _cluster(machines: int, ranks: int) -> CpuCluster:
    return CpuCluster(machines, ranks, 1e8 / 0.9, 0.9)  # 1e8 B/s of payload


def test_one_rank_per_machine_goes_to_gloos_ring_from_1_mib() -> None:
    # FAIRRING_CPU_ALLREDUCE=auto: at one rank per machine an allreduce of 1 MiB or more
    # is Gloo's ring, so the model predicts Gloo's time for it; smaller ones, and every
    # one where machines have several ranks, are the engine's.
    for size in (MIB, 8 * MIB):
        p = predict_cpu(_cluster(4, 1), [size], ROUND)
        assert p.fairring == gloo_time(_cluster(4, 1), [size], ROUND)
    small = predict_cpu(_cluster(4, 1), [MIB - 4], ROUND)
    assert small.fairring != gloo_time(_cluster(4, 1), [MIB - 4], ROUND)
    engine = Config(cpu_allreduce="engine")
    assert predict_cpu(_cluster(4, 1), [8 * MIB], ROUND, engine).fairring.bottleneck == "link"
    assert predict_cpu(_cluster(2, 2), [8 * MIB], ROUND).fairring != gloo_time(
        _cluster(2, 2), [8 * MIB], ROUND
    )
    # A burst of both: no faster than the two one after the other.
    both = predict_cpu(_cluster(4, 1), [8 * MIB, 64 * 1024], ROUND).fairring_s
    assert both == pytest.approx(
        gloo_time(_cluster(4, 1), [8 * MIB], ROUND).seconds
        + predict_cpu(_cluster(4, 1), [64 * 1024], ROUND).fairring_s
    )


def test_one_rank_per_machine_sends_a_rings_bytes() -> None:
    # The engine's own figure (FAIRRING_CPU_ALLREDUCE=engine).
    size = 8 * MIB
    p = predict_cpu(_cluster(4, 1), [size], ROUND, Config(cpu_allreduce="engine"))
    # Both move 2(M-1)/M of the tensor through each machine's link, and nothing else
    # is slow enough to show: fairring's reductions overlap the wire.
    assert p.fairring_s == pytest.approx(1.5 * size / 1e8, rel=1e-12)
    assert p.reference_s == pytest.approx(1.5 * size / 1e8, rel=1e-12)
    assert (p.fairring.bottleneck, p.reference) == ("link", "gloo ring")


def test_two_by_two_exact() -> None:
    size = 8 * MIB
    p = predict_cpu(_cluster(2, 2), [size], ROUND)
    # fairring: the tensor once through the link (2(M-1)/M = 1), after the first 2 MiB
    # segment's reduce-scatter (read and add 1 MiB) and before the last one's
    # all-gather (read 1 MiB), at 1 GB/s each.
    assert p.fairring_s == pytest.approx(size / 1e8 + 3 * MIB / 1e9, rel=1e-12)
    # Gloo: a ring of 4 ranks crosses each link once per direction: 2(N-1)/N = 1.5
    assert p.reference_s == pytest.approx(1.5 * size / 1e8, rel=1e-12)
    assert p.speedup == pytest.approx(1.5 * size / 1e8 / p.fairring_s, rel=1e-12)
    assert prefer_fairring(p) and not prefer_fairring(p, margin=0.5)


def test_burst_is_link_bound_and_slots_bound_nothing_here() -> None:
    size = 25 * MIB
    p = predict_cpu(_cluster(2, 3), [size] * 16, ROUND)
    assert p.fairring.bottleneck == "link"
    assert p.fairring.loads["link"] == pytest.approx(16 * size / 1e8, rel=1e-12)
    assert p.gloo.loads["link"] == pytest.approx(16 * 2 * 5 / 6 * size / 1e8, rel=1e-12)


def test_slots_bound_when_memory_holds_one() -> None:
    size = 25 * MIB
    one_slot = Config(total_memory=13 * MIB, slice_size=25 * MIB)  # 2x2 slot: 18.75 MiB
    with pytest.raises(ValueError):
        one_slot.check_staging_fits(2, 2)
    small = Config(slice_size=4 * MIB, total_memory=4 * MIB)  # one 3 MiB slot
    p = predict_cpu(_cluster(2, 2), [size] * 4, ROUND, small)
    # Each call: six 4 MiB slices of two 2 MiB segments and one 1 MiB slice, each holding
    # the slot for its own time. A 4 MiB slice: the link's 4 x 1 MiB at 1e8 B/s, after
    # the first segment's reduce-scatter (read and add 1 MiB at 1e9) and before the last
    # one's all-gather (read 1 MiB); the 1 MiB slice: its one segment's steps in a row
    # (reduce-scatter 1 MiB, collect and diffuse 0.5 MiB each on the link, reduce 0.25,
    # all-gather 0.5 MiB).
    four_mib = 4 * MIB / 1e8 + 3 * MIB / 1e9
    one_mib = MIB / 1e8 + 1.75 * MIB / 1e9
    assert p.fairring.bottleneck == "staging slots"
    assert p.fairring.seconds == pytest.approx(4 * (6 * four_mib + one_mib), rel=1e-12)
    assert p.fairring.loads["link"] == pytest.approx(4 * size / 1e8, rel=1e-12)


def test_cpu_contention_on_a_shared_host() -> None:
    cluster = CpuCluster(2, 3, None, shared_host=True)  # no link: CPU-bound
    few = calibration.Primitives(1e9, 1e9, 0.0, 1e-9, cores=2)
    shared = predict_cpu(cluster, [6 * MIB], few)
    alone = predict_cpu(CpuCluster(2, 3, None, shared_host=False), [6 * MIB], few)
    assert shared.fairring.bottleneck == "cpu"
    # 6 ranks on 2 cores against 3 (one machine's) on 2: twice as slow
    assert shared.fairring.loads["cpu"] == pytest.approx(2 * alone.fairring.loads["cpu"])


def test_one_machine_and_one_rank() -> None:
    assert predict_cpu(CpuCluster(1, 1, None), [MIB], ROUND).fairring_s == 0.0
    p = predict_cpu(CpuCluster(1, 2, None), [2 * MIB], ROUND)
    # reduce-scatter (read + add 1 MiB) and all-gather (read 1 MiB), one segment
    assert p.fairring_s == pytest.approx(3 * MIB / 1e9, rel=1e-12)


def test_bad_cluster() -> None:
    with pytest.raises(ValueError, match="at least one machine"):
        CpuCluster(0, 2, None)


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
S25 = 25 * MIB
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


# --- GPU: the composition -----------------------------------------------------------

A100 = NODE_TYPES["a100-4x200g"]
ONE_GPU = GpuNode("1 x H100 + 1 x 400G", 1, "hopper", 50e9, 1, 370e9, 3.35e12, 16)


def test_cut_pieces_even_whole_groups_and_a_direct_tail() -> None:
    # 1000 floats on 3 machines of 2: groups of 6 x 16 bytes (24 float32), so that every
    # chunk and shard starts 16 bytes apart: 41 of them and 16 elements left over
    units = cut_pieces(1000, 4, 4, 1 << 30, 2, 3)
    assert [(u.begin, u.numel, u.direct) for u in units] == [
        (0, 264, False),  # 11 groups: the first 41 mod 4 = 1 piece takes one more
        (264, 240, False),
        (504, 240, False),
        (744, 240, False),
        (984, 16, True),
    ]
    # No piece larger than the largest: 2 groups (192 of 240 bytes) make 21 pieces
    capped = cut_pieces(1000, 4, 4, 240, 2, 3)
    assert len([u for u in capped if not u.direct]) == 21
    assert max(u.numel for u in capped) == 48
    assert cut_pieces(23, 4, 4, 1 << 30, 2, 3) == [Unit(0, 23, True)]
    # float64: 2 elements make 16 bytes, so groups of 12
    assert cut_pieces(24, 8, 4, 1 << 30, 2, 3) == [Unit(0, 12, False), Unit(12, 12, False)]


def test_a_piece_moves_2_m_minus_1_over_m_through_the_nics() -> None:
    machines, piece = 4, 8 * MIB
    tuning = nccl.NCCL_2_28
    stages = piece_stages(A100, machines, piece, "alltoall", 1, tuning, FAIRRING_PG).stages
    names = [s.name for s in stages]
    assert names == ["reduce-scatter", "collect", "reduce", "diffuse", "all-gather"]
    rs, collect, reduce, diffuse, ag = stages
    # Each hop: (M-1)/M of the piece through the machine's NICs (94 GB/s of payload),
    # in messages of 8 MiB / 8 GPUs / 4 machines = 256 KiB, NCCL's Simple protocol (over
    # its 16 KiB LL threshold), at treeCorrectionFactor[Simple][log2(256 KiB / 64) = 12]
    assert collect.busy["nic"] == pytest.approx(0.75 * piece / 94e9 / 0.5, rel=1e-12)
    assert diffuse.busy == collect.busy
    # The all-to-all: NCCL's fixed cost and one network step (8.4 + 14 us); its proxy
    # posts 3 sends and 3 receives at NCCL's 2 us x 3 (Simple) per network step on the
    # A100 machine's AMD host
    assert collect.latency == pytest.approx(22.4e-6, rel=1e-12)
    assert collect.busy["proxy of lane 1"] == pytest.approx(6 * 6e-6, rel=1e-12)
    assert collect.hold == diffuse.hold == reduce.hold == ("lane 1",)
    # The reduction reads my 4 received copies and writes my shard M + 1 times
    chunk = piece / 8
    assert reduce.busy["hbm"] == pytest.approx(9 / 4 * chunk / 2.0e12, rel=1e-12)
    # The machine's steps are NCCL's reduce-scatter and all-gather over its 8 GPUs
    local = nccl.Fabric("ampere", 8, 230e9, 94e9, 16)
    for stage, coll in ((rs, "reduce-scatter"), (ag, "all-gather")):
        t = nccl.best(nccl.collective_times(tuning, local, 1, piece, coll))
        assert stage.latency + stage.busy["nvlink"] == pytest.approx(t.seconds, rel=1e-12)
    assert (rs.hold, ag.hold) == (("local reduce-scatter",), ("local all-gather",))
    # NCCL's reduce-scatter and all-gather on the rail instead: each NIC's share
    rail = nccl.Fabric("ampere", 1, 230e9, 94e9 / 8, 16)
    by_nccl = piece_stages(A100, machines, piece, "reduce_scatter", 0, tuning, FAIRRING_PG)
    for stage, coll in zip(by_nccl.stages[1:3], ("reduce-scatter", "all-gather"), strict=True):
        t = nccl.best(nccl.collective_times(tuning, rail, machines, piece // 8, coll))
        assert stage.latency + stage.busy["nic"] == pytest.approx(t.seconds, rel=1e-12)


def test_the_host_issues_a_wavefront() -> None:
    piece = piece_stages(A100, 4, 8 * MIB, "alltoall", 0, nccl.NCCL_2_28, FAIRRING_PG)
    order = issue_order([piece] * 3, 0, 3, wavefront=True)
    rail = [1, 2, 3]
    assert order == [
        (0, 0),
        (1, 0), *[(0, j) for j in rail],
        (2, 0), *[(1, j) for j in rail], (0, 4),
        *[(2, j) for j in rail], (1, 4),
        (2, 4),
    ]  # fmt: skip
    assert issue_order([piece] * 2, 0, 2, wavefront=False) == [
        (i, j) for i in range(2) for j in range(5)
    ]
    # A call's tail (one direct unit after its pieces) is issued before them.
    tail = Piece((Stage("NCCL allreduce"),))
    with_tail = issue_order([piece, tail], 0, 2, wavefront=True)
    assert with_tail == [(1, 0), *[(0, j) for j in range(5)]]


def test_one_rank_per_machine_is_nccls_allreduce() -> None:
    # FAIRRING_CUDA_ALLREDUCE=auto gives every allreduce to NCCL where machines have one
    # rank each (the composition would send a ring's bytes): predict exactly NCCL's time.
    for in_flight in (1, 4):
        p = predict_gpu(ONE_GPU, 4, S25, in_flight)
        assert p.direct and p.fairring_s == pytest.approx(p.nccl_s, rel=1e-12)
    forced = predict_gpu(ONE_GPU, 4, S25, config=Config(cuda_allreduce="lanes"))
    assert not forced.direct and forced.row.reason.startswith("FAIRRING_CUDA_ALLREDUCE=lanes")
    assert forced.fairring_s != pytest.approx(forced.nccl_s, rel=1e-3)


def test_plan_takes_nccls_allreduce_where_composing_cannot_win() -> None:
    config = Config()
    for node, machines, why in (
        (A100, 1, "one machine"),
        (ONE_GPU, 8, "one rank per machine"),
        (None, 8, "node facts unknown"),
    ):
        made = plan_allreduce(node, machines, config, local_size=8 if node is None else None)
        assert not made.composes and why in made.rows[0].reason
    direct = plan_allreduce(A100, 8, Config(cuda_allreduce="direct"))
    assert not direct.composes and len(direct.rows) == 1
    # Without FAIRRING_DIRECT_BELOW the model decides from 0; alike rows are one row.
    zero = plan_allreduce(A100, 8, Config(direct_below=0))
    assert zero.rows[0].from_bytes == 0 and zero.row_for(64).path == "nccl"
    assert all(not a.same_choice(b) for a, b in itertools.pairwise(zero.rows))
    lanes = plan_allreduce(A100, 8, Config(cuda_allreduce="lanes"))
    assert [r.path for r in lanes.rows] == ["nccl"] + ["compose"] * (len(lanes.rows) - 1)
    assert lanes.rows[1].from_bytes == config.direct_below


def _speedup(node: GpuNode, machines: int, size: int, pieces: int, exchange: str) -> float:
    """NCCL's time over a composed call's, computed here from the model's parts."""
    largest = Config().subgroup_slice_size(machines, node.gpus)
    theirs = nccl.best(nccl.collective_times(nccl.NCCL_2_28, world_fabric(node), machines, size))
    return theirs.seconds / composed_seconds(
        node, machines, size, pieces, exchange, largest, nccl.NCCL_2_28, FAIRRING_PG, 2
    )


@pytest.mark.parametrize(("node", "machines"), [("a100-4x200g", 4), ("h100-2x200g", 8)])
def test_plan_composes_only_where_predicted_faster_by_the_margin(node: str, machines: int) -> None:
    # Each size the plan decides at (FAIRRING_DIRECT_BELOW, then its grid), checked
    # against speedups computed here at both ends of its range (to the next size): where
    # the plan composes, its choice wins by the margin at both and the row says by how
    # much; where it runs NCCL's, the best composition at the size (every piece count,
    # either exchange) does not win by the margin at one end.
    gpu = NODE_TYPES[node]
    made = plan_allreduce(gpu, machines, Config())
    grid = [g for g in _GRID if g >= Config().direct_below]
    assert made.rows[0] == PlanRow(0, "nccl", reason=made.rows[0].reason)
    assert made.row_for(grid[0] - 1) == made.rows[0]
    for size, upper in zip(grid, grid[1:] + [grid[-1] + 1], strict=True):
        row = made.row_for(size)
        ends = (size, upper - 1)
        if row.path == "compose":
            speedups = [_speedup(gpu, machines, n, row.pieces, row.exchange) for n in ends]
            assert min(speedups) >= 1 + COMPOSE_MARGIN, (size, row, speedups)
            if row.from_bytes == size:
                assert f"predicted {min(speedups):.2f}x" in row.reason
            p = predict_gpu(gpu, machines, size)
            assert p.fairring_s < p.nccl_s / (1 + COMPOSE_MARGIN)
        else:
            choices = [
                (_speedup(gpu, machines, size, count, exchange), count, exchange)
                for count in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
                for exchange in ("alltoall", "reduce_scatter")
                if count == 1 or size // count >= 256 << 10
            ]
            best, count, exchange = max(choices)
            at_upper = _speedup(gpu, machines, upper - 1, count, exchange)
            assert min(best, at_upper) < 1 + COMPOSE_MARGIN, (size, row, best, at_upper)
            p = predict_gpu(gpu, machines, size)
            assert p.direct and p.fairring_s == pytest.approx(p.nccl_s, rel=1e-12)
    assert made.composes
    assert CudaPlan.from_json(made.to_json()) == made


def test_pieces_of_calls_in_flight_share_the_lanes() -> None:
    four = predict_gpu(A100, 4, S25, 4)
    one = predict_gpu(A100, 4, S25, 1)
    assert not one.direct and not four.direct
    assert one.fairring_s < four.fairring_s < 4 * one.fairring_s  # pieces of calls overlap
    assert four.fairring_s >= four.bound.seconds * (1 - 1e-12)


def test_lanes_hide_latency_and_share_the_nics() -> None:
    # A lane is a communicator: its pieces take turns, so a second lane hides the rail
    # exchange's latency behind the other's transfer. More lanes than that put more
    # pieces on the NICs at once, each slower, so the machine's all-gathers start later.
    def seconds(lanes: int) -> float:
        return composed_seconds(A100, 8, S25, 4, "alltoall", 0, nccl.NCCL_2_28, FAIRRING_PG, lanes)

    one, two, four, eight = (seconds(k) for k in (1, 2, 4, 8))
    assert one > two < four <= eight


def test_staging_too_small_is_an_error() -> None:
    with pytest.raises(ValueError, match="FAIRRING_TOTAL_MEMORY"):
        predict_gpu(A100, 8, S25, config=Config(total_memory=512))


# --- GPU: what the model predicts for 25 MiB (fairring-plan's table), pinned ------------

# Powers of two and two between (every M from 1 to 128 is checked in docs/design.md's
# command; CI's time is short).
MACHINES = (1, 2, 3, 4, 8, 16, 24, 32, 64, 128)
# Regression pins, not targets and not measurements: the model's own speedups (NCCL's
# time / fairring's, 25 MiB, NCCL 2.28, FAIRRING_* defaults) at the commit that set them,
# for (node, machines, in flight). They catch an unintended change of the model's
# figures in either direction; a deliberate change moves them, saying why. Every cell
# not listed runs NCCL's allreduce (the plan composes only on a predicted win of more
# than COMPOSE_MARGIN), so fairring's time is NCCL's there.
REGRESSION_PINS = {
    ("h100-2x200g", 3, 1): 1.29,
    ("h100-2x200g", 3, 4): 1.46,
    ("h100-2x200g", 4, 1): 1.18,
    ("h100-2x200g", 4, 4): 1.35,
    ("a100-4x200g", 3, 1): 1.22,
    ("a100-4x200g", 3, 4): 1.52,
    ("a100-4x200g", 4, 1): 1.22,
    ("a100-4x200g", 4, 4): 1.50,
}


@pytest.mark.parametrize("node", ["h100-8x400g", "h100-2x200g", "a100-4x200g"])
def test_predictions_are_pinned(node: str) -> None:
    for machines in MACHINES:
        for in_flight in (1, 4):
            p = predict_gpu(NODE_TYPES[node], machines, S25, in_flight)
            where = (node, machines, in_flight, p.speedup)
            pin = REGRESSION_PINS.get((node, machines, in_flight))
            if pin is None:
                assert p.direct and p.fairring_s == pytest.approx(p.nccl_s, rel=1e-12), where
            else:
                assert not p.direct and p.speedup == pytest.approx(pin, abs=0.005), where
            assert p.fairring_s >= p.bound.seconds * (1 - 1e-12)


@pytest.mark.parametrize("machines", [8, 16])
def test_in_flight_gains_are_below_the_byte_bound(machines: int) -> None:
    # H100 + 2 x 200G with 4 in flight: NCCL's NVLS tree moves 2(N-1)/N of each tensor
    # through the NICs at their rate, fairring 2(M-1)/M; with NCCL's latency on top no
    # composition can pass the ratio of the two times, under the 1.3 issue 34 asked.
    node = NODE_TYPES["h100-2x200g"]
    wire = 4 * 2 * (machines - 1) / machines * S25 / node.inter
    composed = predict_gpu(node, machines, S25, 4, Config(cuda_allreduce="lanes"))
    assert not composed.direct
    assert composed.speedup < composed.nccl_s / wire < 1.3


# --- the Fairring seed's shape (V100 + 4 x EDR, NCCL 2.11) -------------------------


def test_seed_single_allreduce_on_8_machines() -> None:
    # "for small tensors (up to ~6MiB) NCCL is faster ... at 100MiB, Fairring is faster"
    for mib in (1, 2, 4, 6):
        assert seed.predict(8, mib * MIB).speedup < 0.8
    at_100 = seed.predict(8, 100 * MIB).speedup
    assert 1.05 < at_100 < 1.6  # the seed measured 1.43


def test_seed_parallelism_on_64_gpus() -> None:
    # 64 x 25 MiB: more buckets in flight help up to a point, then ~50% faster than NCCL
    one = seed.predict(8, 25 * MIB, 64, lanes=1).speedup
    four = seed.predict(8, 25 * MIB, 64, lanes=4).speedup
    eight = seed.predict(8, 25 * MIB, 64, lanes=8).speedup
    assert one < 1.0 < four
    assert 1.3 < four < 1.7
    assert eight == pytest.approx(four, rel=0.05)


def test_seed_scaling_peaks_then_falls_behind_past_128_gpus() -> None:
    speedup = {m: seed.predict(m, 25 * MIB, 64).speedup for m in (2, 4, 8, 16, 32)}
    peak = max(speedup, key=lambda m: speedup[m])
    assert peak in (4, 8) and speedup[peak] >= 1.4  # the seed: about 2x at its peak
    assert speedup[2] > 1.0 and speedup[16] > 1.0  # ahead up to 128 GPUs
    assert speedup[32] < 1.0  # behind at 256 GPUs
    grown = seed.predict(32, 100 * MIB, 64, slice_size=100 * MIB)  # slice grows with M
    assert grown.speedup > 1.2
    assert grown.fairring.bottleneck == "nic"


@pytest.mark.parametrize(("message_us", "behind_at"), [(12.0, None), (26.0, 16)])
def test_seed_decline_comes_from_the_per_message_cost(message_us: float, behind_at: int) -> None:
    # the assumption the seed gives no number for: the decline past 128 GPUs holds for
    # 13-25 us per message; cheaper, fairring never falls behind; dearer, it does at 128
    behind = [
        m
        for m in (8, 16, 32)
        if seed.predict(m, 25 * MIB, 64, message_s=message_us * 1e-6).speedup < 1.0
    ]
    assert (behind[0] if behind else None) == behind_at


# --- calibration cache --------------------------------------------------------------


def test_calibration_is_measured_once_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibration, "measure_memory", lambda: calls.append("m") or (2e9, 3e9))
    monkeypatch.setattr(calibration, "measure_loopback", lambda: calls.append("l") or (1e-5, 1e-9))
    monkeypatch.setattr(
        calibration, "measure_link_efficiency", lambda rate: calls.append(rate) or 0.95
    )
    first = calibration.calibrate()
    assert calls == ["m", "l"] and first.copy_bytes_per_s == 2e9
    second = calibration.calibrate(links=("1gbit",))
    assert calls == ["m", "l", "1gbit"] and second.efficiency("1gbit") == 0.95
    third = calibration.calibrate(links=("1gbit",))
    assert calls == ["m", "l", "1gbit"] and third == second
    path = calibration.cache_path()
    assert path.is_relative_to(tmp_path) and json.loads(path.read_text())["key"]["torch"]
    with pytest.raises(KeyError, match="300mbit"):
        third.efficiency("300mbit")


# --- fairring-plan ----------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_gpu_table(capsys: pytest.CaptureFixture[str]) -> None:
    # A node described by its parts is the node type with those parts.
    args = plan.parse_args(
        "--gpus-per-machine 8 --nic 200gbit --nics-per-machine 4 --intra 230GB/s".split()
        + ["--arch", "ampere", "--cpu", "amd"]
    )
    assert dataclasses.replace(args.gpu_node, name=A100.name, sources=A100.sources) == A100
    code, out, _ = _run(capsys, *"--node a100-4x200g --machines 16 --in-flight 4".split())
    assert code == 0
    for m in (1, 2, 4, 8, 16, 32, 64, 128):
        p = predict_gpu(A100, m, S25, 4)
        line = next(x for x in out.splitlines() if x[3:12].strip() == str(m))
        assert f"{p.fairring_s * 1e3:.3f}" in line and f"{p.speedup:.2f}x" in line
        assert f"{p.nccl_ring_s * 1e3:.3f}" in line and f"{p.nccl_tree_s * 1e3:.3f}" in line
        pieces = [u for u in p.plan.units(S25) if not u.direct]
        runs = f"{len(pieces)} x " if pieces else "NCCL's allreduce"
        assert runs in line and ("same: NCCL's allreduce" in line) == p.direct
    assert "fairring does not lose in this range" in out and "assumptions:" in out
    assert "> " in next(x for x in out.splitlines() if x[3:12].strip() == "16")
    # Under the table, where each composed row turns (tests/test_sensitivity.py checks
    # the values), and nothing for the rows that run NCCL's allreduce.
    for m in (1, 2, 4, 8, 16, 32, 64, 128):
        p = predict_gpu(A100, m, S25, 4)
        turns = turning_points(A100, m, S25, 4)
        said = [x for x in out.splitlines() if x.startswith(f"  M = {m}, ")]
        assert bool(said) == (not p.direct) == bool(turns), m
        if said:
            first = nearest(turns)
            assert first is not None and said[0].endswith(f"First to turn: {first.describe()}.")


def test_plan_shows_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--node", "a100-4x200g", "--machines", "8", "--show-plan")
    made = plan_allreduce(A100, 8, Config())
    assert code == 0 and made.describe() in out
    # ... and the sizes auto measures instead (FAIRRING_CUDA_ALLREDUCE=auto).
    assert plan_allreduce(A100, 8, Config(), measured=True).describe() in out
    code, out, _ = _run(capsys, "--node", "a100-4x200g", "--machines", "8", "--json")
    assert CudaPlan.from_json(json.dumps(json.loads(out)["plan"])) == made


def test_plan_gpu_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--node", "v100-4x100g", "--machines", "8", "--size", "16M",
                        "--nccl", "2.11", "--max-machines", "8", "--json")  # fmt: skip
    result = json.loads(out)
    p = predict_gpu(V100_4X100G, 8, 16 * MIB, tuning=nccl.NCCL_2_11)
    assert p.chosen.algorithm == "tree" and p.nccl_s < p.nccl_ring_s  # NCCL's pick, not its ring
    assert code == 0 and result["device"] == "cuda"
    assert result["fairring_ms"] == pytest.approx(p.fairring_s * 1e3, rel=1e-12)
    assert result["reference_ms"] == pytest.approx(p.nccl_s * 1e3, rel=1e-12)
    assert result["reference"] == p.reference
    assert [r["machines"] for r in result["rows"]] == [1, 2, 4, 8]


def test_plan_cpu_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "calibrate", lambda links, force=False, log=None: ROUND)
    code, out, _ = _run(
        capsys,
        *"--machines 2 --ranks-per-machine 3 --link 800mbit --size 25M --in-flight 2".split(),
        "--device",
        "cpu",
        "--json",
    )
    result = json.loads(out)
    cluster = CpuCluster(2, 3, 1e8, 0.9)
    p = predict_cpu(cluster, [25 * MIB] * 2, ROUND)
    assert code == 0
    assert result["fairring_ms"] == pytest.approx(p.fairring_s * 1e3, rel=1e-12)
    assert result["reference_ms"] == pytest.approx(p.reference_s * 1e3, rel=1e-12)
    assert result["reference"] == "gloo ring" and result["link"] == "800mbit"


def test_plan_says_cpu_bound_runs_are_predicted_too_fast(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibration, "calibrate", lambda links, force=False, log=None: ROUND)
    code, out, _ = _run(capsys, "--device", "cpu", "--machines", "2", "--link", "loopback")
    assert code == 0 and "CPU-bound, which the model predicts about 40% too fast" in out
    code, out, _ = _run(capsys, "--device", "cpu", "--machines", "2", "--link", "800mbit")
    assert code == 0 and "too fast" not in out


def test_plan_reads_fairring_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--node", "a100-4x200g", "--machines", "4", "--in-flight", "4", "--max-machines", "4"]
    argv.append("--json")
    monkeypatch.setenv("FAIRRING_LANES", "1")
    _, out, _ = _run(capsys, *argv)
    one_lane = json.loads(out)["fairring_ms"]
    monkeypatch.setenv("FAIRRING_LANES", "4")
    _, out, _ = _run(capsys, *argv)
    assert json.loads(out)["fairring_ms"] < one_lane
    monkeypatch.setenv("FAIRRING_LANES", "many")
    code, _, err = _run(capsys, *argv)
    assert code == 2 and "FAIRRING_LANES" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--machines", "2", "--link", "fast", "--device", "cpu"], "--link"),
        (["--device", "cpu", "--link", "1gbit"], "--machines"),
        (["--device", "cpu", "--machines", "2", "--nic", "400gbit"], "--nic"),
        (["--machines", "4", "--intra", "lots"], "--intra"),
        (["--machines", "0"], "--machines"),
        (["--in-flight", "0"], "--in-flight"),
        (["--size", "big"], "--size"),
    ],
)
def test_plan_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        plan.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_plan_help_and_console_script(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        plan.main(["--help"])
    assert exc.value.code == 0 and "--ranks-per-machine" in capsys.readouterr().out
    pyproject = (REPO / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'fairring-plan = "fairring_pg.tools.plan_command:main"' in scripts.splitlines()
    # an install (not editable) ships only the packages listed: the model must be one
    packages = pyproject.split("\npackages = ", 1)[1].splitlines()[0]
    assert '"fairring_pg.model"' in packages


def test_plan_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "speedup.png"
    code, text, _ = _run(capsys, "--size", "25M", "--in-flight", "4", "--plot", str(out))
    assert code == 0 and f"wrote {out}" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(NODE_TYPES) == {"h100-8x400g", "h100-2x200g", "a100-4x200g", "v100-4x100g"}


# --- the validation report ----------------------------------------------------------


def _bench_module(name: str) -> Any:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(REPO / "bench"))


def test_validation_rows_compare_the_model_with_measurements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CI installs no matplotlib (the "bench" extra): the module must import without it.
    for name in ("model_validation", "report", "matplotlib", "matplotlib.pyplot"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it raises
    validation = _bench_module("model_validation")
    size = 8 * MIB
    runs = {
        "800mbit 2x2": {"world": 4, "cases": {f"1x{size}": {"fairring": [0.1, 0.2, 0.3],
                                                            "gloo": [0.2, 0.4]}}},
        "800mbit 4x1": {"world": 4, "cases": {f"1x{size}": {"fairring": [0.5], "gloo": [0.5]},
                                              f"1x{MIB // 4}": {"fairring": [0.1],
                                                                "gloo": [0.3]}}},
    }  # fmt: skip
    rows = validation.predictions(runs, ROUND)
    row = rows[0]
    expected = predict_cpu(CpuCluster(2, 2, 1e8, 0.9), [size], ROUND)
    assert row["fairring"]["measured_s"] == 0.2 and row["gloo"]["measured_s"] == pytest.approx(0.3)
    assert row["fairring"]["error"] == pytest.approx((expected.fairring_s - 0.2) / 0.2)
    assert row["gloo"]["error"] == pytest.approx((expected.reference_s - 0.3) / 0.3)
    assert validation.within(row) == (
        abs(row["fairring"]["error"]) <= 0.15 and abs(row["gloo"]["error"]) <= 0.15
    )
    # At 4 x 1 an allreduce of 1 MiB or more is Gloo's ring on both sides: not counted.
    assert [(r["shape"], r["size"], r["engine"]) for r in rows] == [
        ("2x2", size, True),
        ("4x1", size, False),
        ("4x1", MIB // 4, True),
    ]
    assert validation.counted(rows) == [rows[0], rows[2]]
    cases = ["64K", "256K", "1M", "16x25M"]
    assert validation.engine_cases(cases, 4, 1, Config()) == ["64K", "256K"]
    assert validation.engine_cases(cases, 3, 2, Config()) == cases
    args = validation.parse_args([])
    assert validation.shape_cases(args, 4, 1, Config()) == ["64K", "256K"]
    assert validation.shape_cases(args, 3, 2, Config()) == ["1M", "25M", "100M", "16x25M"]
    assert args.shapes.split(",") == ["2x2", "4x1", "2x3", "3x2"]
    assert math.isclose(validation.parse_case("16x25M")[1], 25 * MIB)
