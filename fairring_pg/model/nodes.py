"""GPU machines: what a node's links can do, with where each figure comes from.

Bandwidths are bytes/s. ``intra`` is the allreduce bus bandwidth NCCL reaches inside one
machine (its ring over NVLink), ``nic`` a NIC's nominal rate and ``nic_efficiency`` the
share of it a collective's payload gets. ``cpu`` is the hosts' CPU vendor, which NCCL's
own figures depend on (fairring_pg.model.nccl) and so does fairring's cost per rail
message (fairring_pg.model.alltoall).
"""

from __future__ import annotations

from dataclasses import dataclass

from fairring_pg.model.nccl import AMD, CPU_VENDORS, INTEL, UNKNOWN_CPU

# NDR 400G InfiniBand moves about 46-48 GB/s of payload per NIC in collective
# benchmarks (published figures for H100 clusters): 0.94 of 50 GB/s. The same
# share is assumed for HDR 200G and EDR 100G.
IB_EFFICIENCY = 0.94


@dataclass(frozen=True)
class GpuNode:
    name: str
    gpus: int
    arch: str  # volta, ampere, hopper: which of NCCL's per-architecture constants apply
    nic: float  # nominal bytes/s of one NIC, each way
    nics: int
    intra: float  # allreduce bus bandwidth inside the machine
    hbm: float  # GPU memory bandwidth (the reduction kernel of the five steps)
    channels: int  # NCCL channels per communicator (only NCCL's per-channel caps use it)
    nvls: bool = False  # NVLink SHARP (Hopper HGX with NVSwitch): NCCL's NVLS tree
    nic_efficiency: float = IB_EFFICIENCY
    sources: tuple[str, ...] = ()
    cpu: str = UNKNOWN_CPU  # intel, amd, other (Arm, POWER), or unknown

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.nics < 1:
            raise ValueError(f"{self.name}: needs at least one GPU and one NIC")
        for field_name in ("nic", "intra", "hbm", "nic_efficiency"):
            if getattr(self, field_name) <= 0:
                raise ValueError(f"{self.name}: {field_name} must be positive")
        if self.cpu not in (*CPU_VENDORS, UNKNOWN_CPU):
            raise ValueError(f"{self.name}: cpu {self.cpu!r} is not one of {CPU_VENDORS}")

    @property
    def inter(self) -> float:
        """Payload bytes/s all of the machine's NICs move together, each way; a GPU drives
        one NIC at a time (its rail), so NICs beyond one per GPU stay idle."""
        return min(self.nics, self.gpus) * self.nic * self.nic_efficiency

    def describe(self) -> str:
        return (
            f"{self.gpus} x {self.arch} GPUs, {self.nics} x {self.nic * 8 / 1e9:.0f} Gbit/s NICs "
            f"({self.inter / 1e9:.0f} GB/s of payload per machine, {self.nic_efficiency:.0%} of "
            f"nominal), intra-machine allreduce {self.intra / 1e9:.0f} GB/s, "
            f"{'an unknown' if self.cpu == UNKNOWN_CPU else self.cpu} CPU"
        )


H100_8X400G = GpuNode(
    name="H100 + 8x400G",
    gpus=8,
    arch="hopper",
    nic=400e9 / 8,
    nics=8,
    intra=370e9,
    hbm=3.35e12,
    channels=16,
    nvls=True,
    cpu=INTEL,
    sources=(
        "DGX H100 / HGX H100: 8 x H100 SXM5, NVSwitch, 8 x ConnectX-7 NDR 400 Gb/s, "
        "2 x Intel Xeon Platinum 8480C (NVIDIA DGX H100 datasheet)",
        "NVLink effective allreduce bus bandwidth about 370 GB/s; NDR 46-48 GB/s per NIC; "
        "2 x 8 H100 allreduce busbw about 435-470 GB/s (published figures)",
        "H100 SXM5 HBM3 3.35 TB/s (NVIDIA H100 datasheet)",
    ),
)

H100_2X200G = GpuNode(
    name="H100 + 2x200G",
    gpus=8,
    arch="hopper",
    nic=200e9 / 8,
    nics=2,
    intra=370e9,
    hbm=3.35e12,
    channels=16,
    nvls=True,
    cpu=INTEL,
    sources=(
        "an HGX H100 with two 200 Gb/s NICs (cloud and Ethernet clusters)",
        "NVLink and the Intel host as H100 + 8x400G (fairring-plan --cpu amd for AMD hosts); "
        "0.94 of the NICs' rate assumed",
    ),
)

A100_4X200G = GpuNode(
    name="A100 + 4x200G",
    gpus=8,
    arch="ampere",
    nic=200e9 / 8,
    nics=4,
    intra=230e9,
    hbm=2.0e12,
    channels=16,
    cpu=AMD,
    sources=(
        "HGX A100: 8 x A100 SXM4 on NVSwitch (600 GB/s NVLink per GPU), here 4 x HDR 200 Gb/s; "
        "2 x AMD EPYC 7742 as in DGX A100 (NVIDIA DGX A100 datasheet)",
        "allreduce bus bandwidth inside the machine taken as 230 GB/s, under the 235 GB/s "
        "cap NCCL 2.11's tuning model puts on A100 (src/graph/tuning.cc)",
        "A100 80GB HBM2e 2.0 TB/s (NVIDIA A100 datasheet)",
    ),
)

V100_4X100G = GpuNode(
    name="V100 + 4x100G",
    gpus=8,
    arch="volta",
    nic=100e9 / 8,
    nics=4,
    intra=130e9,
    hbm=0.9e12,
    channels=8,
    cpu=INTEL,
    sources=(
        "DGX-1 (V100): 8 x V100 SXM2 in a hybrid cube-mesh of NVLink 2.0 (6 links of 25 GB/s "
        "per direction per GPU), 4 x EDR InfiniBand 100 Gb/s, 2 x Intel Xeon E5-2698 v4 "
        "(NVIDIA DGX-1 datasheet)",
        "allreduce bus bandwidth inside the machine taken as 130 GB/s (about 85% of the 150 GB/s "
        "a GPU's six links carry per direction)",
        "V100 SXM2 HBM2 900 GB/s (NVIDIA V100 datasheet)",
    ),
)

NODE_TYPES = {
    "h100-8x400g": H100_8X400G,
    "h100-2x200g": H100_2X200G,
    "a100-4x200g": A100_4X200G,
    "v100-4x100g": V100_4X100G,
}
