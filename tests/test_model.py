"""The cost model (fairring_pg.model) on CPUs: units, the pipeline bound and schedule,
fairring's engine against Gloo's ring with exact values from known inputs, and the
calibration cache. NCCL's side is tests/test_model_nccl.py, GPUs tests/test_model_gpu.py,
the command line tests/test_plan_command.py.

No timing here: the model is validated against the netns cluster by
bench/model_validation.py; these tests use fixed primitives.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from fairring_pg.config import MIB, Config
from fairring_pg.model import calibration, prefer_fairring
from fairring_pg.model.cpu import CpuCluster, gloo_time, predict_cpu, segment_size
from fairring_pg.model.nodes import NODE_TYPES
from fairring_pg.model.pipeline import Piece, Stage, flow_time, schedule
from fairring_pg.model.units import parse_rate, parse_size

# Round primitives: 1 GB/s copies and adds, free messages and TCP, cores to spare.
ROUND = calibration.Primitives(
    copy_bytes_per_s=1e9,
    reduce_bytes_per_s=1e9,
    message_s=0.0,
    tcp_cpu_s_per_byte=0.0,
    cores=64,
    link_efficiency={"800mbit": 0.9},
)

# The model's inputs many tests share: an A100 node and one 25 MiB allreduce.
A100 = NODE_TYPES["a100-4x200g"]
S25 = 25 * MIB


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


def test_segment_size_follows_slice_cuts() -> None:
    # SliceCuts::fitSegment: L chunks, rounded down to a multiple of L*M elements
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
