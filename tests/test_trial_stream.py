"""The measured choice's trial timers on an accelerator hold back none of the program's
streams (src/measured/trial_timer.h, fairring_pg/cuda/own_stream.py).

A timed call's end is recorded on a stream that first waits for the call. On CUDA,
torch's "new stream" is one of a pool of 32 that every ``torch.cuda.Stream()`` of the
program is handed too (the stream vehicle's ``getNewStream`` does as CUDA's does): a
timer there would make the program's later work on that pool stream wait for a
collective it never waited for. So:

- a job whose measured class runs its trial calls without waiting for them, then runs
  work of the program on each of the 32 pool streams before the decision: none of that
  work is ordered after the delegate's last trial calls (those after the last composed
  one), every result is exact, and the class was measured (its timers could time).
  The plant ``timer_on_pool_stream`` (the timers on the device's "new stream") fails it;
- where no stream of its own can be made on the device, the class keeps the program's
  own way on every rank, saying why, and every call is exact;
- the CUDA maker asks the driver for a non-blocking stream in the device's primary
  context, and leaves the context as it found it when the driver fails (a stand-in
  driver: no GPU in CI).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import stream_vehicle
import torch
import torch.distributed as dist
from test_stream_corners import (
    MEASURED_N,
    MEASURED_PLAN,
    decisions,
    job,
    outcome,
    started,
    sync_calls_of_a_measured_class,
)
from test_stream_order import exact, produced, total

from fairring_pg import measured
from fairring_pg.cuda import own_stream

DEVICE = stream_vehicle.DEVICE
POOL = 32  # CUDA's pool, and the vehicle's: streams handed out round robin
CALLS = measured.TRIAL_CALLS + 2


def _last_delegate_trial_calls() -> set[int]:
    """The timed trial calls of a class that run on the delegate (way 0: NCCL's own)
    after its last composed one. The composition's first call connects its sub-groups,
    which waits on the host, and a composed call is ordered after the delegate's calls
    before it (as on NCCL's one stream): everything later is ordered after the calls
    before those, rightly. Nothing but a timer's wait can order a stream after these."""
    import native_module

    m = native_module.load().measured
    ways = [m.trial_call(i) for i in range(measured.TRIAL_CALLS)]
    last_composed = max(i for i, (way, _) in enumerate(ways) if way == 1)
    return {i for i, (way, timed) in enumerate(ways) if i > last_composed and way == 0 and timed}


def trials_then_the_programs_streams(rank: int, world: int) -> dict[str, Any]:
    v = started()
    try:
        delegate_calls = _last_delegate_trial_calls()
        probes = [torch.empty(4, device=DEVICE) for _ in range(POOL)]
        held: list[tuple[Any, torch.Tensor, int]] = []
        delegate_launches: list[int] = []
        held_back: set[str] = set()
        for call in range(CALLS):
            if call == measured.TRIAL_CALLS:
                # The program's streams, as torch hands them out, each given work of its
                # own once every trial call was issued, before the decision (whose wait
                # for the timers tells the host that they ended, which orders all later
                # work after them).
                held_back = _held_back(v, probes, delegate_launches)
            t = produced(rank, MEASURED_N) * (call + 1)
            before = len(v.launches())
            work = dist.all_reduce(t, async_op=True)
            if call in delegate_calls:
                delegate_launches += [launch["id"] for launch in v.launches()[before:]]
            held.append((work, t, call))
        errors = []
        for work, t, call in held:
            work.wait()
            errors.append(exact(t * 1, total(world, MEASURED_N) * (call + 1)))
        return outcome(
            v,
            errors,
            decisions=decisions(),
            held_back=sorted(held_back),
            delegate_launches=len(delegate_launches),
        )
    finally:
        stream_vehicle.finish()


def _held_back(v: Any, probes: list[torch.Tensor], delegate_launches: list[int]) -> set[str]:
    """Each pool stream, as ``torch.Stream`` hands it out, runs a kernel of the program:
    the names of those that are ordered after one of the delegate's calls."""
    home = v.current_stream()
    held_back = set()
    streams = set()
    for probe in probes:
        stream = torch.Stream(device=DEVICE)
        streams.add(stream.stream_id)
        v.set_stream(stream.stream_id)
        probe.fill_(1.0)
        launch = v.launches()[-1]["id"]
        v.set_stream(home)
        if any(v.happens_before(earlier, launch) for earlier in delegate_launches):
            held_back.add(v.stream_name(stream.stream_id))
    assert len(streams) == POOL, streams
    return held_back


def test_the_timers_hold_back_none_of_the_programs_streams() -> None:
    for rank, got in enumerate(job(trials_then_the_programs_streams, "2x2", MEASURED_PLAN)):
        assert got["errors"] == [] and got["races"] == [], (rank, got)
        assert got["delegate_launches"] > 0, (rank, got)
        assert got["held_back"] == [], (rank, got)
        assert [d["source"] for d in got["decisions"]] == ["measured"], (rank, got)


def no_stream_of_its_own(rank: int, world: int) -> dict[str, Any]:
    stream_vehicle.install()
    own_stream._makers.pop(DEVICE)
    return sync_calls_of_a_measured_class(rank, world)


def test_without_a_stream_of_its_own_the_class_keeps_the_programs_way() -> None:
    for rank, got in enumerate(job(no_stream_of_its_own, "2x2", MEASURED_PLAN)):
        assert got["errors"] == [] and got["races"] == [], (rank, got)
        [decision] = got["decisions"]
        assert decision["source"] == "kept" and decision["winner"] == "nccl", (rank, decision)
        # Every rank says the same: the lowest rank that could not time, and why.
        assert decision["reason"] == (
            "rank 0 could not time its trial calls (no stream of its own on vehicle:0 to "
            "time its calls on: fairring_pg knows no way to make a stream on vehicle)"
        ), (rank, decision)


# ------------------------------------------------------- the CUDA maker, on a stand-in driver


class Driver:
    """What ``_cuda_stream`` asks of libcuda, recorded; ``fail`` names a call that fails."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.current: list[int] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append((name, args))
            if name == self.fail:
                return 201  # CUDA_ERROR_INVALID_CONTEXT
            if name == "cuDevicePrimaryCtxRetain":
                ctypes.cast(args[0], ctypes.POINTER(ctypes.c_void_p))[0] = 0x7000
            elif name == "cuCtxPushCurrent_v2":
                self.current.append(args[0].value)
            elif name == "cuCtxPopCurrent_v2":
                self.current.pop()
            elif name == "cuStreamCreate":
                ctypes.cast(args[0], ctypes.POINTER(ctypes.c_void_p))[0] = 0x5550
            return 0

        return call


def test_the_cuda_maker_asks_for_a_non_blocking_stream_in_the_primary_context() -> None:
    driver = Driver()
    assert own_stream._cuda_stream(3, driver) == 0x5550  # type: ignore[arg-type]
    names = [name for name, _ in driver.calls]
    assert names == [
        "cuDeviceGet",
        "cuDevicePrimaryCtxRetain",
        "cuCtxPushCurrent_v2",
        "cuStreamCreate",
        "cuCtxPopCurrent_v2",
    ]
    assert driver.calls[0][1][1].value == 3
    assert driver.calls[3][1][1].value == 1  # CU_STREAM_NON_BLOCKING
    assert driver.current == []


@pytest.mark.parametrize("fail", ["cuDevicePrimaryCtxRetain", "cuStreamCreate"])
def test_a_failing_driver_is_named_and_the_context_left_as_it_was(fail: str) -> None:
    driver = Driver(fail)
    with pytest.raises(RuntimeError, match=f"the CUDA driver's {fail} failed with CUresult 201"):
        own_stream._cuda_stream(0, driver)  # type: ignore[arg-type]
    assert driver.current == []
