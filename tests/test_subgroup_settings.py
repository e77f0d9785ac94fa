"""The sub-group allreduce's settings: the slice fitted to the staging, which shapes
slice, the variables' validation, and the job-wide values every rank must agree on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import launch
from test_subgroups import subgroup_env

from fairring_pg.config import Config
from fairring_pg.model.cuda_plan import plan_allreduce
from fairring_pg.model.nodes import NODE_TYPES
from fairring_pg.sizing import lane_staging_bytes

# ------------------------------------------------------------------ slice arithmetic


@pytest.mark.parametrize(("machines", "local"), [(2, 2), (3, 1), (4, 8), (16, 8)])
@pytest.mark.parametrize("lanes", [1, 4])
def test_subgroup_slice_fits_staging(machines: int, local: int, lanes: int) -> None:
    config = Config(lanes=lanes, cuda_allreduce="lanes")
    size = config.subgroup_slice_size(machines, local)
    unit = 16 * machines * local
    assert size % unit == 0 and size >= unit
    assert lanes * lane_staging_bytes(size, machines, local) <= config.total_memory
    # The largest such size: one more unit would not fit, or would exceed the wish.
    wanted = max(config.slice_size, 1024 * 1024 * machines * local)
    assert (
        size + unit > wanted
        or lanes * lane_staging_bytes(size + unit, machines, local) > config.total_memory
    )


def test_subgroup_slice_refuses_tiny_staging() -> None:
    with pytest.raises(ValueError, match="FAIRRING_TOTAL_MEMORY=1000 .*FAIRRING_LANES=4"):
        Config(total_memory=1000, lanes=4).subgroup_slice_size(4, 2)
    # A plan that composes nothing has no lanes to stage for, at any staging size.
    for config, machines, local in [
        (Config(total_memory=1000, lanes=4), 4, 1),
        (Config(total_memory=1000, lanes=4, cuda_allreduce="direct"), 4, 2),
        (Config(total_memory=1000, lanes=4), 1, 8),
    ]:
        plan = plan_allreduce(_node(local), machines, config, local_size=local)
        assert not plan.composes and plan.largest_piece == 0


def _node(gpus: int) -> Any:
    return dataclasses.replace(NODE_TYPES["a100-4x200g"], gpus=gpus)


@pytest.mark.parametrize(
    ("path", "machines", "local", "slices"),
    [
        ("auto", 2, 1, False),  # one rank per machine: as many bytes as a ring
        ("auto", 4, 1, False),
        ("auto", 2, 2, True),  # the hierarchy saves bytes between machines
        ("auto", 16, 8, True),
        ("auto", 1, 8, False),  # one machine: no rail
        ("lanes", 4, 1, True),
        ("lanes", 1, 3, False),
        ("direct", 2, 2, False),
        ("direct", 4, 1, False),
    ],
)
def test_which_shapes_slice(path: str, machines: int, local: int, slices: bool) -> None:
    # Whether any call composes is the plan's to say, and nothing else's.
    config = Config(cuda_allreduce=path)
    plan = plan_allreduce(_node(local), machines, config, local_size=local, measured=path == "auto")
    assert plan.composes is slices


def test_config_variables_are_validated() -> None:
    for raw in ("0", "17", "x", "-1", "2.5"):
        with pytest.raises(ValueError, match="FAIRRING_LANES"):
            Config.from_env({"FAIRRING_LANES": raw})
    assert Config.from_env({"FAIRRING_LANES": "3"}).lanes == 3
    assert Config.from_env({"FAIRRING_DIRECT_BELOW": "0"}).direct_below == 0
    assert Config.from_env({"FAIRRING_DIRECT_BELOW": "1M"}).direct_below == 1 << 20
    with pytest.raises(ValueError, match="FAIRRING_DIRECT_BELOW"):
        Config.from_env({"FAIRRING_DIRECT_BELOW": "-5"})
    for name in ("FAIRRING_TEST_CPU_SUBGROUPS", "FAIRRING_TEST_LOCAL_GLOO"):
        with pytest.raises(ValueError, match=name):
            Config.from_env({name: "yes"})
    assert Config().cuda_allreduce == "auto"
    for raw, want in (
        ("auto", "auto"),
        ("Model", "model"),
        (" Lanes ", "lanes"),
        ("DIRECT", "direct"),
    ):
        assert Config.from_env({"FAIRRING_CUDA_ALLREDUCE": raw}).cuda_allreduce == want
    for raw in ("", "ring", "nccl", "1"):
        with pytest.raises(
            ValueError, match="FAIRRING_CUDA_ALLREDUCE=.*auto, model, lanes, direct"
        ):
            Config.from_env({"FAIRRING_CUDA_ALLREDUCE": raw})


def test_lanes_must_agree_across_ranks() -> None:
    outcomes = run_ranks_expecting_failure({0: {"FAIRRING_LANES": "2"}, 1: {"FAIRRING_LANES": "3"}})
    for message in outcomes:
        assert "FAIRRING_LANES differs across ranks" in message, message


def test_path_must_agree_across_ranks() -> None:
    outcomes = run_ranks_expecting_failure(
        {0: {"FAIRRING_CUDA_ALLREDUCE": "auto"}, 1: {"FAIRRING_CUDA_ALLREDUCE": "lanes"}}
    )
    for message in outcomes:
        assert "FAIRRING_CUDA_ALLREDUCE differs across ranks" in message, message


def _init_only(rank: int, world: int) -> None:
    t = torch.ones(3)
    dist.all_reduce(t)


def run_ranks_expecting_failure(rank_env: dict[int, dict[str, str]]) -> list[str]:
    outcomes = launch(
        _init_only,
        2,
        ["m0", "m1"],
        env=subgroup_env(),
        timeout_s=60,
        rank_env=rank_env,
    )
    assert all(not o.ok for o in outcomes), [o.describe() for o in outcomes]
    return [f"{o.error_type}: {o.error_message}" for o in outcomes]
