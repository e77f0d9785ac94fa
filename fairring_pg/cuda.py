"""The CUDA side of the creator: which group runs the other collectives on CUDA
tensors, and whether CUDA allreduces can be composed of NCCL sub-groups.

NCCL refuses two ranks of one communicator on one GPU of one host ("Duplicate GPU
detected"); it tells hosts apart by a hash that ``NCCL_HOSTID`` replaces, which is how
several machines are simulated on one GPU (each with its own ``NCCL_HOSTID``). Where a
host (as NCCL sees it) runs more ranks than this process sees GPUs, the collectives
fairring delegates go to Gloo, which handles CUDA tensors through host copies, and so
do CUDA allreduces, and fairring says so once. ``FAIRRING_CUDA_DELEGATE`` overrides the
guess: ``nccl`` (e.g. ranks each restricted to a different GPU with
``CUDA_VISIBLE_DEVICES``) or ``gloo``.
"""

from __future__ import annotations

import warnings

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
    here = topology.nccl_hosts[topology.rank]
    on_host = topology.nccl_hosts.count(here)
    gpus = torch.cuda.device_count()
    if on_host > gpus:
        if topology.rank == topology.nccl_hosts.index(here):
            warnings.warn(
                f"fairring: {on_host} ranks run on host {here} but it shows {gpus} GPU(s); "
                "NCCL refuses ranks that share a GPU, so collectives on CUDA tensors, "
                f"allreduce included, go to Gloo (set {DELEGATE_VARIABLE}=nccl if each rank "
                "has a GPU of its own, or give each simulated machine its own NCCL_HOSTID)",
                stacklevel=2,
            )
        return "gloo"
    return "nccl"


def cuda_subgroup_kinds(
    topology: Topology, delegate: str, local_gloo: bool
) -> tuple[str, str] | None:
    """(local groups, lanes) kinds for composing CUDA allreduces of sub-groups, or None
    where they go to the delegate instead.

    With NCCL for the delegate every group is NCCL. The test switch ``local_gloo``
    (``FAIRRING_TEST_LOCAL_GLOO``) makes the local groups Gloo, so that several ranks of
    a simulated machine can share one GPU; their rails still need NCCL, which takes them
    when each rail runs on hosts of its own.
    """
    if delegate == "nccl":
        return ("gloo" if local_gloo else "nccl", "nccl")
    rail_hosts = {topology.nccl_hosts[r] for r in topology.rail_peers()}
    if delegate == "gloo" and local_gloo and len(rail_hosts) == topology.num_machines:
        return ("gloo", "nccl")
    return None
