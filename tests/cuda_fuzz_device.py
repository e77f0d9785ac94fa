"""Where a random program (tests/cuda_fuzz_rank.py) runs: the stream vehicle, in CI, or
a real GPU, where one is lent (scripts/run_cuda_tests.sh's ``fuzz`` part).

Each gives the rank what the program needs of a device: the tensors' device, streams
(the current one, new ones, making one current), a host wait for the whole device, the
races seen (the vehicle's Ledger; a GPU has none to show, only wrong values), and the two
ways to make the default group: fairring, or the reference (the NCCL stand-in on the
vehicle, ``backend="nccl"`` on a GPU).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

GROUP_TIMEOUT = timedelta(seconds=60)


class Vehicle:
    name = "vehicle"

    def __init__(self) -> None:
        import stream_vehicle

        self._sv = stream_vehicle
        self._v: Any = None

    def init(self, mode: str) -> None:
        if mode == "fairring":
            self._sv.init_fairring(timeout=GROUP_TIMEOUT)
        else:
            self._sv.init_stand_in()
        self._v = self._sv.install()
        self._v.synchronize()
        self._v.clear_races()

    def current_stream(self) -> Any:
        return self._v.current_stream()

    def new_stream(self, name: str) -> Any:
        return self._v.new_stream(name)

    def set_stream(self, stream: Any) -> None:
        self._v.set_stream(stream)

    def synchronize(self) -> None:
        self._v.synchronize()

    def races(self) -> list[str]:
        return list(self._v.races())

    def finish(self) -> None:
        self._sv.finish()


class Cuda:
    """``cuda:0``, shared by every rank of the job (simulated machines under MPS, each
    rank its own NCCL host so that NCCL takes ranks of one simulated machine on one GPU,
    as tests/test_cuda_like_nccl.py does)."""

    name = "cuda"

    def init(self, mode: str) -> None:
        rank = int(os.environ["RANK"])
        os.environ["NCCL_HOSTID"] = f"fuzz-rank{rank}"
        torch.cuda.set_device(0)
        backend = "fairring" if mode == "fairring" else "nccl"
        dist.init_process_group(backend, timeout=GROUP_TIMEOUT)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def new_stream(self, name: str) -> Any:
        return torch.cuda.Stream()

    def set_stream(self, stream: Any) -> None:
        torch.cuda.set_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def races(self) -> list[str]:
        return []  # a GPU keeps no ledger: a wrong order shows as wrong values only

    def finish(self) -> None:
        torch.cuda.synchronize()


def for_name(name: str) -> Vehicle | Cuda:
    if name == "vehicle":
        return Vehicle()
    if name == "cuda":
        return Cuda()
    raise ValueError(f"unknown device {name!r}: vehicle or cuda")
