"""The creator torch calls for ``init_process_group("fairring")`` and ``new_group``.

Python does the set-up that needs the store and the environment (configuration,
topology, job token, delegate process groups) and hands the results to the C++ core,
``_C.FairringBackend``, which does allreduce itself and forwards the rest.
"""

from __future__ import annotations

import atexit
import functools
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist

from fairring_pg import group_info, measured, process_groups, sizing
from fairring_pg.config import Config, file_for_group
from fairring_pg.cpu import future_callbacks
from fairring_pg.cuda import own_stream
from fairring_pg.cuda.decision import CudaDecision, decide_for_job
from fairring_pg.cuda.job_plan import plan_for_job
from fairring_pg.cuda.subgroups import build_subgroups, cuda_subgroup_kinds
from fairring_pg.model.cpu_plan import CpuPlan, plan_cpu_allreduce
from fairring_pg.model.cuda_plan import CudaPlan
from fairring_pg.network import listen_address
from fairring_pg.process_groups import StandInAccelerator
from fairring_pg.startup import (
    AnotherRankFailed,
    PeersNamed,
    all_passed,
    all_started,
    core_store,
    failures_of_others,
    one_deadline,
    publish_failure,
    time_left,
    wait_for,
)
from fairring_pg.topology import Topology, discover

_TOKEN_KEY = "fairring/job_token"

# Private seam for tests that run without the C++ core: called with the same arguments
# as _C.FairringBackend. None means the real core.
_core_factory: Callable[..., Any] | None = None
# Private seam for tests: a device that takes CUDA's place (the stream vehicle of
# tests/native/), with its own world group and sub-groups. None means CUDA.
_stand_in_accelerator: StandInAccelerator | None = None
# Tests only: runs on each rank after its own checks, before the ranks' verdict (a
# check that fails late on one rank, or early).
_before_verdict: Callable[[int], None] | None = None


@dataclass
class _Agreed:
    """What every rank of the group has settled before the core starts."""

    config: Config
    topology: Topology
    cuda_decision: CudaDecision
    cuda_plan: CudaPlan
    cpu_plan: CpuPlan
    plan_shape: dict[str, Any]  # what FAIRRING_PLAN_FILE must have been saved under
    known: list[dict[str, Any]]  # the measured choices FAIRRING_PLAN_FILE holds
    sub_group_ctas: int  # 0: not capped
    token: str
    factory: Callable[..., Any]
    opts: Any
    ext: Any


def create_backend(dist_backend_opts: Any, backend_options: Any) -> Any:
    """``extended_api`` creator: returns a ``c10d.Backend`` for one process group."""
    store = dist_backend_opts.store
    rank = int(dist_backend_opts.group_rank)
    size = int(dist_backend_opts.group_size)
    timeout: timedelta = dist_backend_opts.timeout

    try:
        config = Config.from_env()
        # Compile/load before any rendezvous: a first build takes minutes, and it must
        # not eat into the start's time (a machine's ranks wait on one build).
        core = _load_core()
    except Exception as exc:
        publish_failure(store, rank, exc)
        raise
    with one_deadline(timeout):
        agreed = _agree(store, rank, size, timeout, str(dist_backend_opts.group_id), config, core)
        try:
            backend = _connect(agreed, store, rank, size, timeout, dist_backend_opts)
            all_started(store, rank, size, timeout)
            return backend
        except Exception as exc:
            # The others stop connecting at once, naming this rank's reason (startup.py).
            publish_failure(store, rank, exc)
            if isinstance(exc, AnotherRankFailed):
                raise
            if others := failures_of_others(store, rank, size, not isinstance(exc, PeersNamed)):
                raise RuntimeError(
                    f"{exc} (and other ranks failed to start: {'; '.join(others)})"
                ) from exc
            raise


def _load_core() -> tuple[Callable[..., Any], Any, Any]:
    """The core's factory, a fresh options object and the extension (None under a
    test's stand-in core)."""
    if _core_factory is not None:
        return _core_factory, _Recorder(), None
    from fairring_pg._build import load_extension

    ext = load_extension()
    future_callbacks.install(ext)
    return ext.FairringBackend, ext.Options(), ext


def _connect(
    agreed: _Agreed,
    store: Any,
    rank: int,
    size: int,
    timeout: timedelta,
    dist_backend_opts: Any,
) -> Any:
    """The groups the agreed settings call for, connected, and the core started."""
    group_id = str(dist_backend_opts.group_id)
    config, topology, opts = agreed.config, agreed.topology, agreed.opts
    address = listen_address(config, single_host=len(set(topology.hostnames)) == 1)
    core_options(opts, config, topology, address, agreed.token, timeout, agreed.cuda_plan, group_id)
    opts.set_cpu_plan(agreed.cpu_plan.core_rows())
    group_info.record(group_id, agreed.cuda_decision, agreed.cuda_plan, agreed.cpu_plan)
    cpu_delegate = process_groups.make_gloo_delegate(
        store, rank, size, timeout, config, dist_backend_opts
    )
    if agreed.cpu_plan.uses_ring and not config.test_cpu_subgroups:
        # The ring's own Gloo group: on the delegate, the program's ring allreduces
        # would interleave with collectives issued from callbacks differently on
        # each rank.
        opts.ring_delegate = process_groups.make_gloo_delegate(
            store, rank, size, timeout, config, dist_backend_opts, role="ring"
        )
    _set_measured(agreed, opts, rank, dist_backend_opts)
    cuda_delegate = _cuda_side(agreed, store, rank, size, timeout, dist_backend_opts, cpu_delegate)
    if config.test_cpu_subgroups and _core_factory is None:
        make = process_groups.gloo_maker(
            store, timeout, config, _global_ranks(dist_backend_opts, size)
        )
        opts.cpu_subgroups = build_subgroups(
            agreed.ext.Subgroups(),
            topology,
            config,
            cpu_delegate,
            make,
            make,
            "cpu",
            str(dist_backend_opts.group_id),
            agreed.cuda_plan.composes,
        )
    # The core's connecting ends with the rest of the start (startup.one_deadline).
    opts.engine.start_timeout = time_left(timeout)
    try:
        return agreed.factory(core_store(store), rank, size, opts, cpu_delegate, cuda_delegate)
    except Exception as exc:
        raise RuntimeError(
            f"fairring: rank {rank} of {size} could not start the allreduce core "
            f"(listening on {address}, {topology.num_machines} machine(s) x "
            f"{topology.local_size} rank(s)): {type(exc).__name__}: {exc}"
        ) from exc


def _agree(
    store: Any,
    rank: int,
    size: int,
    timeout: timedelta,
    group_id: str,
    config: Config,
    core: tuple[Callable[..., Any], Any, Any],
) -> _Agreed:
    """Settings, topology, the CUDA decision and the job token, the same on every rank;
    a rank that fails here tells the others, which raise at once rather than at the init
    timeout."""
    factory, opts, ext = core
    try:
        config.check_consistent_across_ranks(store, rank, size, timeout)
        topology = discover(store, rank, size, config.machine_id, timeout)
        # From every rank's published GPU facts: the same on every rank, or a ValueError
        # on every rank (fairring_pg/cuda/decision.py).
        cuda_decision, gpu_facts = decide_for_job(store, topology, timeout, config.cuda_delegate)
        if _stand_in_accelerator is not None:
            cuda_decision = CudaDecision("nccl", "a stand-in accelerator (tests)")
        if not config.test_cpu_subgroups:
            config.check_staging_fits(topology.num_machines, topology.local_size)
        config.check_staging_allocatable()
        # What each size of CUDA allreduce runs, the same on every rank (rank 0's).
        cuda_plan, ctas = plan_for_job(store, topology, config, timeout, gpu_facts)
        # From job-wide values and the topology: the same on every rank.
        cpu_plan = plan_cpu_allreduce(config, topology.num_machines, topology.local_size)
        shape = measured.job_shape(
            topology, config, cpu_plan, cuda_plan, gpu_facts, cuda_decision.delegate, ctas
        )
        known = measured.agree_on_known(store, rank, timeout, config, shape, group_id)
        token = job_token(store, rank, timeout)
        if _before_verdict is not None:
            _before_verdict(rank)
        all_passed(store, rank, size, timeout)
    except Exception as exc:
        publish_failure(store, rank, exc)
        raise
    return _Agreed(
        config,
        topology,
        cuda_decision,
        cuda_plan,
        cpu_plan,
        shape,
        known,
        ctas,
        token,
        factory,
        opts,
        ext,
    )


def _global_ranks(dist_backend_opts: Any, size: int) -> list[int]:
    return list(dist_backend_opts.global_ranks_in_group) or list(range(size))


def _cuda_side(
    agreed: _Agreed,
    store: Any,
    rank: int,
    size: int,
    timeout: timedelta,
    dist_backend_opts: Any,
    cpu_delegate: Any,
) -> Any:
    """The CUDA delegate (NCCL, Gloo where ranks share a GPU, or the tests' stand-in
    accelerator), and the CUDA sub-groups where allreduces are composed of them."""
    config, topology, opts = agreed.config, agreed.topology, agreed.opts
    global_ranks = _global_ranks(dist_backend_opts, size)
    group_id = str(dist_backend_opts.group_id)
    cuda_delegate = None
    makers: dict[str, Any] = {}
    if _stand_in_accelerator is not None:
        accelerator = _stand_in_accelerator
        opts.accelerator_type = accelerator.device_type
        cuda_delegate = accelerator.make_world(
            dist.PrefixStore("fairring/accelerator/", store),
            rank,
            size,
            timeout,
            global_ranks,
            f"fairring-{accelerator.device_type}-g{group_id}-world",
        )
        makers["nccl"] = accelerator.maker(store, timeout, global_ranks)
    elif agreed.cuda_decision.delegate == "nccl":
        cuda_delegate = process_groups.make_nccl_delegate(
            store, rank, size, timeout, dist_backend_opts
        )
        makers["nccl"] = process_groups.nccl_maker(
            store, timeout, global_ranks, agreed.sub_group_ctas
        )
    elif agreed.cuda_decision.delegate == "gloo":
        cuda_delegate = cpu_delegate
    kinds = cuda_subgroup_kinds(topology, agreed.cuda_decision.delegate, config.test_local_gloo)
    if kinds is not None and _core_factory is None:
        stand_in = _stand_in_accelerator
        if stand_in is not None and stand_in.gloo_maker is not None:
            makers["gloo"] = stand_in.gloo_maker(store, timeout, global_ranks)
        else:
            makers["gloo"] = process_groups.gloo_maker(store, timeout, config, global_ranks)
        opts.cuda_subgroups = build_subgroups(
            agreed.ext.Subgroups(),
            topology,
            config,
            cuda_delegate,
            makers[kinds[0]],
            makers[kinds[1]],
            "cuda",
            group_id,
            agreed.cuda_plan.composes,
        )
    opts.cuda_unavailable = (
        ""
        if cuda_delegate is not None
        else f"CUDA collectives cannot run: {agreed.cuda_decision.reason}"
    )
    return cuda_delegate


def _set_measured(agreed: _Agreed, opts: Any, rank: int, dist_backend_opts: Any) -> None:
    """The measured choice's part of the options, where a plan measures some size: the
    plan file's decisions, and on rank 0 the hook that logs and saves new ones (the
    agreements go through the group's store: src/measured/agreement.h)."""
    config = agreed.config
    cpu_measures = agreed.cpu_plan.measures and not config.test_cpu_subgroups
    # The CUDA plan is run where sub-groups are made (or by CPU tensors, in tests).
    kinds = cuda_subgroup_kinds(
        agreed.topology, agreed.cuda_decision.delegate, config.test_local_gloo
    )
    composed = kinds is not None or config.test_cpu_subgroups or _stand_in_accelerator is not None
    if not (cpu_measures or (agreed.cuda_plan.measures and composed)):
        return
    opts.accelerator_delegate_name = agreed.cuda_decision.delegate
    opts.set_own_stream(own_stream.own_stream)
    measured.set_known(opts, agreed.known)
    if rank == 0:
        path = config.plan_file
        if path is not None:
            path = file_for_group(path, str(dist_backend_opts.group_id))
        opts.set_on_measured(
            measured.Recorder(agreed.topology, agreed.plan_shape, path, agreed.known)
        )


# How long allreduces posted but never waited for may take to finish at exit.
_EXIT_GRACE = timedelta(seconds=3)


@atexit.register
def _shutdown_engines() -> None:
    """Stop fairring's threads before the interpreter finalizes: after that, a core
    thread that drops the last reference to a Python-owned tensor must take the GIL,
    and CPython ends such threads in a way that aborts the process ("terminate called
    without an active exception"). Torch keeps only the C++ backend, so the registry of
    live engines is in C++."""
    from fairring_pg._build import _loaded

    for module in list(_loaded.values()):
        shutdown_all = getattr(module, "shutdown_all", None)
        if shutdown_all is not None:
            shutdown_all(_EXIT_GRACE)


def job_token(store: Any, rank: int, timeout: timedelta) -> str:
    """A secret shared by the ranks of this group; peers present it when they connect."""
    if rank == 0:
        store.set(_TOKEN_KEY, secrets.token_hex(16))
    wait_for(store, [_TOKEN_KEY], timeout, "waiting for rank 0's job token", [0])
    return store.get(_TOKEN_KEY).decode()


def core_options(
    opts: Any,
    config: Config,
    topology: Topology,
    address: str,
    token: str,
    timeout: timedelta,
    cuda_plan: CudaPlan | None = None,
    group_name: str = "0",
) -> None:
    """Fill the core's options: each setting the core takes as it is (the table's
    ``core`` column), then what the sizing rules and the job make of the settings."""
    for target, value in config.core_values():
        *parts, name = target.split(".")
        setattr(functools.reduce(getattr, parts, opts), name, value)
    M, L = topology.num_machines, topology.local_size
    opts.machine_of = list(topology.machine_of)
    opts.local_rank_of = list(topology.local_rank_of)
    opts.hostnames = list(topology.hostnames)
    engine = opts.engine
    engine.slice_bytes = config.effective_slice_size(M, L)
    engine.slot_bytes = sizing.staging_slot_bytes(engine.slice_bytes, M, L)
    engine.timeline_path = config.timeline_path(topology.rank, group_name)
    engine.listen_address = address
    engine.token = token
    engine.timeout = timeout
    opts.subgroup.timeout = timeout
    if cuda_plan is not None:
        # What each size of the sub-group allreduce runs; where some size composes, its
        # largest piece and each lane's staging.
        opts.subgroup.set_plan(cuda_plan.core_rows())
        if cuda_plan.composes:
            opts.subgroup.largest_piece_bytes = cuda_plan.largest_piece
            opts.subgroup.lane_staging_bytes = sizing.lane_staging_bytes(
                cuda_plan.largest_piece, M, L
            )


class _Recorder(SimpleNamespace):
    """What a test's stand-in core (``_core_factory``) is handed instead of
    ``_C.Options``: a field set is kept, a part (``engine``) is another recorder, a
    ``set_*`` or ``add_*`` call is kept under its name."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("set_", "add_")):
            return lambda *args: setattr(self, name[4:], args)
        part = _Recorder()
        setattr(self, name, part)
        return part
