"""The process groups fairring's sub-group allreduce is composed of (src/subgroups/).

For CUDA tensors they are ``ProcessGroupNCCL``s, so the bytes between machines travel
through NCCL's net layer (GPUDirect RDMA on InfiniBand/RoCE, sockets as a fallback,
plugins for other fabrics); for the CPU test path (``FAIRRING_TEST_CPU_SUBGROUPS``) they
are ``ProcessGroupGloo``s, so CI runs the very same orchestration.

Every rank builds its groups in the same order from the job's store, each under a
prefix of its own: two over the ranks of its machine (reduce-scatters and all-gathers,
so that the two can be in flight at once), then one per lane over its rail (the ranks
with its local rank on every machine). Where the plan composes no call
(fairring_pg.model.cuda_plan: one machine, one rank per machine under
``FAIRRING_CUDA_ALLREDUCE=auto``, ``direct``, unknown node facts, or no size where
composing wins), none of them is made: every allreduce is one on the world group, and
the communicators' memory is not spent. A Gloo group
connects while it is built, so the order matters; an NCCL group connects at its first
collective, which every member issues at the same point of the same sequence; the core
creates and connects every NCCL group before the first CUDA allreduce uses any
(src/subgroups/).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fairring_pg.config import Config
from fairring_pg.topology import Topology

# make(prefix, rank in the group, group size, global ranks, name) -> a c10d Backend
GroupMaker = Callable[[str, int, int, list[int], str], Any]


def build_subgroups(
    subgroups: Any,
    topology: Topology,
    config: Config,
    world: Any,
    make_local: GroupMaker,
    make_lane: GroupMaker,
    tag: str,
    group_id: str,
    composes: bool,
) -> Any:
    """Fill the core's ``Subgroups`` (``subgroups``) with ``world`` and, where the plan
    ``composes`` any call, the groups that ``make_local`` and ``make_lane`` make; ``tag``
    ("cuda" or "cpu") keeps the two sets' store keys apart, and ``group_id`` (the
    fairring group's) their names apart from other fairring groups' in NCCL's and
    torch's logs and flight recorder."""
    subgroups.world = world
    if not composes:
        return subgroups
    machine, local_rank = topology.machine, topology.local_rank
    if topology.local_size > 1:
        local = topology.ranks_on_machine(machine)
        for role in ("reduce", "gather"):
            group = make_local(
                f"fairring/{tag}/machine{machine}/{role}/",
                local_rank,
                topology.local_size,
                local,
                f"fairring-{tag}-g{group_id}-local-{role}-m{machine}",
            )
            setattr(subgroups, f"local_{role}", group)
    rail = topology.rail_peers()
    subgroups.lanes = [
        make_lane(
            f"fairring/{tag}/rail{local_rank}/lane{k}/",
            machine,
            topology.num_machines,
            rail,
            f"fairring-{tag}-g{group_id}-lane{k}-rail{local_rank}",
        )
        for k in range(config.lanes)
    ]
    return subgroups


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
    import torch

    from fairring_pg.backend import cuda_plan

    pg = dist.distributed_c10d._get_default_group() if group is None else group
    stats = pg._get_backend(torch.device(device)).subgroup_stats(device)
    if stats is not None:
        plan = cuda_plan(pg)
        stats["plan"] = [
            {
                "from_bytes": r.from_bytes,
                "path": r.path,
                "pieces": r.pieces,
                "exchange": r.exchange,
                "reason": r.reason,
            }
            for r in plan.rows
        ]
    return stats


def nccl_maker(
    store: Any, timeout: timedelta, global_ranks: list[int], max_ctas: int = 0
) -> GroupMaker:
    """Makes ProcessGroupNCCLs from ``store``; ``global_ranks`` maps the fairring
    group's ranks to the job's (for NCCL's and torch's logs); ``max_ctas`` (0: NCCL's
    own) caps each communicator's CTAs so that all of one composed call fit on the GPU
    at once (fairring_pg.cuda.co_resident_ctas)."""
    from torch._C._distributed_c10d import ProcessGroupNCCL

    def make(prefix: str, rank: int, size: int, members: list[int], name: str) -> Any:
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        options.is_high_priority_stream = False
        if max_ctas > 0:
            options.config.max_ctas = max_ctas
        options.global_ranks_in_group = [global_ranks[r] for r in members]
        options.group_name = name
        return ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, options)

    return make


def gloo_maker(
    store: Any, timeout: timedelta, config: Config, global_ranks: list[int]
) -> GroupMaker:
    """Makes ProcessGroupGloos from ``store``, on TP_SOCKET_IFNAME where it is set."""

    def make(prefix: str, rank: int, size: int, members: list[int], name: str) -> Any:
        return gloo_group(
            dist.PrefixStore(prefix, store),
            rank,
            size,
            timeout,
            config,
            [global_ranks[r] for r in members],
            name,
        )

    return make


def gloo_group(
    store: Any,
    rank: int,
    size: int,
    timeout: timedelta,
    config: Config,
    global_ranks: list[int],
    name: str,
) -> Any:
    """A ProcessGroupGloo on ``store`` (already prefixed)."""
    if config.socket_ifname is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        # Gloo picks its interface itself (GLOO_SOCKET_IFNAME or the hostname).
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(interface=config.socket_ifname)]
    options._timeout = timeout
    options.global_ranks_in_group = global_ranks
    options.group_name = name
    return dist.ProcessGroupGloo(store, rank, size, options)
