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

from typing import Any

from fairring_pg.config import Config
from fairring_pg.process_groups import GroupMaker
from fairring_pg.topology import Topology


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


def cuda_subgroup_kinds(
    topology: Topology, delegate: str, local_gloo: bool
) -> tuple[str, str] | None:
    """(local groups, lanes) kinds for composing CUDA allreduces of sub-groups, or None
    where they go to the delegate instead; from the job's topology only.

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
