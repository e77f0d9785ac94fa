"""The cost model (fairring_pg.model) and fairring-plan: formulas with exact values from
known inputs, NCCL's tuning terms, the Fairring seed's published shape, the command line.

No timing here: the model is validated against the netns cluster by
bench/model_validation.py; these tests use fixed primitives.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from fairring_pg import plan
from fairring_pg.config import MIB, Config
from fairring_pg.model import calibration, nccl, prefer_fairring, seed
from fairring_pg.model.cpu import CpuCluster, gloo_time, predict_cpu, segment_size
from fairring_pg.model.gpu import fairring_time, predict_gpu
from fairring_pg.model.nodes import H100_8X400G, NODE_TYPES, V100_4X100G
from fairring_pg.model.pipeline import Piece, Stage, flow_time
from fairring_pg.model.units import parse_rate, parse_size

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
    assert "staging slots" in p.fairring.loads


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


# --- GPU: fairring's sub-group path -------------------------------------------------


def test_one_machine_is_one_nccl_allreduce() -> None:
    p = predict_gpu(H100_8X400G, 1, 25 * MIB, in_flight=4)
    assert p.direct and p.speedup == 1.0
    assert p.fairring_s == pytest.approx(4 * p.chosen.seconds, rel=1e-12)


def test_small_allreduces_go_direct() -> None:
    p = predict_gpu(H100_8X400G, 16, MIB)  # below FAIRRING_DIRECT_BELOW (2 MiB)
    assert p.direct and p.fairring_s == pytest.approx(p.nccl_s, rel=1e-12)


def test_fairring_moves_2_m_minus_1_over_m_per_machine() -> None:
    machines, size = 8, 64 * MIB
    config = Config()
    t, direct, slice_bytes = fairring_time(H100_8X400G, machines, [size] * 3, config)
    assert not direct and size % slice_bytes == 0
    assert slice_bytes == 64 * MIB  # 1 MiB x L x M, and two lanes fit 50 MiB of staging
    # collect: (M-1)/M of the slice through the machine's NICs; diffuse: the same bytes,
    # as fast as NCCL's all-gather on the rail (8 ranks, one per machine) moves them
    wire = (machines - 1) / machines * size / H100_8X400G.inter
    rail = nccl.Fabric("hopper", 1, 370e9, H100_8X400G.inter / 8, channels=16)
    ag = nccl.best(nccl.collective_times(nccl.NCCL_2_28, rail, 8, size // 8, "all-gather"))
    assert (ag.algorithm, ag.protocol) == ("ring", "LL128")
    assert ag.seconds - ag.latency_s == pytest.approx(wire / 0.92, rel=1e-9)
    assert t.loads["nic"] == pytest.approx(3 * (wire + wire / 0.92), rel=1e-9)
    # the machine's reduce-scatter and all-gather: (L-1)/L of it each, over NVLink
    assert t.loads["nvlink"] > 0 and "lanes" in t.loads


def test_in_flight_serialises_nccl_only() -> None:
    one = predict_gpu(V100_4X100G, 8, 25 * MIB, 1)
    four = predict_gpu(V100_4X100G, 8, 25 * MIB, 4)
    assert four.nccl_s == pytest.approx(4 * one.nccl_s, rel=1e-12)
    assert four.fairring_s < 4 * one.fairring_s  # slices of different calls overlap


def test_staging_too_small_is_an_error() -> None:
    with pytest.raises(ValueError, match="FAIRRING_TOTAL_MEMORY"):
        predict_gpu(H100_8X400G, 8, 25 * MIB, config=Config(total_memory=1024))


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
    code, out, _ = _run(
        capsys,
        *"--machines 16 --gpus-per-machine 8 --nic 400gbit --nics-per-machine 8".split(),
        *"--intra 370GB/s --size 25M --in-flight 4".split(),
    )
    assert code == 0
    for m in (1, 2, 4, 8, 16, 32, 64, 128):
        p = predict_gpu(H100_8X400G, m, 25 * MIB, 4)
        line = next(x for x in out.splitlines() if x[3:12].strip() == str(m))
        assert f"{p.fairring_s * 1e3:.3f}" in line and f"{p.speedup:.2f}x" in line
        assert f"{p.nccl_ring_s * 1e3:.3f}" in line and f"{p.nccl_tree_s * 1e3:.3f}" in line
    assert "fairring loses at M = " in out and "assumptions:" in out
    assert "> " in next(x for x in out.splitlines() if x[3:12].strip() == "16")


def test_plan_gpu_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--node", "v100-4x100g", "--machines", "8", "--size", "16M",
                        "--nccl", "2.11", "--json")  # fmt: skip
    result = json.loads(out)
    p = predict_gpu(V100_4X100G, 8, 16 * MIB, tuning=nccl.NCCL_2_11)
    assert p.chosen.algorithm == "tree" and p.nccl_s < p.nccl_ring_s  # NCCL's pick, not its ring
    assert code == 0 and result["device"] == "cuda"
    assert result["fairring_ms"] == pytest.approx(p.fairring_s * 1e3, rel=1e-12)
    assert result["reference_ms"] == pytest.approx(p.nccl_s * 1e3, rel=1e-12)
    assert result["reference"] == p.reference
    assert [r["machines"] for r in result["rows"]] == [1, 2, 4, 8, 16, 32, 64, 128]


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


def test_plan_reads_fairring_variables(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--node", "h100-8x400g", "--machines", "8", "--in-flight", "4", "--json"]
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
    assert 'fairring-plan = "fairring_pg.plan:main"' in scripts.splitlines()
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


def test_validation_rows_compare_the_model_with_measurements() -> None:
    pytest.importorskip("matplotlib")
    validation = _bench_module("model_validation")
    size = 8 * MIB
    runs = {"800mbit 2x2": {"world": 4, "cases": {f"1x{size}": {"fairring": [0.1, 0.2, 0.3],
                                                                "gloo": [0.2, 0.4]}}}}  # fmt: skip
    (row,) = validation.predictions(runs, ROUND)
    expected = predict_cpu(CpuCluster(2, 2, 1e8, 0.9), [size], ROUND)
    assert row["fairring"]["measured_s"] == 0.2 and row["gloo"]["measured_s"] == pytest.approx(0.3)
    assert row["fairring"]["error"] == pytest.approx((expected.fairring_s - 0.2) / 0.2)
    assert row["gloo"]["error"] == pytest.approx((expected.reference_s - 0.3) / 0.3)
    assert validation.within(row) == (
        abs(row["fairring"]["error"]) <= 0.15 and abs(row["gloo"]["error"]) <= 0.15
    )
    assert math.isclose(validation.parse_case("16x25M")[1], 25 * MIB)
