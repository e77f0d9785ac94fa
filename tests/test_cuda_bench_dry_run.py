"""bench/cuda_allreduce.py, the GPU benchmark, runs end to end without a GPU.

It can only be measured on a GPU machine, which few sessions get; its ``--cpu-dry-run``
runs the same script on CPU tensors (fairring on its sub-group test path, Gloo in
NCCL's place, tiny sizes) so that a broken script is found here, not there. Its
figures mean nothing; the test checks the table's shape, that every case ran, that the
targets are judged for the default path's group, and that --profile leaves a trace of
each profiled case and group with a summary.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_cuda_benchmark_dry_run(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "cuda_allreduce.py"),
            "--cpu-dry-run",
            "--shapes",
            "2x1",
            "--paths",
            "auto,lanes",
            "--lanes",
            "2",
            "--profile",
            str(tmp_path / "profile"),
            "--iters",
            "1",
            "--ddp-steps",
            "1",
            "--no-gloo",
            "--timeout",
            "240",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "cuda_allreduce_2x1.json").read_text())
    names = {"fairring-k2", "fairring-lanes-k2", "nccl"}
    for size in ("64K", "1M", "25M", "100M"):
        assert set(data["sizes"][size]) == names
        assert all(t > 0 for t in data["sizes"][size].values())
    assert set(data["in_flight"]) == names
    assert set(data["ddp_steps_per_s"]) == names
    # One rank per machine: the default path never slices, lanes does (the 32 MiB probe).
    assert data["paths"]["fairring-k2"]["sliced_units"] == 0
    assert data["paths"]["fairring-lanes-k2"]["sliced_units"] > 0
    # Issue 26's targets, for the default path's group: every size, in flight, DDP.
    targets = data["targets"]
    assert [t["case"] for t in targets] == [
        "64K",
        "1M",
        "25M",
        "100M",
        "16 x 25M in flight",
        "DDP steps/s",
    ]
    for t in targets:
        assert t["group"] == "fairring-k2" and t["target"] == 0.97
        assert t["met"] == (t["speed"] >= 0.97)
    table = (tmp_path / "cuda_allreduce.md").read_text()
    assert "fairring-lanes-k2 speed vs nccl" in table and "16 x 25M in flight" in table
    met = sum(t["met"] for t in targets)
    assert f"Targets met at 2x1: {met} of 6" in table
    assert table.count("| PASS |") + table.count("| FAIL |") == 5  # DDP's is in its line
    profile = tmp_path / "profile"
    for case in ("25M", "in_flight"):
        for name in names:
            trace = json.loads((profile / f"trace_2x1_{case}_{name}.json").read_text())
            assert trace["traceEvents"], (case, name)
    summary = (profile / "profile_2x1.txt").read_text()
    assert summary.count("== ") == 6 and "c10d::allreduce_" in summary
