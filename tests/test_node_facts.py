"""fairring_pg.cuda.node_facts: what a machine is made of (detected through injected probes,
or named by FAIRRING_NODE), merged across ranks into the job's answer the CUDA
allreduce's plan is made from. No GPU, no sysfs of this host: every probe is a fake."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fairring_pg.config import Config
from fairring_pg.cuda import node_facts
from fairring_pg.cuda.node_facts import NodeFacts, Probes
from fairring_pg.model.cuda_plan import plan_allreduce
from fairring_pg.model.nodes import NODE_TYPES


def fake_sysfs(files: dict[str, str], dirs: dict[str, list[str]], **probes: object) -> Probes:
    return Probes(
        read=lambda path: files.get(path),
        listdir=lambda path: sorted(dirs.get(path, [])),
        **probes,  # type: ignore[arg-type]
    )


IB = "/sys/class/infiniband"
NET = "/sys/class/net"
IB_MACHINE = fake_sysfs(
    {
        f"{IB}/mlx5_0/ports/1/state": "4: ACTIVE",
        f"{IB}/mlx5_0/ports/1/rate": "400 Gb/sec (4X NDR)",
        f"{IB}/mlx5_1/ports/1/state": "1: DOWN",
        f"{IB}/mlx5_1/ports/1/rate": "400 Gb/sec (4X NDR)",
        f"{IB}/mlx5_2/ports/1/state": "4: ACTIVE",
        f"{IB}/mlx5_2/ports/1/rate": "200 Gb/sec (2X HDR)",
        f"{NET}/eth0/operstate": "up",
        f"{NET}/eth0/speed": "25000",
    },
    {
        IB: ["mlx5_0", "mlx5_1", "mlx5_2"],
        f"{IB}/mlx5_0/ports": ["1"],
        f"{IB}/mlx5_1/ports": ["1"],
        f"{IB}/mlx5_2/ports": ["1"],
        NET: ["eth0", "lo"],
        f"{NET}/eth0/device": ["vendor"],
    },
    capability=lambda: (9, 0),
    nvlink_matrix=lambda: [[0, 18], [18, 0]],
    device_name=lambda: "NVIDIA H100 80GB HBM3",
)


def test_infiniband_ports_that_are_up_and_nothing_else() -> None:
    # The Ethernet interface does not count where NCCL has InfiniBand/RoCE to use.
    assert node_facts.nic_rates(IB_MACHINE) == (400e9 / 8, 200e9 / 8)
    facts = node_facts.detect(IB_MACHINE)
    assert facts == NodeFacts("hopper", True, (50e9, 25e9), nvls=True, source="detected")


def test_without_infiniband_the_physical_interfaces_that_are_up() -> None:
    probes = fake_sysfs(
        {
            f"{NET}/eth0/operstate": "up",
            f"{NET}/eth0/speed": "100000",
            f"{NET}/eth1/operstate": "down",
            f"{NET}/eth1/speed": "100000",
            f"{NET}/eth2/operstate": "up",
            f"{NET}/eth2/speed": "-1",  # a link with no speed reported
            f"{NET}/veth0/operstate": "up",
            f"{NET}/veth0/speed": "10000",
            f"{NET}/eth3/operstate": "up",
            f"{NET}/eth3/speed": "25000",
        },
        {
            NET: ["eth0", "eth1", "eth2", "eth3", "lo", "veth0"],
            **{f"{NET}/eth{i}/device": ["vendor"] for i in range(4)},
        },
    )
    assert node_facts.nic_rates(probes) == (100e9 / 8, 25e9 / 8)


@pytest.mark.parametrize(
    ("capability", "arch"),
    [((7, 0), "volta"), ((8, 0), "ampere"), ((9, 0), "hopper"), ((8, 6), None), ((10, 0), None)],
)
def test_generations_the_model_has_constants_for(capability: tuple[int, int], arch: str) -> None:
    assert node_facts.arch_of(capability) == arch
    assert node_facts.arch_of(None) is None


@pytest.mark.parametrize(
    ("matrix", "name", "nvlink"),
    [
        ([[0, 18, 18], [18, 0, 18], [18, 18, 0]], None, True),
        ([[0, 4, 0], [4, 0, 4], [0, 4, 0]], "NVIDIA A100-SXM4-80GB", False),  # a pair without
        ([[0]], "NVIDIA H100 80GB HBM3", True),  # one GPU per process: by its name
        (None, "NVIDIA A100-SXM4-80GB", True),
        (None, "NVIDIA H200", True),
        (None, "NVIDIA H100 PCIe", False),
        (None, "NVIDIA H100 NVL", False),
        (None, "Tesla T4", None),
        (None, None, None),
    ],
)
def test_nvlink_from_the_device(
    matrix: list[list[int]] | None, name: str | None, nvlink: bool
) -> None:
    assert node_facts.nvlink_of(matrix, name) is nvlink


def test_fairring_node_names_a_node_type_none_or_detect() -> None:
    facts = node_facts.from_env({"FAIRRING_NODE": "A100-4x200G"}, IB_MACHINE)
    assert facts == NodeFacts(
        "ampere", True, (25e9,) * 4, 230e9, False, source="FAIRRING_NODE=a100-4x200g", cpu="amd"
    )
    assert node_facts.from_env({"FAIRRING_NODE": "none"}).missing()
    assert node_facts.from_env({}, IB_MACHINE) == node_facts.detect(IB_MACHINE)
    assert node_facts.from_env({"FAIRRING_NODE": "detect"}, IB_MACHINE).source == "detected"
    with pytest.raises(ValueError, match=r"FAIRRING_NODE='dgx' is neither a node type"):
        node_facts.from_env({"FAIRRING_NODE": "dgx"})


def _file(tmp_path: Path, data: object) -> str:
    path = tmp_path / "node.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_fairring_node_file(tmp_path: Path) -> None:
    path = _file(tmp_path, {"arch": "hopper", "nics": ["400gbit", "200gbit"], "nvls": False})
    facts = node_facts.from_env({"FAIRRING_NODE": path})
    assert (facts.arch, facts.nvlink, facts.nic_rates, facts.nvls) == (
        "hopper",
        True,
        (50e9, 25e9),
        False,
    )
    given = {"arch": "ampere", "nic": "200gbit", "nics_per_machine": 4, "intra": "230GB/s"}
    a100 = node_facts.from_env({"FAIRRING_NODE": "a100-4x200g"})
    # Without its CPU the file describes another machine than the node type's (AMD) ...
    assert not node_facts.from_file(_file(tmp_path, given)).same_machine_as(a100)
    # ... and with it the same.
    same = node_facts.from_file(_file(tmp_path, {**given, "cpu": "amd"}))
    assert same.same_machine_as(a100) and same.source != a100.source


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{not json", "cannot read the facts file as JSON"),
        ([1, 2], "expected a JSON object"),
        ({"arch": "hopper", "nics": ["400gbit"], "gpus": 8}, r"unknown field\(s\) \['gpus'\]"),
        ({"arch": "blackwell", "nics": ["400gbit"]}, "'arch' is 'blackwell'"),
        ({"arch": "hopper", "nics": []}, "'nics' must be a non-empty list"),
        ({"arch": "hopper", "nics": ["400gbit"], "nic": "400gbit"}, "'nic' not given with it"),
        ({"arch": "hopper", "nics": ["fast"]}, "is not a rate"),
        ({"arch": "hopper", "nic": "400gbit", "nics_per_machine": 0}, "'nics_per_machine' is 0"),
        ({"arch": "hopper"}, "expected 'nics'"),
        ({"arch": "hopper", "nics": ["400gbit"], "nvlink": "yes"}, "'nvlink' is 'yes'"),
        ({"arch": "hopper", "nics": ["400gbit"], "cpu": "Intel"}, "'cpu' is 'Intel'"),
    ],
)
def test_bad_fairring_node_file(tmp_path: Path, data: object, message: str) -> None:
    path = _file(tmp_path, data)
    with pytest.raises(ValueError, match=message) as error:
        node_facts.from_env({"FAIRRING_NODE": path})
    assert f"FAIRRING_NODE='{path}'" in str(error.value)


def test_the_models_machine_uses_the_fastest_nic_per_gpu() -> None:
    facts = NodeFacts("hopper", True, (50e9, 50e9, 25e9), source="test")
    two = facts.gpu_node(2)
    assert two is not None and two.inter == pytest.approx(2 * 50e9 * 0.94, rel=1e-12)
    eight = facts.gpu_node(8)
    assert eight is not None and eight.inter == pytest.approx(125e9 * 0.94, rel=1e-12)
    assert (eight.intra, eight.hbm, eight.channels, eight.nvls) == (370e9, 3.35e12, 16, True)
    assert NodeFacts("hopper", None, (50e9,)).gpu_node(8) is None
    assert NodeFacts("ampere", True, ()).gpu_node(8) is None
    assert NodeFacts(None, True, (50e9,)).gpu_node(8) is None


def test_merge_agrees_or_says_unknown() -> None:
    a100 = node_facts.from_env({"FAIRRING_NODE": "a100-4x200g"})
    job = node_facts.merge([a100] * 4, [0, 0, 1, 1])
    assert job.facts == a100 and job.gpu_node(2) == a100.gpu_node(2)
    # Machine 1's second NIC is down: its facts differ, and the job falls back to NCCL.
    degraded = NodeFacts("ampere", True, (25e9,) * 3, 230e9, False, source="detected")
    job = node_facts.merge([a100, a100, degraded, degraded], [0, 0, 1, 1])
    assert job.facts is None and job.gpu_node(2) is None
    assert "rank 2 on machine 1: ampere, NVLink True, 200G, 200G, 200G" in job.reason
    unknown = node_facts.merge([node_facts.UNKNOWN] * 2, [0, 1])
    assert unknown.facts is None and "the GPU generation" in unknown.reason
    with pytest.raises(ValueError, match="2 ranks' facts for 3 ranks"):
        node_facts.merge([a100, a100], [0, 0, 1])


def test_facts_travel_as_json_and_make_the_node_types_plan() -> None:
    facts = node_facts.from_env({"FAIRRING_NODE": "a100-4x200g"})
    published = [NodeFacts.from_json(facts.to_json()) for _ in range(16)]
    job = node_facts.merge(published, [r // 8 for r in range(16)])
    node = job.gpu_node(8)
    assert node is not None
    made = plan_allreduce(node, 2, Config())
    assert made.rows == plan_allreduce(NODE_TYPES["a100-4x200g"], 2, Config()).rows


def test_merge_does_not_depend_on_which_rank_comes_first(tmp_path: Path) -> None:
    # Rank 0's facts are compared with every other rank's; the job's answer must be the
    # same with the ranks swapped: unknown where any machine differs, and where all
    # agree the same machine for the model, whichever rank's source names it.
    a100 = node_facts.from_env({"FAIRRING_NODE": "a100-4x200g"})
    from_file = node_facts.from_file(
        _file(tmp_path, {"arch": "ampere", "nic": "200gbit", "nics_per_machine": 4,
                         "intra": "230GB/s", "cpu": "amd"})
    )  # fmt: skip
    degraded = NodeFacts("ampere", True, (25e9,) * 3, 230e9, False, cpu="amd")
    intel = dataclasses.replace(a100, cpu="intel")
    for odd in (degraded, intel):
        for order in ([a100, a100, odd], [odd, a100, a100], [a100, odd, a100]):
            job = node_facts.merge(order, [0, 1, 2])
            assert job.facts is None and job.gpu_node(8) is None, order
    agree, swapped = (node_facts.merge(f, [0, 1]) for f in ([a100, from_file], [from_file, a100]))
    assert agree.facts is not None and swapped.facts is not None
    nodes = [job.gpu_node(8) for job in (agree, swapped)]
    assert nodes[0] is not None and nodes[1] is not None
    assert dataclasses.replace(nodes[0], name="") == dataclasses.replace(nodes[1], name="")


@pytest.mark.parametrize(
    ("cpuinfo", "vendor"),
    [
        ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n", "intel"),
        ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n", "amd"),
        ("processor\t: 0\nvendor_id\t: HygonGenuine\n", "other"),
        ("processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n", "other"),  # Arm
        ("", None),
        (None, None),
    ],
)
def test_cpu_vendor_from_proc_cpuinfo(cpuinfo: str | None, vendor: str | None) -> None:
    assert node_facts.cpu_vendor(cpuinfo) == vendor
    files = {} if cpuinfo is None else {"/proc/cpuinfo": cpuinfo}
    probes = fake_sysfs(files, {}, capability=lambda: (8, 0), nvlink_matrix=lambda: None,
                        device_name=lambda: None)  # fmt: skip
    assert node_facts.detect(probes).cpu == vendor


def test_the_cpu_reaches_the_model() -> None:
    # An unknown vendor is no gap (the model then takes the figures that favour NCCL);
    # a known one is the node's.
    amd = NodeFacts("ampere", True, (25e9,) * 8, cpu="amd").gpu_node(8)
    unknown = NodeFacts("ampere", True, (25e9,) * 8).gpu_node(8)
    assert amd is not None and unknown is not None
    assert (amd.cpu, unknown.cpu) == ("amd", "unknown")
    typed = node_facts.from_env({"FAIRRING_NODE": "h100-8x400g"}).gpu_node(8)
    assert typed is not None and typed.cpu == NODE_TYPES["h100-8x400g"].cpu == "intel"
