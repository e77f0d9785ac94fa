"""What a machine is made of, as far as the CUDA allreduce's plan needs to know.

``from_env`` gives this process's answer once: ``FAIRRING_NODE`` names a node type of
``fairring-plan`` (``h100-8x400g``, ...), a JSON file with the facts, ``none`` (unknown:
NCCL's own allreduce everywhere), or ``detect`` (the default): the GPU's generation from
its compute capability, NVLink from the device (torch's NVLink matrix where it sees
several GPUs, else the device's name: SXM parts sit on NVLink), and the NICs NCCL would
use with their rates from sysfs (InfiniBand/RoCE ports that are up; without any, the
physical network interfaces that are up), and the CPU's vendor from /proc/cpuinfo
(NCCL's own figures and fairring's cost per rail message depend on it). Every probe is
a field of ``Probes``, so tests replace them.

Every rank publishes its facts; ``merge`` turns all of them, in rank order, into the
job's answer, the same on every rank that computes it: one set of facts where every
machine agrees, else unknown (then NCCL runs every allreduce: the composition's gain
depends on the slowest machine's links, and a machine whose facts differ may be one
whose NIC is down). ``JobFacts.gpu_node`` is what the model takes
(fairring_pg.model.cuda_plan.plan_allreduce).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

from fairring_pg.config import Config
from fairring_pg.model.nccl import AMD, CPU_VENDORS, INTEL, OTHER_CPU, UNKNOWN_CPU
from fairring_pg.model.nodes import IB_EFFICIENCY, NODE_TYPES, GpuNode
from fairring_pg.model.units import parse_rate

ENV = "FAIRRING_NODE"
ARCHS = ("volta", "ampere", "hopper")
# What the model takes for a generation's machine when only its generation is known:
# the allreduce bus bandwidth inside an NVLink machine, HBM, NCCL's channels (the
# figures and sources of fairring_pg.model.nodes).
_BY_ARCH = {
    "volta": NODE_TYPES["v100-4x100g"],
    "ampere": NODE_TYPES["a100-4x200g"],
    "hopper": NODE_TYPES["h100-8x400g"],
}
_SYS_IB = "/sys/class/infiniband"
_SYS_NET = "/sys/class/net"
_CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class NodeFacts:
    """One machine, as one rank sees it. None: unknown."""

    arch: str | None = None  # volta, ampere, hopper
    nvlink: bool | None = None  # the machine's GPUs all joined by NVLink
    nic_rates: tuple[float, ...] = ()  # nominal bytes/s of each NIC NCCL would use
    intra: float | None = None  # allreduce bus bandwidth inside the machine (else by arch)
    nvls: bool | None = None  # NVLink SHARP (else: Hopper on NVLink)
    source: str = "detected"
    cpu: str | None = None  # the CPU's vendor: intel, amd, other

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> NodeFacts:
        data = json.loads(text)
        data["nic_rates"] = tuple(data.get("nic_rates", ()))
        return cls(**data)

    def same_machine_as(self, other: NodeFacts) -> bool:
        """The same facts, wherever they came from."""
        return (self.arch, self.nvlink, self.nic_rates, self.intra, self.nvls, self.cpu) == (
            other.arch,
            other.nvlink,
            other.nic_rates,
            other.intra,
            other.nvls,
            other.cpu,
        )

    def missing(self) -> list[str]:
        """What the model needs and these facts lack."""
        gaps = []
        if self.arch not in ARCHS:
            gaps.append("the GPU generation (Volta, Ampere or Hopper)")
        if self.nvlink is not True:
            gaps.append("NVLink between the machine's GPUs")
        if not self.nic_rates:
            gaps.append("the NICs and their rates")
        return gaps

    def gpu_node(self, local_size: int) -> GpuNode | None:
        """The model's machine for L = ``local_size`` GPUs per machine; None where a
        fact is missing. A GPU drives one NIC at a time (its rail), so the L fastest
        NICs are the machine's. An unknown CPU vendor is no gap: the model then takes
        the figures that favour NCCL (fairring_pg.model.alltoall)."""
        if self.missing() or self.arch is None:
            return None
        base = _BY_ARCH[self.arch]
        used = sorted(self.nic_rates, reverse=True)[: max(1, local_size)]
        return GpuNode(
            name=f"{self.source}: {local_size} x {self.arch}, "
            + ", ".join(f"{r * 8 / 1e9:g}G" for r in used),
            gpus=local_size,
            arch=self.arch,
            nic=sum(used) / len(used),
            nics=len(used),
            intra=self.intra or base.intra,
            hbm=base.hbm,
            channels=base.channels,
            nvls=bool(_nvls(self.arch, self.nvlink, self.nvls)) and local_size > 1,
            nic_efficiency=IB_EFFICIENCY,
            cpu=self.cpu or UNKNOWN_CPU,
        )


UNKNOWN = NodeFacts(source="unknown")


@dataclass(frozen=True)
class JobFacts:
    """The job's machines, agreed: ``facts`` None where they are unknown or differ."""

    facts: NodeFacts | None
    reason: str

    def gpu_node(self, local_size: int) -> GpuNode | None:
        return self.facts.gpu_node(local_size) if self.facts else None


# --- probes -----------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _list(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _capability() -> tuple[int, int] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())  # type: ignore[return-value]


def _nvlink_matrix() -> list[list[int]] | None:
    """Links between each pair of the GPUs this process sees (torch, through NVML)."""
    try:
        from torch._C._autograd import DeviceType
        from torch._C._distributed_c10d import _detect_dma_connectivity

        return [list(row) for row in _detect_dma_connectivity(DeviceType.CUDA, "nvlink").matrix]
    except Exception:  # no CUDA, no NVML, an older torch: it cannot tell
        return None


def _device_name() -> str | None:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def cpu_vendor(cpuinfo: str | None) -> str | None:
    """The vendor NCCL's topology would report (ncclTopoCpuType): Intel and AMD by the
    x86 ``vendor_id``, other (Arm, POWER) where /proc/cpuinfo has none; None unread."""
    if cpuinfo is None:
        return None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return {"GenuineIntel": INTEL, "AuthenticAMD": AMD}.get(value.strip(), OTHER_CPU)
    return OTHER_CPU if cpuinfo.strip() else None


@dataclass(frozen=True)
class Probes:
    read: Callable[[str], str | None] = _read
    listdir: Callable[[str], list[str]] = _list
    capability: Callable[[], tuple[int, int] | None] = _capability
    nvlink_matrix: Callable[[], list[list[int]] | None] = _nvlink_matrix
    device_name: Callable[[], str | None] = _device_name


def detect(probes: Probes = Probes()) -> NodeFacts:
    arch = arch_of(probes.capability())
    nvlink = nvlink_of(probes.nvlink_matrix(), probes.device_name())
    return NodeFacts(
        arch=arch,
        nvlink=nvlink,
        nic_rates=nic_rates(probes),
        nvls=_nvls(arch, nvlink, None),
        source="detected",
        cpu=cpu_vendor(probes.read(_CPUINFO)),
    )


def _nvls(arch: str | None, nvlink: bool | None, given: bool | None) -> bool | None:
    """NVLink SHARP where not said: Hopper on NVLink (HGX H100 and H200 have the
    NVSwitches); assuming it makes NCCL's side faster, never fairring's."""
    if given is not None or arch is None or nvlink is None:
        return given
    return arch == "hopper" and nvlink


def arch_of(capability: tuple[int, int] | None) -> str | None:
    """The model's generations: sm70 Volta, sm80 Ampere (A100), sm90 Hopper; others
    (consumer Ampere and Ada, Blackwell) have no constants in the model."""
    return {(7, 0): "volta", (8, 0): "ampere", (9, 0): "hopper"}.get(capability or (0, 0))


def nvlink_of(matrix: list[list[int]] | None, name: str | None) -> bool | None:
    """True where every pair of visible GPUs has NVLink, False where a pair has none;
    with one visible GPU (a process per GPU) the device's name: an SXM part (H100's
    "HBM3" and H200 are SXM) sits on NVLink; else unknown."""
    if matrix and len(matrix) > 1:
        return all(
            matrix[i][j] > 0 for i in range(len(matrix)) for j in range(len(matrix)) if i != j
        )
    if name is None:
        return None
    upper = name.upper()
    if "PCIE" in upper or " NVL" in upper:
        return False
    if "SXM" in upper or "H200" in upper or ("H100" in upper and "HBM3" in upper):
        return True
    return None


_IB_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")


def nic_rates(probes: Probes = Probes()) -> tuple[float, ...]:
    """Nominal bytes/s of each NIC NCCL would use: the active InfiniBand/RoCE ports
    (NCCL's IB transport takes them where any exist), else the physical interfaces that
    are up (its socket transport), sorted fastest first."""
    rates: list[float] = []
    for device in probes.listdir(_SYS_IB):
        for port in probes.listdir(f"{_SYS_IB}/{device}/ports"):
            base = f"{_SYS_IB}/{device}/ports/{port}"
            state = probes.read(f"{base}/state") or ""
            match = _IB_RATE.match(probes.read(f"{base}/rate") or "")
            if "ACTIVE" in state and match:
                rates.append(float(match.group(1)) * 1e9 / 8)
    if not rates:
        for iface in probes.listdir(_SYS_NET):
            base = f"{_SYS_NET}/{iface}"
            if iface == "lo" or not probes.listdir(f"{base}/device"):
                continue  # loopback, or virtual (bridges, veth, tunnels): no device
            speed = probes.read(f"{base}/speed")
            if probes.read(f"{base}/operstate") == "up" and speed and speed.lstrip("-").isdigit():
                if int(speed) > 0:
                    rates.append(int(speed) * 1e6 / 8)
    return tuple(sorted(rates, reverse=True))


# --- FAIRRING_NODE ----------------------------------------------------------------

_FILE_FIELDS = ("arch", "nvlink", "nics", "nic", "nics_per_machine", "intra", "nvls", "cpu")


def from_env(environ: Mapping[str, str] = os.environ, probes: Probes = Probes()) -> NodeFacts:
    """This process's facts: ``FAIRRING_NODE`` if set, else detected."""
    raw = Config.read("node", environ)
    if raw.lower() == "detect":
        return detect(probes)
    value = raw.strip()
    if value.lower() in ("none", "unknown"):
        return NodeFacts(source=f"{ENV}={value}")
    if value.lower() in NODE_TYPES:
        node = NODE_TYPES[value.lower()]
        return NodeFacts(
            arch=node.arch,
            nvlink=True,
            nic_rates=(node.nic,) * node.nics,
            intra=node.intra,
            nvls=node.nvls,
            source=f"{ENV}={value.lower()}",
            cpu=node.cpu if node.cpu in CPU_VENDORS else None,
        )
    if not os.path.isfile(value):
        raise ValueError(
            f"{ENV}={raw!r} is neither a node type ({', '.join(sorted(NODE_TYPES))}), 'detect', "
            "'none', nor an existing file of facts (JSON: arch, nvlink, nics or nic and "
            "nics_per_machine, optionally intra, nvls and cpu)"
        )
    return from_file(value)


def from_file(path: str) -> NodeFacts:
    """Facts from a JSON file: {"arch": "hopper", "nvlink": true, "nics": ["400gbit", ...]}
    or {"nic": "400gbit", "nics_per_machine": 8}; optionally "intra": "370GB/s",
    "nvls": true and "cpu": "intel" (or "amd", "other")."""
    where = f"{ENV}={path!r}"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: cannot read the facts file as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object with {', '.join(_FILE_FIELDS)}")
    unknown = sorted(set(data) - set(_FILE_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; expected {', '.join(_FILE_FIELDS)}")
    arch = data.get("arch")
    if arch not in ARCHS:
        raise ValueError(f"{where}: 'arch' is {arch!r}; expected one of {', '.join(ARCHS)}")
    for flag in ("nvlink", "nvls"):
        if flag in data and not isinstance(data[flag], bool):
            raise ValueError(f"{where}: '{flag}' is {data[flag]!r}; expected true or false")
    if "nics" in data:
        if not isinstance(data["nics"], list) or not data["nics"] or "nic" in data:
            raise ValueError(
                f"{where}: 'nics' must be a non-empty list of rates (\"400gbit\", ...), and "
                "'nic' not given with it"
            )
        rates = tuple(parse_rate(f"{where}: a NIC", str(r)) for r in data["nics"])
    elif "nic" in data:
        count = data.get("nics_per_machine", 1)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(
                f"{where}: 'nics_per_machine' is {count!r}; expected a whole number >= 1"
            )
        rates = (parse_rate(f"{where}: 'nic'", str(data["nic"])),) * count
    else:
        raise ValueError(
            f"{where}: expected 'nics' (a list of rates) or 'nic' and 'nics_per_machine'"
        )
    cpu = data.get("cpu")
    if cpu is not None and cpu not in CPU_VENDORS:
        raise ValueError(f"{where}: 'cpu' is {cpu!r}; expected one of {', '.join(CPU_VENDORS)}")
    intra = parse_rate(f"{where}: 'intra'", str(data["intra"])) if "intra" in data else None
    nvlink = data.get("nvlink", True)
    return NodeFacts(
        arch=arch,
        nvlink=nvlink,
        nic_rates=tuple(sorted(rates, reverse=True)),
        intra=intra,
        nvls=_nvls(arch, nvlink, data.get("nvls")),
        source=where,
        cpu=cpu,
    )


# --- the job's answer -------------------------------------------------------------


def merge(facts: Sequence[NodeFacts], machine_of: Sequence[int]) -> JobFacts:
    """The job's facts from every rank's (in rank order; ``machine_of[r]`` is rank r's
    machine): the facts where every rank's agree; else unknown, saying which machines
    differ or what is missing. A pure function of its arguments, so every rank that
    computes it from the same published facts gets the same answer."""
    if not facts or len(facts) != len(machine_of):
        raise ValueError(f"merge: {len(facts)} ranks' facts for {len(machine_of)} ranks")
    first = facts[0]
    for rank, theirs in enumerate(facts):
        if not theirs.same_machine_as(first):
            return JobFacts(
                None,
                f"the machines' facts differ (rank 0 on machine {machine_of[0]}: "
                f"{_show(first)}; rank {rank} on machine {machine_of[rank]}: {_show(theirs)}): "
                "NCCL's allreduce",
            )
    gaps = first.missing()
    if gaps:
        return JobFacts(None, f"unknown: {'; '.join(gaps)} ({first.source}): NCCL's allreduce")
    return JobFacts(first, f"{first.source}, the same on every rank")


def _show(facts: NodeFacts) -> str:
    nics = ", ".join(f"{r * 8 / 1e9:g}G" for r in facts.nic_rates) or "no NICs"
    cpu = f"{facts.cpu or 'unknown'} CPU"
    return f"{facts.arch or 'unknown GPU'}, NVLink {facts.nvlink}, {nics}, {cpu} ({facts.source})"


__all__ = [
    "ENV",
    "JobFacts",
    "NodeFacts",
    "Probes",
    "UNKNOWN",
    "cpu_vendor",
    "detect",
    "from_env",
    "from_file",
    "merge",
    "nic_rates",
]
