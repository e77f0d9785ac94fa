"""Who runs where: machines, local ranks (rails) and whether the layout is regular.

Every rank publishes its machine id (``FAIRRING_MACHINE_ID`` or the hostname) through
the store; ranks with equal ids share a machine. Everything after the exchange is a
pure function of the ids, so it is unit-tested without processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import warnings
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fairring_pg.startup import wait_for

_STORE_KEY = "fairring/topology/{rank}"


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    machine_of: list[int]  # machine index of each rank, machines numbered by first rank
    hostnames: list[str]  # hostname of each rank (for messages)
    num_machines: int  # M
    local_size: int  # L: ranks per machine
    machine: int  # this rank's machine index
    local_rank: int  # this rank's position on its machine: its rail
    regular: bool  # False: the irregular fallback (one machine per rank) is in force
    # Every rank's local rank: the C++ core is handed this table rather than
    # numbering ranks again.
    local_rank_of: list[int] = dataclasses.field(default_factory=list)
    # The host NCCL sees for each rank: NCCL_HOSTID where set (how machines are
    # simulated on one GPU), else the hostname. NCCL refuses two ranks of one
    # communicator on one GPU of one such host.
    nccl_hosts: list[str] = dataclasses.field(default_factory=list)

    def ranks_on_machine(self, machine: int) -> list[int]:
        return [r for r, m in enumerate(self.machine_of) if m == machine]

    def rail_peers(self) -> list[int]:
        """The rank with this rank's local rank on each machine, by machine index."""
        return [self.ranks_on_machine(m)[self.local_rank] for m in range(self.num_machines)]


def build_topology(
    rank: int, ids: list[str], hostnames: list[str], nccl_hosts: list[str] | None = None
) -> Topology:
    """Topology of a job whose rank ``r`` runs on the machine named ``ids[r]``."""
    world_size = len(ids)
    if len(hostnames) != world_size or not 0 <= rank < world_size:
        raise ValueError(
            f"build_topology: rank {rank}, {world_size} machine ids, {len(hostnames)} hostnames"
        )
    # Numbering machines by their smallest rank makes the result independent of how
    # the launcher ordered ranks across machines.
    index: dict[str, int] = {}
    for machine_id in ids:
        index.setdefault(machine_id, len(index))
    machine_of = [index[machine_id] for machine_id in ids]
    counts = Counter(machine_of)
    regular = len(set(counts.values())) == 1
    if not regular:
        per_machine = ", ".join(f"{machine_id!r}: {counts[m]}" for machine_id, m in index.items())
        warnings.warn(
            "fairring: machines run different numbers of ranks "
            f"({per_machine}); treating every rank as its own machine. Results are "
            "correct but intra-node bandwidth goes unused; run the same number of ranks "
            "on every machine for full speed.",
            RuntimeWarning,
            stacklevel=2,
        )
        machine_of = list(range(world_size))
    # A rank's local rank is its position among its machine's ranks, in rank order.
    seen: Counter[int] = Counter()
    local_rank_of = []
    for machine in machine_of:
        local_rank_of.append(seen[machine])
        seen[machine] += 1
    num_machines = len(set(machine_of))
    return Topology(
        rank=rank,
        world_size=world_size,
        machine_of=machine_of,
        hostnames=list(hostnames),
        num_machines=num_machines,
        local_size=world_size // num_machines,
        machine=machine_of[rank],
        local_rank=local_rank_of[rank],
        regular=regular,
        local_rank_of=local_rank_of,
        nccl_hosts=list(hostnames) if nccl_hosts is None else list(nccl_hosts),
    )


def discover(
    store: Any,
    rank: int,
    world_size: int,
    machine_id: str | None,
    timeout: timedelta,
) -> Topology:
    """Exchange machine ids through ``store`` and build this rank's :class:`Topology`."""
    hostname = socket.gethostname()
    mine = {
        "machine_id": machine_id if machine_id is not None else hostname,
        "hostname": hostname,
        "nccl_host": os.environ.get("NCCL_HOSTID") or hostname,
    }
    store.set(_STORE_KEY.format(rank=rank), json.dumps(mine))
    keys = [_STORE_KEY.format(rank=r) for r in range(world_size)]
    wait_for(
        store, keys, timeout, f"rank {rank} waiting for every rank's machine id", range(world_size)
    )
    entries = [json.loads(store.get(key)) for key in keys]
    return build_topology(
        rank,
        [e["machine_id"] for e in entries],
        [e["hostname"] for e in entries],
        [e["nccl_host"] for e in entries],
    )
