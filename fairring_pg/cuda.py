"""The CUDA side of the creator: which group runs the other collectives on CUDA
tensors, and the intra-node NCCL groups of fairring's own CUDA allreduce.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected").
That is how the CUDA path is tested on a machine with a single GPU (M simulated
machines x 1 rank, every rank on ``cuda:0``), and it would make DDP fail at its very
first call (the broadcast of the parameters). So where this host runs more ranks than
this process sees GPUs, the collectives fairring delegates go to Gloo, which handles
CUDA tensors through host copies, and fairring says so once. ``FAIRRING_CUDA_DELEGATE``
overrides the guess: ``nccl`` (e.g. ranks each restricted to a different GPU with
``CUDA_VISIBLE_DEVICES``) or ``gloo``.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fairring_pg.topology import Topology

DELEGATE_VARIABLE = "FAIRRING_CUDA_DELEGATE"


def cuda_delegate_kind(topology: Topology, choice: str = "auto") -> str:
    """``"nccl"``, ``"gloo"`` or ``"none"`` (no CUDA or no NCCL in this process), from
    the validated ``FAIRRING_CUDA_DELEGATE`` (``Config.cuda_delegate``)."""
    if not torch.cuda.is_available():
        return "none"
    if choice == "gloo":
        return "gloo"
    if not dist.is_nccl_available():
        return "gloo" if choice == "auto" else "none"
    if choice == "nccl":
        return "nccl"
    here = topology.hostnames[topology.rank]
    on_host = topology.hostnames.count(here)
    gpus = torch.cuda.device_count()
    if on_host > gpus:
        if topology.rank == topology.hostnames.index(here):
            warnings.warn(
                f"fairring: {on_host} ranks run on {here} but it shows {gpus} GPU(s); NCCL "
                "refuses ranks that share a GPU, so collectives other than allreduce on CUDA "
                f"tensors go to Gloo (set {DELEGATE_VARIABLE}=nccl if each rank has a GPU of "
                "its own)",
                stacklevel=2,
            )
        return "gloo"
    return "nccl"


def make_local_nccl_groups(
    store: Any, topology: Topology, timeout: timedelta
) -> tuple[Any, Any] | None:
    """Two NCCL groups over the ranks of this machine (reduce-scatters and all-gathers
    must each keep one order on every rank, and they interleave differently), or None
    with one rank per machine, without CUDA, or in a build without the CUDA pipeline."""
    if topology.local_size == 1 or not torch.cuda.is_available() or not dist.is_nccl_available():
        return None
    from torch._C._distributed_c10d import ProcessGroupNCCL

    local = topology.ranks_on_machine(topology.machine)
    groups = []
    for role in ("reduce", "gather"):
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.global_ranks_in_group = local
        options.group_name = f"fairring-local-{role}-{topology.machine}"
        prefix = f"fairring/nccl-local/{topology.machine}/{role}/"
        groups.append(
            ProcessGroupNCCL(
                dist.PrefixStore(prefix, store),
                topology.local_rank,
                topology.local_size,
                options,
            )
        )
    return groups[0], groups[1]
