"""Which groups the CUDA path is built from, decided without a GPU.

``fairring_pg.cuda`` decides who runs CUDA collectives (NCCL, or Gloo where ranks of a
host share its GPUs, hosts told apart as NCCL does: ``NCCL_HOSTID``, else the hostname)
and whether allreduces are composed of sub-groups; ``fairring_pg.subgroups`` builds the
groups: two over the machine's ranks, one per lane over the rail, where allreduces are
sliced at all (FAIRRING_CUDA_ALLREDUCE; by default not with one rank per machine, nor on
one machine: then only the world group). Here CUDA's and NCCL's presence is faked and
the groups are recorded instead of made.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fairring_pg import cuda
from fairring_pg.config import Config
from fairring_pg.subgroups import build_subgroups
from fairring_pg.topology import build_topology


def topology(rank: int, machines: list[str], nccl_hosts: list[str] | None = None) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return build_topology(rank, machines, ["node"] * len(machines), nccl_hosts)


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Pretend this process sees ``n`` GPUs and NCCL."""

    def set_gpus(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)

    return set_gpus


def test_no_cuda_means_no_delegate(gpus: Any) -> None:
    gpus(0)
    assert cuda.cuda_delegate_kind(topology(0, ["a", "b"])) == "none"


def test_simulated_machines_on_one_gpu_use_nccl_with_their_own_hostid(gpus: Any) -> None:
    gpus(1)
    ids = ["m0", "m1", "m2"]
    # One hostname, but each simulated machine its own NCCL_HOSTID: NCCL sees 3 hosts.
    assert cuda.cuda_delegate_kind(topology(1, ids, ids)) == "nccl"
    assert cuda.cuda_subgroup_kinds(topology(1, ids, ids), "nccl", False) == ("nccl", "nccl")


def test_ranks_sharing_a_gpu_go_to_gloo_with_a_warning(gpus: Any) -> None:
    gpus(1)
    ids = ["m0", "m1"]
    with pytest.warns(UserWarning, match="NCCL refuses ranks that share a GPU"):
        kind = cuda.cuda_delegate_kind(topology(0, ids, ["node", "node"]))
    assert kind == "gloo"
    # No NCCL groups can be made then: CUDA allreduces go to the delegate.
    assert cuda.cuda_subgroup_kinds(topology(0, ids, ["node", "node"]), "gloo", False) is None
    assert cuda.cuda_subgroup_kinds(topology(0, ids, ["node", "node"]), "gloo", True) is None


def test_local_gloo_switch_keeps_nccl_rails(gpus: Any) -> None:
    gpus(1)
    ids = ["m0", "m0", "m1", "m1"]  # two ranks per simulated machine on one GPU
    topo = topology(2, ids, ids)
    with pytest.warns(UserWarning):
        kind = cuda.cuda_delegate_kind(topo)
    assert kind == "gloo"
    assert cuda.cuda_subgroup_kinds(topo, kind, True) == ("gloo", "nccl")
    assert cuda.cuda_subgroup_kinds(topo, kind, False) is None


def test_explicit_choices(gpus: Any) -> None:
    gpus(1)
    topo = topology(0, ["a", "a"])
    assert cuda.cuda_delegate_kind(topo, "nccl") == "nccl"
    assert cuda.cuda_delegate_kind(topo, "gloo") == "gloo"


@pytest.mark.parametrize(
    ("path", "machines", "rank", "local", "lanes"),
    [
        ("auto", ["m0", "m0", "m1", "m1"], 3, [2, 3], [[1, 3], [1, 3]]),
        ("lanes", ["m0", "m1", "m2"], 1, None, [[0, 1, 2]] * 3),
        ("auto", ["m0", "m1", "m0", "m1"], 2, [0, 2], [[2, 3], [2, 3]]),
        # Nothing but the world group: one rank per machine (the five steps would save no
        # bytes), one machine (no rail), or every allreduce NCCL's own.
        ("auto", ["m0", "m1", "m2"], 1, None, None),
        ("auto", ["m0", "m0", "m0"], 2, None, None),
        ("lanes", ["m0", "m0", "m0"], 2, None, None),
        ("direct", ["m0", "m0", "m1", "m1"], 3, None, None),
    ],
)
def test_groups_and_their_members(
    path: str,
    machines: list[str],
    rank: int,
    local: list[int] | None,
    lanes: list[list[int]] | None,
) -> None:
    made: list[tuple[str, int, int, list[int], str]] = []

    def record(kind: str) -> Any:
        def make(prefix: str, r: int, size: int, members: list[int], name: str) -> Any:
            made.append((prefix, r, size, members, name))
            return f"{kind}:{prefix}"

        return make

    topo = topology(rank, machines)
    lane_count = len(lanes) if lanes else 2
    groups = build_subgroups(
        SimpleNamespace(lanes=[]),
        topo,
        Config(lanes=lane_count, cuda_allreduce=path),
        "WORLD",
        record("local"),
        record("lane"),
        "cuda",
        "7",
    )
    assert groups.world == "WORLD"
    if local is None and lanes is None:
        assert made == [] and groups.lanes == [], made
    if local is None:
        assert not hasattr(groups, "local_reduce")
    else:
        assert groups.local_reduce.startswith("local:") and groups.local_gather.startswith("local:")
        for _prefix, r, size, members, _ in made[:2]:
            assert members == local and size == len(local) and r == local.index(rank)
        assert made[0][0] != made[1][0]
    if lanes is None:
        assert groups.lanes == []
    else:
        lane_made = made[-len(lanes) :]
        assert [g.split(":", 1)[0] for g in groups.lanes] == ["lane"] * len(lanes)
        assert len({m[0] for m in lane_made}) == len(lanes)  # a store prefix each
        for (_prefix, r, size, members, _), want in zip(lane_made, lanes, strict=True):
            # The rail: this rank's local rank on every machine, by machine.
            assert members == want and size == len(want) and members[r] == rank
    # Names tell the groups apart, and from another fairring group's (id 7 here).
    names = [m[4] for m in made]
    assert len(set(names)) == len(names) and all("-g7-" in n for n in names), names
