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
from fairring_pg.cuda.decision import GpuFacts, nccl_cta_variables
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
    return _world_bound(dict(nccl_cta_variables(env)))


def _world_bound(variables: dict[str, int]) -> int:
    limits = [NCCL_MAX_CHANNELS]
    limits += [variables[n] for n in ("NCCL_MAX_CTAS", "NCCL_MAX_NCHANNELS") if n in variables]
    floor = max(variables.get("NCCL_MIN_CTAS", 0), variables.get("NCCL_MIN_NCHANNELS", 0))
    return max(min(limits), floor)


def subgroup_bound(variables: dict[str, int], cap: int) -> int:
    """The most CTAs a sub-group communicator capped at ``cap`` (its config's max_ctas)
    runs in a process with NCCL's CTA ``variables``: NCCL lets NCCL_MAX_CTAS and
    NCCL_MIN_CTAS replace the config's max_ctas and min_ctas (NCCL's envConfigOverride
    in src/init.cc), and the channel variables bound the CTAs too."""
    bound = variables.get("NCCL_MAX_CTAS", cap)
    if "NCCL_MAX_NCHANNELS" in variables:
        bound = min(bound, variables["NCCL_MAX_NCHANNELS"])
    floor = max(variables.get("NCCL_MIN_CTAS", 0), variables.get("NCCL_MIN_NCHANNELS", 0))
    return max(bound, floor)


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
    wait_for(store, [_PLAN_KEY], timeout, "waiting for rank 0's CUDA allreduce plan", [0])
    published = json.loads(store.get(_PLAN_KEY))
    return CudaPlan.from_json(published["plan"]), int(published["ctas"])


def _fit_on_the_gpu(
    plan: CudaPlan, facts: Sequence[GpuFacts], lanes: int, local_size: int
) -> tuple[CudaPlan, int]:
    sms = min((f.sms for f in facts if f.sms), default=0)
    if not plan.composes or sms == 0:
        return plan, 0
    sharing = processes_per_gpu(facts)
    per_rank = [dict(f.nccl_ctas) for f in facts]
    world = max(_world_bound(v) for v in per_rank)
    ctas = co_resident_ctas(sms, sharing, world, lanes, local_size)
    subgroups = lanes + (2 if local_size > 1 else 0)
    share = sms // max(1, sharing)
    # Where the room is there, what NCCL will really run must fit too: a rank's
    # NCCL_MAX_CTAS or NCCL_MIN_CTAS replaces the cap given to its sub-groups.
    if ctas >= 1:
        over = [
            (rank, v)
            for rank, v in enumerate(per_rank)
            if _world_bound(v) + subgroups * subgroup_bound(v, ctas) > share
        ]
        if not over:
            return plan, ctas
        rank, variables = over[0]
        named = ", ".join(f"{k}={variables[k]}" for k in sorted(variables))
        most = share // (subgroups + 1)
        why = (
            f"rank {rank}'s {named} would replace the {ctas} CTAs fairring gives each of a "
            f"composed call's {subgroups} sub-group communicators, and then they and the "
            f"world communicator ({_world_bound(variables)} CTAs) cannot run at once on "
            f"{share} SMs (a deadlock NCCL cannot see); unset them, or keep NCCL_MAX_CTAS "
            f"at most {most} and NCCL_MIN_CTAS at most {ctas}"
        )
        return only_nccl(plan.machines, plan.local_size, plan.node, why), 0
    most = share // (subgroups + 1)
    why = (
        f"the GPU cannot hold a composed call's communicators at once ({sms} SMs for "
        f"{sharing} process(es), {world} CTAs for the world communicator, {lanes} lane(s)"
        f"{' and 2 local groups' if local_size > 1 else ''}; NCCL_MAX_CTAS at most {most} "
        "on every rank would leave room)"
    )
    return only_nccl(plan.machines, plan.local_size, plan.node, why), 0
