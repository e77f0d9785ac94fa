"""The CUDA allreduce's plan for a job: rank 0 makes it from the machines' published
facts (fairring_pg.cuda.node_facts, through the model's fairring_pg.model.cuda_plan) and
caps the CTAs of the sub-group communicators so that every communicator of one composed
call fits on the GPU at once; every rank runs the very plan rank 0 published.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from fairring_pg.config import Config
from fairring_pg.cuda import node_facts
from fairring_pg.cuda.decision import GpuFacts
from fairring_pg.model.cuda_plan import (
    TEST_PLAN_VARIABLE,
    CudaPlan,
    forced_plan,
    only_nccl,
    plan_allreduce,
)
from fairring_pg.startup import wait_for
from fairring_pg.topology import Topology

_PLAN_KEY = "fairring/cuda_plan"
_log = logging.getLogger("fairring_pg")

# NCCL launches one CTA (thread block) per channel, and a communicator has at most
# MAXCHANNELS of them (64 since NCCL 2.19: src/include/device.h), fewer where
# NCCL_MAX_CTAS or NCCL_MAX_NCHANNELS says so.
NCCL_MAX_CHANNELS = 64


def world_ctas(environ: dict[str, str] | None = None) -> int:
    """The most CTAs the world communicator (the user's, not capped by fairring) runs."""
    env = os.environ if environ is None else environ
    limits = [NCCL_MAX_CHANNELS]
    for name in ("NCCL_MAX_CTAS", "NCCL_MAX_NCHANNELS"):
        raw = env.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            limits.append(int(raw))
    return min(limits)


def processes_per_gpu(facts: Sequence[GpuFacts]) -> int:
    """How many ranks share one GPU at most: ranks that see exactly one GPU and the
    same one (simulated machines on one GPU, NCCL_HOSTID); a rank that sees several
    uses one of its own."""
    pinned: dict[str, int] = {}
    for f in facts:
        if len(f.gpus) == 1:
            pinned[f.gpus[0]] = pinned.get(f.gpus[0], 0) + 1
    return max(pinned.values(), default=1)


def co_resident_ctas(sms: int, sharing: int, world: int, lanes: int, local_size: int) -> int:
    """The CTAs each sub-group communicator may use so that every communicator one
    composed call keeps busy at once (the world one, for its tails, at up to ``world``
    CTAs; ``lanes`` rail ones; two local ones where ``local_size`` > 1) fits on its
    share of the GPU at one CTA per streaming multiprocessor, however the scheduler
    places them: NCCL's kernels spin until their peers arrive, so one that cannot be
    scheduled while the others spin could wait for ever (docs/design.md, "Why it cannot
    deadlock"). 0 or less: they cannot all fit."""
    subgroups = lanes + (2 if local_size > 1 else 0)
    return (sms // max(1, sharing) - world) // subgroups


def plan_for_job(
    store: Any,
    topology: Topology,
    config: Config,
    timeout: timedelta,
    facts: Sequence[GpuFacts],
) -> tuple[CudaPlan, int]:
    """The CUDA allreduce's plan (fairring_pg.model.cuda_plan): what a call of each size
    runs, and the CTAs each sub-group communicator may use (0: no cap, where no rank
    has a GPU: the test vehicles). Rank 0 makes both from the machines' published
    facts and publishes them; every rank runs the very table it published, so that
    every rank takes the same path for the same call (no floating-point result of
    another machine enters). Said once in the log."""
    M, L = topology.num_machines, topology.local_size
    if topology.rank == 0:
        if config.test_cuda_plan is not None:
            plan = forced_plan(config.test_cuda_plan, M, config, L)
            why = f"given by {TEST_PLAN_VARIABLE}"
        else:
            machines = [
                node_facts.NodeFacts.from_json(f.node) if f.node else node_facts.UNKNOWN
                for f in facts
            ]
            job = node_facts.merge(machines, topology.machine_of)
            # auto measures what the model is not sure of; model keeps its verdict.
            measured = config.cuda_allreduce == "auto"
            plan = plan_allreduce(job.gpu_node(L), M, config, local_size=L, measured=measured)
            why = job.reason
        plan, ctas = _fit_on_the_gpu(plan, facts, config.lanes, L)
        store.set(_PLAN_KEY, json.dumps({"plan": plan.to_json(), "ctas": ctas}))
        _log.info(
            "%s\n  node facts: %s; sub-group CTAs: %s", plan.describe(), why, ctas or "uncapped"
        )
    wait_for(store, [_PLAN_KEY], timeout, "waiting for rank 0's CUDA allreduce plan")
    published = json.loads(store.get(_PLAN_KEY))
    return CudaPlan.from_json(published["plan"]), int(published["ctas"])


def _fit_on_the_gpu(
    plan: CudaPlan, facts: Sequence[GpuFacts], lanes: int, local_size: int
) -> tuple[CudaPlan, int]:
    sms = min((f.sms for f in facts if f.sms), default=0)
    if not plan.composes or sms == 0:
        return plan, 0
    sharing, world = processes_per_gpu(facts), world_ctas()
    ctas = co_resident_ctas(sms, sharing, world, lanes, local_size)
    if ctas >= 1:
        return plan, ctas
    why = (
        f"the GPU cannot hold a composed call's communicators at once ({sms} SMs for "
        f"{sharing} process(es), {world} CTAs for the world communicator, {lanes} lane(s)"
        f"{' and 2 local groups' if local_size > 1 else ''}: set NCCL_MAX_CTAS lower)"
    )
    return only_nccl(plan.machines, plan.local_size, plan.node, why), 0
