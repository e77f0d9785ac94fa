"""The stream vehicle from Python: a test-only accelerator (tests/native/vehicle_*) on
which fairring's CUDA path runs in CI, with every stream order recorded.

``install()`` registers the device (torch's PrivateUse1, named "vehicle"); its kernels
run at once on host memory, and its Ledger records each as a launch on the current
stream, with the events, waits, host synchronisations and allocator notices around
them: two accesses to the same bytes that nothing orders, or a block freed while a
stream the allocator was not told about may use it, are races (``races()``), which a
GPU could turn into wrong results. ``stand_in()`` is what fairring's creator makes the
CUDA side of: a world group and sub-groups that behave as today's ProcessGroupNCCL does
with streams and memory (tests/native/vehicle_backend.h: no record_stream, tensors held
on the Work's shelf until wait() or synchronize(), or late by the watchdog), over Gloo;
under FAIRRING_TEST_LOCAL_GLOO, local groups that behave as ProcessGroupGloo does with
CUDA tensors (tests/native/vehicle_gloo.h: a reduce-scatter written only in wait()).

``init_fairring()`` creates the default group with it (ranks launched with
``init_group=False``) and registers fairring's backend for vehicle tensors, so that
``dist.all_reduce`` of a vehicle tensor takes fairring's CUDA path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from native_module import NATIVE

from fairring_pg.cuda import own_stream

DEVICE = "vehicle"
_vehicle: Any = None


def install() -> Any:
    """The vehicle's bindings (``fairring_pg_testing.vehicle``), the device registered."""
    global _vehicle
    if _vehicle is not None:
        return _vehicle
    from fairring_pg._build import load_test_extension

    module = load_test_extension(NATIVE).vehicle
    name = module.install()
    assert name == DEVICE, name
    # torch looks for torch.<device> when tensors move there.
    device_module = types.ModuleType(f"torch.{DEVICE}")
    device_module.is_available = lambda: True  # type: ignore[attr-defined]
    device_module.device_count = lambda: 1  # type: ignore[attr-defined]
    device_module.current_device = lambda: 0  # type: ignore[attr-defined]
    device_module._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    device_module.manual_seed_all = lambda seed: None  # type: ignore[attr-defined]
    torch._register_device_module(DEVICE, device_module)
    # What cudaStreamCreate is to CUDA: the trial timers' stream of their own.
    own_stream.register(DEVICE, lambda index: module.new_stream("fairring trial timing"))
    _vehicle = module
    return module


def ensure_built() -> None:
    """Build the test module in a child process (the parent never loads it), so that
    no job's deadline pays for the compile."""
    code = (
        f"from fairring_pg._build import load_test_extension; load_test_extension({str(NATIVE)!r})"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the test module failed:\n{proc.stdout}{proc.stderr}")


def stand_in() -> Any:
    """The accelerator fairring's creator builds the CUDA side from."""
    from fairring_pg.config import Config
    from fairring_pg.process_groups import StandInAccelerator, gloo_group, gloo_maker

    vehicle = install()
    config = Config.from_env()

    def make_world(
        store: Any, rank: int, size: int, timeout: timedelta, global_ranks: list[int], name: str
    ) -> Any:
        gloo = gloo_group(store, rank, size, timeout, config, global_ranks, name, store)
        return vehicle.StreamedBackend(gloo, name)

    def maker(store: Any, timeout: timedelta, global_ranks: list[int]) -> Any:
        make = gloo_maker(store, timeout, config, global_ranks)

        def make_group(prefix: str, rank: int, size: int, members: list[int], name: str) -> Any:
            return vehicle.StreamedBackend(make(prefix, rank, size, members, name), name)

        return make_group

    def gloo_on_vehicle(store: Any, timeout: timedelta, global_ranks: list[int]) -> Any:
        make = gloo_maker(store, timeout, config, global_ranks)

        def make_group(prefix: str, rank: int, size: int, members: list[int], name: str) -> Any:
            return vehicle.GlooOnVehicle(make(prefix, rank, size, members, name), name)

        return make_group

    return StandInAccelerator(DEVICE, make_world, maker, gloo_on_vehicle)


def init_fairring(**kwargs: Any) -> Any:
    """``init_process_group("fairring")`` with the vehicle in CUDA's place; returns the
    vehicle's bindings."""
    import fairring_pg.backend as backend

    vehicle = install()
    backend._stand_in_accelerator = stand_in()
    try:
        dist.init_process_group("fairring", **kwargs)
    finally:
        backend._stand_in_accelerator = None
    register_for_vehicle(dist.distributed_c10d._get_default_group())
    return vehicle


def init_stand_in() -> Any:
    """A Gloo default group whose vehicle tensors go to the stand-in for ProcessGroupNCCL
    alone (no fairring): the stand-in, for tests of the vehicle itself."""
    vehicle = install()
    dist.init_process_group("gloo")
    group = dist.distributed_c10d._get_default_group()
    stand_in = vehicle.StreamedBackend(group._get_backend(torch.device("cpu")), "stand-in")
    group._register_backend(torch.device(DEVICE), dist.ProcessGroup.BackendType.CUSTOM, stand_in)
    return stand_in


def register_for_vehicle(group: Any) -> None:
    """Vehicle tensors of ``group`` go to its fairring backend (registered by torch for
    CPU and CUDA only)."""
    fairring = group._get_backend(torch.device("cpu"))
    group._register_backend(torch.device(DEVICE), dist.ProcessGroup.BackendType.CUSTOM, fairring)


def finish() -> None:
    """The device runs everything issued (so that destroy's drain ends at once)."""
    if _vehicle is not None:
        _vehicle.set_idle(True)
