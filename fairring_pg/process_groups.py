"""The c10d process groups fairring's creator makes and hands to the core.

Delegates run what fairring does not do itself: the Gloo group for CPU tensors (and,
under its own store prefix, the group of Gloo's ring), the NCCL group for CUDA tensors.
Makers build the sub-groups an allreduce is composed of (fairring_pg.cuda.subgroups):
NCCL's for CUDA tensors, Gloo's for the CPU test path, or a stand-in accelerator's in tests.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fairring_pg.config import Config
from fairring_pg.startup import (
    SETTLE_S,
    AnotherRankFailed,
    ConnectGivenUp,
    PeersNamed,
    connect_watched,
    settle_until,
    time_left,
)

# make(prefix, rank in the group, group size, global ranks, name) -> a c10d Backend
GroupMaker = Callable[[str, int, int, list[int], str], Any]
# Who runs the collectives on CPU tensors that fairring does not run itself
# (make_gloo_delegate); a saved plan file names it (fairring_pg.measured.job_shape).
CPU_DELEGATE = "gloo"


@dataclass(frozen=True)
class StandInAccelerator:
    """A device that stands in for CUDA in tests (the stream vehicle, tests/native/):
    its tensors take the CUDA side of the backend, and its groups replace NCCL's."""

    device_type: str
    # (store, rank, size, timeout, global ranks, name) -> the world group
    make_world: Callable[[Any, int, int, timedelta, list[int], str], Any]
    # (store, timeout, global ranks) -> a maker of sub-groups
    maker: Callable[[Any, timedelta, list[int]], GroupMaker]
    # The same for Gloo's groups on its tensors (FAIRRING_TEST_LOCAL_GLOO's local
    # groups); None: Gloo's own.
    gloo_maker: Callable[[Any, timedelta, list[int]], GroupMaker] | None = None


def gloo_group(
    store: Any,
    rank: int,
    size: int,
    timeout: timedelta,
    config: Config,
    global_ranks: list[int],
    name: str,
    group_store: Any,
    members: list[int] | None = None,
) -> Any:
    """A ProcessGroupGloo on ``store`` (already prefixed) of the fairring group's ranks
    ``members`` (default: all), connected while watching ``group_store`` (the fairring
    group's) for another rank's failure to start. Gloo's own error for a rank that never
    came names a store key; this one names the rank."""
    members = list(range(size)) if members is None else members
    store.set(f"{_CAME}/{rank}", "1")
    own = _own_connection(store)
    # Gloo's connect ends with the start (startup.one_deadline), before the watch gives
    # up on it: a connect still running when the process exits aborts it (its thread
    # comes back into a finalized interpreter). Its collectives then get the timeout.
    connect_timeout = time_left(timeout)
    try:
        group = connect_watched(
            lambda: _gloo_group(own, rank, size, connect_timeout, config, global_ranks, name),
            group_store,
            timeout,
            f"connecting Gloo's group {name!r}",
        )
    except AnotherRankFailed as exc:
        # Said now, unsettled: a rank that failed waiting for this one (its address,
        # its connection) names, through this, the rank it waited on in turn.
        store.set(f"{_ENDED}/{rank}", "failed")
        raise PeersNamed(
            f"fairring: rank {members[rank]} stopped connecting Gloo's group {name!r}, "
            f"where {_who_is_missing(store, members, rank, 0.0)}: {exc}"
        ) from exc
    except Exception as exc:
        if not isinstance(exc, ConnectGivenUp):
            # Its connect ended; one given up on still runs: this rank stalled in it,
            # and says nothing, as a rank that stalled or died there would.
            store.set(f"{_ENDED}/{rank}", "failed")
        raise PeersNamed(
            f"fairring: rank {members[rank]} could not connect Gloo's group {name!r} within "
            f"{timeout}: {_who_is_missing(store, members, rank, SETTLE_S)}: {type(exc).__name__}: "
            f"{exc}"
        ) from exc
    store.set(f"{_ENDED}/{rank}", "connected")
    group._set_default_timeout(timeout)
    return group


def _own_connection(store: Any) -> Any:
    """``store`` on a connection of its own, where the store can make one (TCPStore's
    clone): Gloo's connect waits in the store for each peer's address, and a TCPStore
    client serves one request at a time, so on the group's connection every look for
    another rank's failure (connect_watched) would queue behind that wait until Gloo's
    own timeout, past the start's deadline."""
    try:
        return store.clone()
    except (RuntimeError, NotImplementedError):  # a Python store: the shared one
        return store


_CAME = "came_to_connect"
_ENDED = "ended_connecting"


def _who_is_missing(store: Any, members: list[int], me: int, settle_s: float) -> str:
    """The other ranks that never came to connect; else those that came and, once the
    others had ``settle_s`` to say how they ended, never did (they died or stalled while
    connecting). ``me`` (this rank's index) knows how its own connect ended."""

    def without(key: str) -> list[int]:
        return [m for r, m in enumerate(members) if r != me and not store.check([f"{key}/{r}"])]

    if absent := without(_CAME):
        return f"{_ranks(absent)} never came to connect it (died or stalled before)"
    deadline = settle_until(settle_s) if settle_s else time.monotonic()
    while (silent := without(_ENDED)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if silent:
        return f"{_ranks(silent)} came to connect it and left or stalled while connecting"
    return "every other rank came to connect it and ended"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(f"rank {r}" for r in ranks)


def _gloo_group(
    store: Any,
    rank: int,
    size: int,
    timeout: timedelta,
    config: Config,
    global_ranks: list[int],
    name: str,
) -> Any:
    if config.socket_ifname is None or os.environ.get("GLOO_SOCKET_IFNAME"):
        # Gloo picks its interface itself (GLOO_SOCKET_IFNAME or the hostname).
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(interface=config.socket_ifname)]
    options._timeout = timeout
    options.global_ranks_in_group = global_ranks
    options.group_name = name
    return dist.ProcessGroupGloo(store, rank, size, options)


def make_gloo_delegate(
    store: Any,
    rank: int,
    size: int,
    timeout: timedelta,
    config: Config,
    dist_backend_opts: Any,
    role: str = "gloo",
) -> Any:
    """The Gloo group that runs every non-allreduce collective on CPU tensors
    (``role="ring"``: the one that runs the allreduces given to Gloo's ring)."""
    name = str(dist_backend_opts.group_id)
    return gloo_group(
        dist.PrefixStore(f"fairring/{role}/", store),
        rank,
        size,
        timeout,
        config,
        list(dist_backend_opts.global_ranks_in_group),
        name if role == "gloo" else f"{name}-{role}",
        store,
    )


def make_nccl_delegate(
    store: Any, rank: int, size: int, timeout: timedelta, dist_backend_opts: Any
) -> Any:
    """The NCCL group for CUDA tensors (every rank has CUDA and NCCL:
    fairring_pg.cuda.decision.decide)."""
    from torch._C._distributed_c10d import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.global_ranks_in_group = list(dist_backend_opts.global_ranks_in_group)
    options.group_name = str(dist_backend_opts.group_id)
    return ProcessGroupNCCL(dist.PrefixStore("fairring/nccl/", store), rank, size, options)


def nccl_maker(
    store: Any, timeout: timedelta, global_ranks: list[int], max_ctas: int = 0
) -> GroupMaker:
    """Makes ProcessGroupNCCLs from ``store``; ``global_ranks`` maps the fairring
    group's ranks to the job's (for NCCL's and torch's logs); ``max_ctas`` (0: NCCL's
    own) caps each communicator's CTAs so that all of one composed call fit on the GPU
    at once (fairring_pg.cuda.job_plan.co_resident_ctas)."""
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
            store,
            members,
        )

    return make
