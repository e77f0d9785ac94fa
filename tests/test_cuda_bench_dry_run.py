"""bench/cuda_allreduce.py, the GPU benchmark, runs end to end without a GPU.

It can only be measured on a GPU machine, which few sessions get; its ``--cpu-dry-run``
runs the same script on CPU tensors (fairring on its sub-group test path, Gloo in
NCCL's place, tiny sizes) so that a broken script is found here, not there. Its
figures mean nothing; the test checks the table's shape and that every case ran.
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
            "--lanes",
            "1,2",
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
    names = {"fairring-lanes1", "fairring-lanes2", "nccl"}
    for size in ("64K", "1M", "25M", "100M"):
        assert set(data["sizes"][size]) == names
        assert all(t > 0 for t in data["sizes"][size].values())
    assert set(data["in_flight"]) == names
    assert set(data["ddp_steps_per_s"]) == names
    table = (tmp_path / "cuda_allreduce.md").read_text()
    assert "fairring-lanes2/nccl" in table and "16 x 25M in flight" in table
