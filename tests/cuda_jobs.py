"""What the CUDA tests (tests/test_cuda*.py) share: their marks, the simulated machines'
ids, the job environment and the device.

Every rank runs on ``cuda:0``; each simulated machine has its own ``FAIRRING_MACHINE_ID``
and ``NCCL_HOSTID`` (the harness sets both), so NCCL connects the ranks through its
socket transport, as between machines.
"""

from __future__ import annotations

import os

import pytest
import torch
from multiprocess import fairring_env

# Every CUDA test is marked ``cuda`` and skips without a GPU.
CUDA_MARKS = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MACHINES = (2, 3, 4)
# Small slices and staging, as in the CPU suite: many slices, every lane reused; no
# direct path, so that every tensor of M elements or more goes through the five steps
# (at one rank per machine too: lanes).
JOB_ENV = fairring_env(
    total_memory=64 * 1024,
    slice_size=4 * 1024,
    FAIRRING_SLICE_SCALING="off",
    FAIRRING_DIRECT_BELOW=0,
    FAIRRING_CUDA_ALLREDUCE="lanes",
)
# A first run on a new machine can lower it (a hang then costs less device time).
TIMEOUT_S = int(os.environ.get("FAIRRING_TEST_CUDA_TIMEOUT", "300"))


def machine_ids(m: int, local: int = 1) -> list[str]:
    return [f"gpu-m{i}" for i in range(m) for _ in range(local)]


def device() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)
