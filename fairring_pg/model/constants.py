"""fairring's own costs on GPUs: the constants of its side that no NCCL figure fixes.

Each is one named constant with its source. None has been measured on a GPU yet; a GPU
run that measures one (bench/cuda_allreduce.py --profile, the trials of
FAIRRING_CUDA_ALLREDUCE=auto) sets its ``value`` here and says where it came from in
``source``, and every prediction, plan and test follows. ``fairring-plan`` varies each
alone, on the plan as it runs, to say where each composed row's verdict turns
(fairring_pg.model.sensitivity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fairring_pg.model.alltoall import MessageEfficiency


@dataclass(frozen=True)
class Constant:
    name: str  # as fairring-plan prints it
    field: str  # the field of composition.Implementation it sets
    value: Any  # seconds, a MessageEfficiency or a flag; None: NCCL's own figure
    source: str
    measured: bool = False


MESSAGE = Constant(
    "per message",
    "message_s",
    None,
    "proxy time per all-to-all message posted: NCCL's own network overhead per step "
    "(NCCL 2.28.9 src/graph/tuning.cc getNetOverhead: 1 us on Intel hosts, 2 on AMD; x3 for "
    "the Simple protocol), fairring_pg.model.alltoall; not measured",
)
HOST_STEP = Constant(
    "host per step",
    "host_s",
    10e-6,
    "the calling thread's time to issue one step (a ProcessGroupNCCL collective with its "
    "event record and stream wait, or the reduction kernel), from C++; NVIDIA measured about "
    "20 us from a PyTorch element-wise op's launch call to its kernel's start on a V100, "
    "Python dispatch included ('Understanding the Visualization of Overhead and Latency in "
    "NVIDIA Nsight Systems', 2021); not measured",
)
KERNEL_START = Constant(
    "kernel start",
    "launch_s",
    5e-6,
    "a dependent kernel's start on the GPU after the step before it (the reduction between "
    "the two all-to-all hops): the GPU-side part of the same launch latency; not measured",
)
ALLTOALL_EFFICIENCY = Constant(
    "all-to-all efficiency",
    "alltoall_efficiency",
    MessageEfficiency(),
    "payload share of the NICs' rate by message size: NCCL's own protocol factor and "
    "treeCorrectionFactor (NCCL 2.28.9 src/graph/tuning.cc), fairring_pg.model.alltoall; "
    "not measured",
)
OVERLAP = Constant(
    "overlap",
    "overlap",
    True,
    "the steps of consecutive pieces run at once on their own streams (the design of issue "
    "34); on a GPU NCCL's kernels of different communicators overlap only where SMs are free; "
    "not measured",
)

FAIRRING_SIDE = (MESSAGE, HOST_STEP, KERNEL_START, ALLTOALL_EFFICIENCY, OVERLAP)
