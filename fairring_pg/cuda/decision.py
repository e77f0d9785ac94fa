"""The CUDA side of the creator: which group runs the other collectives on CUDA
tensors, and whether CUDA allreduces can be composed of NCCL sub-groups.

The choice changes what every CUDA collective does (NCCL on one rank and Gloo on
another hang each other), so it is made from facts every rank publishes through the
store, the same on every rank by construction, never from what one process sees:
``torch.cuda.device_count()`` differs with ``CUDA_VISIBLE_DEVICES`` (Slurm's
``--gpus-per-task=1`` shows each rank one GPU of eight). Each rank publishes the host
as NCCL sees it (``NCCL_HOSTID``, else the hostname; how several machines are simulated
on one GPU), whether it has CUDA and NCCL, and the UUIDs of the GPUs it sees (and, for
the plan file's shape, fairring_pg.measured, the GPUs' models and memory, its machine's
cores, its torch's and NCCL's versions); then :func:`decide` reads the same list on
every rank:

- no rank sees a GPU, or some do not: no CUDA delegate (a CUDA collective raises,
  saying which ranks have none);
- every rank has CUDA but only some have NCCL: ``init_process_group`` fails on every
  rank, naming them (a torch without NCCL beside one with it is a broken install);
- the ranks of a host see, together, fewer GPUs than they are (they really share one):
  NCCL refuses two ranks of a communicator on one GPU ("Duplicate GPU detected"), so
  CUDA collectives, allreduce included, go to Gloo (host copies), said once;
- otherwise NCCL: each rank can have a GPU of its own, whatever each one sees.

``FAIRRING_CUDA_DELEGATE`` (job-wide) overrides the last two: ``nccl`` or ``gloo``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fairring_pg.cuda import node_facts
from fairring_pg.startup import wait_for
from fairring_pg.topology import Topology

DELEGATE_VARIABLE = "FAIRRING_CUDA_DELEGATE"
_STORE_KEY = "fairring/gpu_facts/{rank}"


@dataclass(frozen=True)
class GpuFacts:
    """What one rank tells the others about its GPUs."""

    host: str  # the host as NCCL sees it
    cuda: bool  # torch.cuda.is_available() in that process
    nccl: bool  # its torch has NCCL
    gpus: tuple[str, ...] = ()  # UUIDs of the GPUs it sees
    node: str = ""  # its machine's facts for the plan (fairring_pg.cuda.node_facts, JSON)
    sms: int = 0  # streaming multiprocessors of the smallest GPU it sees (0: none)
    # NCCL's CTA variables in that process ({} where none is set): NCCL lets them replace
    # a communicator's config (fairring_pg.cuda.job_plan.nccl_cta_limits).
    nccl_ctas: tuple[tuple[str, int], ...] = ()
    # For the plan file's shape (fairring_pg.measured.job_shape): the models of the GPUs
    # it sees, the smallest one's memory in bytes (0: none), its machine's CPU cores,
    # its torch's version and its NCCL's (None: a torch without NCCL).
    gpu_models: tuple[str, ...] = ()
    gpu_memory: int = 0
    cores: int = 0
    torch: str = ""
    nccl_version: str | None = None


@dataclass(frozen=True)
class CudaDecision:
    """Who runs collectives on CUDA tensors, and why; identical on every rank."""

    delegate: str  # "nccl", "gloo" or "none"
    reason: str
    warning: str | None = None  # said once, by the lowest rank of the host it concerns
    warning_rank: int = 0


def visible_gpu_uuids() -> tuple[str, ...]:
    """The UUIDs of the GPUs this process sees (CUDA_VISIBLE_DEVICES applied)."""
    uuids = []
    for index in range(torch.cuda.device_count()):
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        uuids.append(str(uuid) if uuid is not None else f"unknown-{index}")
    return tuple(uuids)


def visible_gpu_sms() -> int:
    """The streaming multiprocessors of the smallest GPU this process sees (0: none)."""
    counts = [
        int(torch.cuda.get_device_properties(i).multi_processor_count)
        for i in range(torch.cuda.device_count())
    ]
    return min(counts, default=0)


def visible_gpu_models() -> tuple[str, ...]:
    """The models of the GPUs this process sees, each once, sorted."""
    return tuple(sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}))


def visible_gpu_memory() -> int:
    """The memory of the smallest GPU this process sees, in bytes (0: none)."""
    sizes = [
        int(torch.cuda.get_device_properties(i).total_memory)
        for i in range(torch.cuda.device_count())
    ]
    return min(sizes, default=0)


def nccl_version() -> str | None:
    """The version of the NCCL this torch runs (``2.21.5``); None where it has none."""
    if not dist.is_nccl_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def local_gpu_facts(host: str) -> GpuFacts:
    """This process's facts; tests replace this function to fake other machines.
    Raises ValueError for a bad FAIRRING_NODE."""
    has_cuda = torch.cuda.is_available()
    return GpuFacts(
        host=host,
        cuda=has_cuda,
        nccl=dist.is_nccl_available(),
        gpus=visible_gpu_uuids() if has_cuda else (),
        node=node_facts.from_env().to_json(),
        sms=visible_gpu_sms() if has_cuda else 0,
        nccl_ctas=nccl_cta_variables(),
        gpu_models=visible_gpu_models() if has_cuda else (),
        gpu_memory=visible_gpu_memory() if has_cuda else 0,
        cores=os.cpu_count() or 0,
        torch=str(torch.__version__),
        nccl_version=nccl_version(),
    )


# NCCL's variables that bound a communicator's CTAs (channels), whatever its config says.
NCCL_CTA_VARIABLES = ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_MAX_NCHANNELS", "NCCL_MIN_NCHANNELS")


def nccl_cta_variables(environ: Mapping[str, str] | None = None) -> tuple[tuple[str, int], ...]:
    """This process's NCCL CTA variables that hold a positive integer (NCCL ignores
    others), as (name, value) pairs."""
    env = os.environ if environ is None else environ
    found = []
    for name in NCCL_CTA_VARIABLES:
        raw = env.get(name, "").strip()
        if raw.isdigit() and int(raw) > 0:
            found.append((name, int(raw)))
    return tuple(found)


def exchange_gpu_facts(
    store: Any, rank: int, size: int, timeout: timedelta, mine: GpuFacts
) -> list[GpuFacts]:
    """Every rank's facts, by rank, through ``store``."""
    store.set(_STORE_KEY.format(rank=rank), json.dumps(dataclasses.asdict(mine)))
    keys = [_STORE_KEY.format(rank=r) for r in range(size)]
    wait_for(store, keys, timeout, "waiting for every rank's GPU facts", range(size))
    facts = []
    for key in keys:
        entry = json.loads(store.get(key))
        gpus = tuple(entry["gpus"])
        facts.append(
            GpuFacts(
                entry["host"],
                entry["cuda"],
                entry["nccl"],
                gpus,
                entry["node"],
                entry["sms"],
                tuple((str(k), int(v)) for k, v in entry.get("nccl_ctas", [])),
                tuple(entry.get("gpu_models", ())),
                int(entry.get("gpu_memory", 0)),
                int(entry.get("cores", 0)),
                str(entry.get("torch", "")),
                entry.get("nccl_version"),
            )
        )
    return facts


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def decide(facts: Sequence[GpuFacts], choice: str = "auto") -> CudaDecision:
    """The CUDA delegate of a job whose rank ``r`` published ``facts[r]``, from the
    validated ``FAIRRING_CUDA_DELEGATE`` (``Config.cuda_delegate``). Raises ValueError
    where the ranks disagree on what must be equal."""
    without_cuda = [r for r, f in enumerate(facts) if not f.cuda]
    if len(without_cuda) == len(facts):
        return CudaDecision("none", "no rank sees a GPU")
    if without_cuda:
        return CudaDecision(
            "none",
            f"{_ranks(without_cuda)} of {len(facts)} see no GPU, so a collective on CUDA "
            "tensors cannot run on every rank",
        )
    if choice == "gloo":
        return CudaDecision("gloo", f"{DELEGATE_VARIABLE}=gloo")
    without_nccl = [r for r, f in enumerate(facts) if not f.nccl]
    if without_nccl and len(without_nccl) < len(facts):
        with_nccl = [r for r in range(len(facts)) if r not in without_nccl]
        raise ValueError(
            f"fairring: {_ranks(without_nccl)} run a torch without NCCL, {_ranks(with_nccl)} "
            "one with it; every rank of a job must run CUDA collectives through the same "
            "library: install the same torch on every machine"
        )
    if without_nccl:
        if choice == "nccl":
            raise ValueError(
                f"fairring: {DELEGATE_VARIABLE}=nccl but no rank's torch has NCCL "
                f"(torch {torch.__version__}); unset it or set it to gloo"
            )
        return CudaDecision("gloo", "no rank's torch has NCCL")
    if choice == "nccl":
        return CudaDecision("nccl", f"{DELEGATE_VARIABLE}=nccl")
    hosts: dict[str, list[int]] = {}
    for r, f in enumerate(facts):
        hosts.setdefault(f.host, []).append(r)
    for host, ranks in hosts.items():
        seen = {uuid for r in ranks for uuid in facts[r].gpus}
        if len(seen) < len(ranks):
            why = (
                f"{len(ranks)} ranks run on host {host} but see {len(seen)} GPU(s) between "
                "them; NCCL refuses ranks that share a GPU, so collectives on CUDA tensors, "
                "allreduce included, go to Gloo"
            )
            return CudaDecision(
                "gloo",
                why,
                warning=f"fairring: {why} (set {DELEGATE_VARIABLE}=nccl if each rank has a GPU "
                "of its own, or give each simulated machine its own NCCL_HOSTID)",
                warning_rank=ranks[0],
            )
    return CudaDecision("nccl", "every rank can have a GPU of its own and NCCL")


def decide_for_job(
    store: Any, topology: Topology, timeout: timedelta, choice: str
) -> tuple[CudaDecision, list[GpuFacts]]:
    """Publish this rank's facts, read everyone's and decide; warns once per job."""
    facts = exchange_gpu_facts(
        store,
        topology.rank,
        topology.world_size,
        timeout,
        local_gpu_facts(topology.nccl_hosts[topology.rank]),
    )
    decision = decide(facts, choice)
    if decision.warning is not None and topology.rank == decision.warning_rank:
        warnings.warn(decision.warning, stacklevel=2)
    return decision, facts
