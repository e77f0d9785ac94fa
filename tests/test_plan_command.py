"""fairring-plan (fairring_pg/tools/plan_command.py): the GPU table, the plan, JSON for
CPU and GPU, FAIRRING_* variables, bad input, the console script and the plot.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_model import A100, ROUND, S25

from fairring_pg.config import MIB, Config
from fairring_pg.model import calibration, nccl
from fairring_pg.model.cpu import CpuCluster, predict_cpu
from fairring_pg.model.cuda_plan import (
    CudaPlan,
    plan_allreduce,
)
from fairring_pg.model.gpu import predict_gpu
from fairring_pg.model.nodes import NODE_TYPES, V100_4X100G
from fairring_pg.model.sensitivity import nearest, turning_points
from fairring_pg.tools import plan_command as plan

REPO = Path(__file__).resolve().parent.parent

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
    # An install (not editable) ships only the packages listed: every subpackage must be
    # one (the tool's and the model's among them).
    packages = pyproject.split("\npackages = [", 1)[1].split("]", 1)[0]
    for init in (REPO / "fairring_pg").glob("*/__init__.py"):
        assert f'"fairring_pg.{init.parent.name}"' in packages, init.parent.name


def test_plan_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "speedup.png"
    code, text, _ = _run(capsys, "--size", "25M", "--in-flight", "4", "--plot", str(out))
    assert code == 0 and f"wrote {out}" in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(NODE_TYPES) == {"h100-8x400g", "h100-2x200g", "a100-4x200g", "v100-4x100g"}
