"""The Fairring seed's setting (../shared/seeds/fairring-readme.txt), for the model.

Fairring (FAIR, Nov 2021) ran on V100 machines of 8 GPUs on InfiniBand, against NCCL of
that time, and published three microbenchmarks: one allreduce of 1-100 MiB on 8
machines; 64 buckets of 25 MiB with limited parallelism; and 64 x 25 MiB in flight on 1
to 32 machines, with fixed slices and with slices growing with M. Its findings: NCCL is
faster up to about 6 MiB, fairring 43% faster at 100 MiB; slower than NCCL on one
machine; about 2x NCCL at peak; behind NCCL past 128 GPUs unless the slice grows.

Parameters, with sources (fairring_pg.model.nodes.V100_4X100G for the machine):
- NCCL 2.11.4-1's tuning constants (the release of Nov 2021);
- the machine: DGX-1 class, 8 x V100 SXM2 on NVLink 2.0, 4 x EDR 100 Gb/s;
- Fairring's implementation: NCCL for the machine's reduce-scatter and all-gather,
  TensorPipe for the rail exchange, each shard a message driven by a CPU thread, no
  single-machine path, 25 MiB slices (FAIRRING_SLICE_SIZE's default), no scaling.
The one figure without a source: what a message costs that CPU thread. The seed
suspects it ("possibly being bottlenecked on CPU") but gives no number; 20 us is
assumed (this host measures 35 us for one message's wake-up to wake-up on loopback,
calibration.measure_loopback). The decline past 128 GPUs appears for any cost from
13 to 25 us; below 13 us fairring never falls behind in this range, above 25 us it
falls behind at 128 GPUs already (tests/test_model.py checks both ends).
"""

from __future__ import annotations

import dataclasses

from fairring_pg.config import MIB, Config
from fairring_pg.model import nccl
from fairring_pg.model.composition import MESSAGES, Implementation
from fairring_pg.model.gpu import GpuPrediction, predict_gpu
from fairring_pg.model.nodes import V100_4X100G

MESSAGE_S = 20e-6
# "max parallelism" in the seed's scaling runs; its parallelism sweep found the sweet
# spot at about 4 buckets in flight.
IN_FLIGHT_SLICES = 8

SEED = Implementation(
    name="the Fairring seed (TensorPipe rail exchange, CPU-driven)",
    message_s=MESSAGE_S,
    exchanges=(MESSAGES,),
    overlap=False,
    planned=False,
    single_machine_allreduce=False,
    proxy_per_lane=False,
)


def seed_config(slice_size: int = 25 * MIB, lanes: int = IN_FLIGHT_SLICES) -> Config:
    """Fairring's knobs: fixed 25 MiB slices, no direct path, staging for ``lanes``."""
    return Config(
        slice_size=slice_size,
        slice_scaling=False,
        direct_below=0,
        lanes=lanes,
        total_memory=1 << 40,  # the lanes, not the memory, bound the parallelism
    )


def predict(
    machines: int,
    size: int,
    in_flight: int = 1,
    slice_size: int = 25 * MIB,
    lanes: int = IN_FLIGHT_SLICES,
    message_s: float = MESSAGE_S,
) -> GpuPrediction:
    impl = SEED if message_s == MESSAGE_S else dataclasses.replace(SEED, message_s=message_s)
    return predict_gpu(
        V100_4X100G,
        machines,
        size,
        in_flight,
        seed_config(slice_size, lanes),
        nccl.NCCL_2_11,
        impl,
    )
