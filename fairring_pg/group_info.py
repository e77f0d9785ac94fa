"""What each fairring group settled at its creation and has done since, for the
program to ask: who runs its CUDA collectives, what each size of its CUDA and CPU
allreduces runs, the measured choice's decisions and the sub-group path's counters.

The creator (fairring_pg.backend) records each group's settlement here by group name;
every query takes a process group, or None for the default one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fairring_pg import measured
from fairring_pg.cuda.decision import CudaDecision
from fairring_pg.model.cpu_plan import CpuPlan
from fairring_pg.model.cuda_plan import CudaPlan

# By group name: what each group decided for CUDA tensors, and what each size of its
# CUDA and CPU allreduces runs.
_cuda_decisions: dict[str, CudaDecision] = {}
_cuda_plans: dict[str, CudaPlan] = {}
_cpu_plans: dict[str, CpuPlan] = {}


def record(group_id: str, decision: CudaDecision, cuda: CudaPlan, cpu: CpuPlan) -> None:
    """Keep what group ``group_id`` settled, for the queries below."""
    _cuda_decisions[group_id] = decision
    _cuda_plans[group_id] = cuda
    _cpu_plans[group_id] = cpu


def group_or_default(group: Any) -> Any:
    """``group``, or the default process group where it is None."""
    return dist.distributed_c10d._get_default_group() if group is None else group


def cuda_decision(group: Any = None) -> CudaDecision:
    """Who runs collectives on CUDA tensors in ``group`` (default: the default group),
    and why: the same on every rank."""
    return _cuda_decisions[group_or_default(group).group_name]


def cuda_plan(group: Any = None) -> CudaPlan:
    """What each size of CUDA allreduce runs in ``group`` (default: the default group):
    fairring_pg.model.cuda_plan's rows, with their reasons; the same on every rank."""
    return _cuda_plans[group_or_default(group).group_name]


def cpu_plan(group: Any = None) -> CpuPlan:
    """What each size of CPU allreduce runs in ``group`` (default: the default group):
    fairring_pg.model.cpu_plan's rows, with their reasons; the same on every rank."""
    return _cpu_plans[group_or_default(group).group_name]


def measured_choices(group: Any = None) -> list[dict[str, Any]]:
    """The measured choice's decisions in ``group`` (default: the default group) so far,
    one per size class decided, CPU and CUDA (``fairring_pg.measured`` says what each
    holds): the same on every rank, once every rank has made the class's decision
    call."""
    pg = group_or_default(group)
    choices: list[dict[str, Any]] = []
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
        except RuntimeError:
            continue  # no backend for that device in this group
        choices += measured.decisions_of(backend, (device,))
    return choices


def subgroup_stats(group: Any = None, device: str = "cuda") -> dict[str, Any] | None:
    """What the sub-group allreduce of ``group`` (default: the default group) has done on
    ``device`` ("cuda", or "cpu" for the ``FAIRRING_TEST_CPU_SUBGROUPS`` path): how many
    allreduces (``operations``), how many were NCCL's own (``nccl_calls``) or composed
    (``composed_calls``), how many took each row of the plan (``rows``, beside ``plan``:
    each row's range, choice and reason), how many units went to one allreduce on the
    world group (``direct_units``: NCCL's calls and the tails of composed ones) or through
    the composition (``sliced_units``: pieces), how often one waited for an earlier
    operation on the same bytes (``ordering_waits``), collectives captured into a CUDA
    graph that could not be ordered (``unordered_in_capture``), and how a destroy ended
    (``shutdown``, ``aborted_groups``). None where that device's allreduces do not take
    the path."""
    pg = group_or_default(group)
    stats = pg._get_backend(torch.device(device)).subgroup_stats(device)
    if stats is not None:
        stats["plan"] = [
            {
                "from_bytes": r.from_bytes,
                "path": r.path,
                "pieces": r.pieces,
                "exchange": r.exchange,
                "reason": r.reason,
            }
            for r in cuda_plan(pg).rows
        ]
    return stats
