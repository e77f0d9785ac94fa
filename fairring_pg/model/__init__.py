"""A cost model of fairring's allreduce and of what it replaces (Gloo's ring on CPU,
NCCL's ring and tree on GPU), calibrated from this machine's primitives.

    from fairring_pg.model import CpuCluster, calibrate, predict_cpu
    p = calibrate(links=("1gbit",))
    cluster = CpuCluster(2, 2, 125e6, p.efficiency("1gbit"))
    predict_cpu(cluster, [25 << 20], p).speedup        # Gloo's time / fairring's

    from fairring_pg.model import NODE_TYPES, predict_gpu
    predict_gpu(NODE_TYPES["a100-4x200g"], machines=16, size=25 << 20, in_flight=4)

    from fairring_pg.model import plan_allreduce
    plan_allreduce(NODE_TYPES["a100-4x200g"], 16, Config()).row_for(25 << 20)

The formulas, parameters and validation are in docs/design.md, "The cost model";
`fairring-plan` (fairring_pg/tools/plan_command.py) is the command line. ``plan_allreduce`` is what
``FAIRRING_CUDA_ALLREDUCE=auto`` decides with (a table made once per group);
``prefer_fairring`` compares one prediction.
"""

from __future__ import annotations

from fairring_pg.model.calibration import Primitives, calibrate
from fairring_pg.model.composition import FAIRRING_PG, Implementation
from fairring_pg.model.cpu import CpuCluster, CpuPrediction, predict_cpu
from fairring_pg.model.cuda_plan import CudaPlan, PlanRow, plan_allreduce
from fairring_pg.model.gpu import GpuPrediction, predict_gpu
from fairring_pg.model.nodes import NODE_TYPES, GpuNode

__all__ = [
    "FAIRRING_PG",
    "NODE_TYPES",
    "CpuCluster",
    "CpuPrediction",
    "CudaPlan",
    "GpuNode",
    "GpuPrediction",
    "Implementation",
    "PlanRow",
    "Primitives",
    "calibrate",
    "plan_allreduce",
    "predict_cpu",
    "predict_gpu",
    "prefer_fairring",
]


def prefer_fairring(prediction: CpuPrediction | GpuPrediction, margin: float = 0.0) -> bool:
    """Whether the model expects fairring to beat the reference by more than ``margin``
    (a fraction of the reference's time)."""
    return prediction.fairring_s < prediction.reference_s * (1.0 - margin)
