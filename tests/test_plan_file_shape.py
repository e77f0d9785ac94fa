"""What a FAIRRING_PLAN_FILE names of the job that saved it (fairring_pg.measured's
``job_shape``), without processes: a file saved by a job that differs in one of the
machines' facts (node facts, NIC rates, GPUs, CPU cores), the torch or NCCL version, a
delegate or the sub-groups' CTA cap is refused, naming that field with the file's value
and this job's and saying how to fix it; a file saved by the same job is taken; a torch
a patch release apart is taken with a warning. The facts come from every rank's
published ``GpuFacts`` (fairring_pg.cuda.decision), so the shape is the same on every
rank; ranks that disagree leave ``{"differ": [...]}``.

The multi-rank check (a saved file whose torch version was edited is refused on every
rank at ``init_process_group``) is in tests/test_measured_choice.py.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fairring_pg import measured
from fairring_pg.config import Config
from fairring_pg.cuda import decision
from fairring_pg.cuda.decision import GpuFacts
from fairring_pg.cuda.node_facts import NodeFacts
from fairring_pg.model import cpu_plan, cuda_plan

GBIT = 1e9 / 8
HOPPER = NodeFacts(arch="hopper", nvlink=True, nic_rates=(400 * GBIT,) * 8, nvls=True, cpu="intel")
RANK = GpuFacts(
    host="h0",
    cuda=True,
    nccl=True,
    gpus=("GPU-0",),
    node=HOPPER.to_json(),
    sms=132,
    gpu_models=("NVIDIA H100 80GB HBM3",),
    gpu_memory=85 << 30,
    cores=96,
    torch="2.4.0+cu121",
    nccl_version="2.21.5",
)


def shape(
    facts: GpuFacts = RANK, delegate: str = "nccl", ctas: int = 12, world: int = 2
) -> dict[str, Any]:
    """The shape of a 2 x 1 job whose ranks all published ``facts``."""
    config = Config()
    topo: Any = SimpleNamespace(world_size=world, num_machines=world, local_size=1)
    cpu = cpu_plan.plan_cpu_allreduce(config, world, 1)
    cuda = cuda_plan.only_nccl(world, 1, "unknown", "test")
    return measured.job_shape(topo, config, cpu, cuda, [facts] * world, delegate, ctas)


def save(path: Path, saved_shape: dict[str, Any]) -> None:
    content = {"format": measured.FORMAT, "shape": saved_shape, "decisions": [{"x": 1}]}
    path.write_text(json.dumps(content, indent=1, sort_keys=True))


def _node(**changes: Any) -> str:
    return dataclasses.replace(HOPPER, **changes).to_json()


# (field, the saving job's shape, the file's value, this job's value)
OTHER_JOBS = [
    ("torch_version", shape(dataclasses.replace(RANK, torch="2.3.1+cu121")), "2.3.1+cu121"),
    ("torch_version", shape(dataclasses.replace(RANK, torch="2.4.1+cu124")), "2.4.1+cu124"),
    ("nccl_version", shape(dataclasses.replace(RANK, nccl_version="2.20.5")), "2.20.5"),
    ("cuda_delegate", shape(delegate="gloo"), "gloo"),
    ("cpu_delegate", shape() | {"cpu_delegate": "mpi"}, "mpi"),
    ("node", shape(dataclasses.replace(RANK, node=_node(arch="ampere"))), None),
    ("node", shape(dataclasses.replace(RANK, node=_node(cpu="amd"))), None),
    ("link_rates", shape(dataclasses.replace(RANK, node=_node(nic_rates=(25e9,) * 8))), None),
    ("gpu_models", shape(dataclasses.replace(RANK, gpu_models=("NVIDIA A100",))), None),
    ("gpu_sms", shape(dataclasses.replace(RANK, sms=114)), 114),
    ("gpu_memory", shape(dataclasses.replace(RANK, gpu_memory=80 << 30)), 80 << 30),
    ("cpu_cores", shape(dataclasses.replace(RANK, cores=64)), 64),
    ("sub_group_ctas", shape(ctas=8), 8),
]


@pytest.mark.parametrize(
    ("field", "saved_shape", "theirs"),
    OTHER_JOBS,
    ids=[f"{field}-{i}" for i, (field, _, _) in enumerate(OTHER_JOBS)],
)
def test_a_file_of_a_job_that_differs_in_one_fact_is_refused_naming_it(
    tmp_path: Path, field: str, saved_shape: dict[str, Any], theirs: Any
) -> None:
    path = tmp_path / "plan.json"
    save(path, saved_shape)
    mine = shape()
    with pytest.raises(ValueError) as refused:
        measured.read_known(str(path), mine)
    theirs = saved_shape[field] if theirs is None else theirs
    message = str(refused.value)
    assert f"FAIRRING_PLAN_FILE={str(path)!r} holds the decisions of another job" in message
    assert f"its {field} is {theirs!r}, this job's is {mine[field]!r}" in message
    assert "name another file, or delete this one to measure again" in message


def test_the_file_of_the_same_job_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    save(path, shape())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert measured.read_known(str(path), shape()) == [{"x": 1}]


def test_a_file_saved_as_the_recorder_saves_it_is_taken(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    topo: Any = SimpleNamespace(num_machines=2, local_size=1)
    recorder = measured.Recorder(topo, shape(), str(path), [])
    decision = {"device": "cpu", "from_bytes": 0, "to_bytes": 4096, "ways": ["engine", "ring"]}
    decision |= {"seconds": [1.0, 2.0], "bytes": [1.0, 1.0], "winner": "engine"}
    decision |= {"source": "measured"}
    recorder("cpu", json.dumps(decision | {"trial_calls": 12, "timed_calls": 4}))
    assert json.loads(path.read_text())["shape"]["torch_version"] == "2.4.0+cu121"
    assert [d["winner"] for d in measured.read_known(str(path), shape())] == ["engine"]


def test_a_torch_a_patch_release_apart_is_taken_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    save(path, shape(dataclasses.replace(RANK, torch="2.4.1+cu121")))
    with pytest.warns(RuntimeWarning) as said:
        assert measured.read_known(str(path), shape()) == [{"x": 1}]
    (warning,) = said
    assert "with torch_version '2.4.1+cu121', this job has '2.4.0+cu121'" in str(warning.message)
    assert "a patch release apart" in str(warning.message)


def test_an_old_file_is_not_a_plan_file_of_this_version(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    old = {key: shape()[key] for key in ("world_size", "machines", "local_size", "settings")}
    path.write_text(json.dumps({"format": "fairring-plan-file/1", "shape": old, "decisions": []}))
    with pytest.raises(ValueError, match=r"not a plan file of this version"):
        measured.read_known(str(path), shape())


def test_the_shape_says_where_the_ranks_facts_differ_and_none_where_unknown() -> None:
    config = Config()
    topo: Any = SimpleNamespace(world_size=2, num_machines=2, local_size=1)
    cpu = cpu_plan.plan_cpu_allreduce(config, 2, 1)
    cuda = cuda_plan.only_nccl(2, 1, "unknown", "test")
    facts = [RANK, dataclasses.replace(RANK, torch="2.3.1+cu121")]
    mixed = measured.job_shape(topo, config, cpu, cuda, facts, "nccl", 0)
    assert mixed["torch_version"] == {"differ": ["2.3.1+cu121", "2.4.0+cu121"]}
    cpu_only = GpuFacts("h0", False, False, node=NodeFacts().to_json(), torch="2.4.0+cpu")
    bare = measured.job_shape(topo, config, cpu, cuda, [cpu_only] * 2, "none", 0)
    assert bare["link_rates"] is None  # the project knows no link's rate
    assert (bare["gpu_models"], bare["gpu_sms"], bare["gpu_memory"]) == (None, None, None)
    assert (bare["nccl_version"], bare["cpu_delegate"]) == (None, "gloo")


def test_every_rank_publishes_the_facts_the_shape_is_made_of() -> None:
    mine = decision.local_gpu_facts("h0")
    assert mine.torch == torch.__version__ and mine.cores >= 1
    if not torch.cuda.is_available():
        assert (mine.gpu_models, mine.gpu_memory) == ((), 0)
    if not dist.is_nccl_available():
        assert mine.nccl_version is None
    facts = decision.exchange_gpu_facts(_DictStore(), 0, 1, timedelta(seconds=5), RANK)
    assert facts == [RANK]  # every field published comes back


class _DictStore:
    """The part of a c10d store exchange_gpu_facts uses."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self._values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self._values[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self._values for key in keys)
