"""The stream vehicle checked on its own, with no fairring code: each hazard it exists to
report is planted by hand, and the same program with the missing order supplied is the
positive control (no race). If one of these fails, tests/test_stream_order.py proves
nothing.

Also its stand-in for ProcessGroupNCCL (tests/native/vehicle_backend.h), which must hold
memory as today's ProcessGroupNCCL does (no record_stream; a shelf emptied by wait() or
synchronize(), or late by the watchdog), or the vehicle cannot see the class of bug
where a caller of its Work empties that shelf too early.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import stream_mutants
import stream_vehicle
import torch
import torch.distributed as dist
from multiprocess import memoised, run_ranks

DEVICE = stream_vehicle.DEVICE


def _fresh(v: Any) -> None:
    v.synchronize()
    gc.collect()
    v.clear_races()


def _on(v: Any, stream: int, fn: Any) -> Any:
    previous = v.current_stream()
    v.set_stream(stream)
    try:
        return fn()
    finally:
        v.set_stream(previous)


def _made(v: Any, *streams: int) -> torch.Tensor:
    """A tensor written on the current stream, which `streams` then wait for: the only
    hazard left is the one the control plants."""
    t = torch.zeros(64, device=DEVICE)
    for stream in streams:
        v.wait_stream(stream, v.current_stream())
    return t


def unordered_writes(v: Any, ordered: bool) -> list[str]:
    a, b = v.new_stream("writer a"), v.new_stream("writer b")
    t = _made(v, a, b)
    _on(v, a, lambda: t.fill_(1.0))
    if ordered:
        v.wait_stream(b, a)
    _on(v, b, lambda: t.fill_(2.0))
    return v.races()


def free_while_used(v: Any, recorded: bool) -> list[str]:
    other = v.new_stream("a reader the allocator may not know")
    t = _made(v, other)  # allocated on the current stream
    _on(v, other, t.sum)
    if recorded:
        v.record_on_stream(t, other)
    del t
    gc.collect()
    return v.races()


def read_without_wait(v: Any, waited: bool) -> list[str]:
    producer, consumer = v.new_stream("producer"), v.new_stream("consumer")
    t = _made(v, producer, consumer)
    _on(v, producer, lambda: t.add_(3.0))
    if waited:
        v.wait_stream(consumer, producer)
    _on(v, consumer, lambda: t * 2)
    return v.races()


CONTROLS = {
    "unordered_writes": unordered_writes,
    "free_while_used": free_while_used,
    "read_without_wait": read_without_wait,
}


def held_like_nccl(rank: int, world: int, v: Any, stand_in: Any) -> dict[str, Any]:
    """The stand-in's Work holds a temporary only it references until wait(); a caller
    that synchronizes it at issue with another stream current (as fairring's ordering
    once did, on a stream of its own) frees it while the communication stream may still
    read it: the caller's stream, where the allocator hands the block out next, never
    waited."""
    out: dict[str, Any] = {}
    side = v.new_stream("a stream that is not the caller's")
    for early in (False, True):
        _fresh(v)
        base = (torch.arange(2 * 8, dtype=torch.float64).view(8, 2) + rank).to(DEVICE)
        gathered = torch.empty(world * 8, dtype=torch.float64, device=DEVICE)
        work = dist.all_gather_into_tensor(gathered, base[:, 0].contiguous(), async_op=True)
        held = stand_in.held_shelves()
        if early:
            _on(v, side, work.synchronize)  # the shelf goes now, the caller never waited
        gc.collect()
        torch.empty(8, dtype=torch.float64, device=DEVICE).fill_(-1)  # the next owner
        work.wait()
        want = torch.cat([torch.arange(0, 16, 2, dtype=torch.float64) + r for r in range(world)])
        out[f"early={early}"] = {
            "races": v.races(),
            "exact": torch.equal(gathered.cpu(), want),
            "held": held,
        }
    return out


def run_controls(rank: int, world: int) -> dict[str, Any]:
    import native_module

    v = stream_vehicle.install()
    plants = native_module.load().plants
    results: dict[str, Any] = {"plants": plants.names()}
    try:
        plants.arm("no_such_plant")
    except ValueError as exc:
        results["unknown plant"] = str(exc)
    for name, control in CONTROLS.items():
        for planted in (True, False):
            _fresh(v)
            results[f"{name}/planted={planted}"] = control(v, not planted)
    return results


def held_across_later_calls(rank: int, world: int, v: Any) -> dict[str, Any]:
    """A temporary only the Work holds stays held while later calls are issued (each
    call's clean-up once emptied the shelf of a collective still running: an entry moved
    onto itself lost its end, and an end that says nothing reads as reached)."""
    _fresh(v)
    v.set_patience(1 << 30)  # no event is seen to end: only the host's knowledge frees
    base = (torch.arange(2 * 16, dtype=torch.float64).view(16, 2) + rank).to(DEVICE)
    out = torch.zeros(16 // world, dtype=torch.float64, device=DEVICE)
    works = [dist.reduce_scatter_tensor(out, base[:, 0].contiguous(), async_op=True)]
    gc.collect()
    later = [
        torch.full((4,), float(rank + i), dtype=torch.float64, device=DEVICE) for i in range(3)
    ]
    works += [dist.all_reduce(t, async_op=True) for t in later]
    races_before_waits = v.races()
    for work in works:
        work.wait()
    v.set_patience(8)
    want = sum(torch.arange(0, 32, 2, dtype=torch.float64) + r for r in range(world))
    mine = want[rank * (16 // world) : (rank + 1) * (16 // world)]
    return {"races": races_before_waits + v.races(), "exact": torch.equal(out.cpu(), mine)}


def run_stand_in(rank: int, world: int) -> dict[str, Any]:
    v = stream_vehicle.install()
    stand_in = stream_vehicle.init_stand_in()
    try:
        out = held_like_nccl(rank, world, v, stand_in)
        out["later calls"] = held_across_later_calls(rank, world, v)
        return out
    finally:
        stream_vehicle.finish()


@memoised
def controls() -> dict[str, Any]:
    stream_vehicle.ensure_built()
    return run_ranks(run_controls, 1, ["m0"], timeout_s=240, init_group=False)[0]


@memoised
def stand_in() -> list[dict[str, Any]]:
    stream_vehicle.ensure_built()
    return run_ranks(run_stand_in, 2, ["m0", "m1"], timeout_s=240, init_group=False)


def test_every_plant_has_the_tests_that_catch_it() -> None:
    """scripts/stream_mutants.sh runs each plant the core has, none more or fewer, and
    arming a name no plant has is refused (a renamed plant would otherwise go inert)."""
    assert controls()["plants"] == list(stream_mutants.CATCHERS)
    assert "no plant is called 'no_such_plant'" in controls()["unknown plant"]


@pytest.mark.parametrize("name", CONTROLS)
def test_the_planted_hazard_is_reported(name: str) -> None:
    races = controls()[f"{name}/planted=True"]
    assert len(races) == 1, races


@pytest.mark.parametrize("name", CONTROLS)
def test_the_same_program_ordered_is_not(name: str) -> None:
    assert controls()[f"{name}/planted=False"] == []


def test_the_stand_in_holds_a_temporary_until_wait() -> None:
    for rank, got in enumerate(stand_in()):
        held = got["early=False"]
        assert held["races"] == [] and held["exact"], (rank, held)
        assert held["held"] >= 1, (rank, held)


def test_the_stand_in_holds_a_temporary_while_later_calls_are_issued() -> None:
    for rank, got in enumerate(stand_in()):
        later = got["later calls"]
        assert later["races"] == [] and later["exact"], (rank, later)


def test_a_release_at_issue_frees_the_temporary_under_the_collective() -> None:
    for rank, got in enumerate(stand_in()):
        early = got["early=True"]
        assert any(
            "was freed while" in r and "communication stream" in r for r in early["races"]
        ), (
            rank,
            early["races"],
        )


def test_a_crash_is_a_catch_only_for_a_plant_that_crashes() -> None:
    """A plant whose tests fail because a rank died of something else has not been
    caught by them (the runner once counted any failure)."""
    failed = "FAILED tests/test_x.py::test_y - RankFailure: job on fairring: rank 1 crashed\n"
    asserted = "FAILED tests/test_x.py::test_y - AssertionError: rank 0: ['differs at [3]']\n"
    quiet = stream_mutants.Catch(("test_x.py::test_y",), ())
    crashing = stream_mutants.Catch(("test_x.py::test_y",), (), crashes=True)
    assert stream_mutants.caught_by(1, asserted, quiet) == "test_x.py::test_y"
    assert stream_mutants.caught_by(1, failed, quiet) is None
    assert stream_mutants.caught_by(1, failed, crashing) == "test_x.py::test_y"
    assert stream_mutants.caught_by(0, "", quiet) is None
