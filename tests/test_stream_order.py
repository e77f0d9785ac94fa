"""The CUDA path's stream order, checked on CPU through the stream vehicle.

fairring composes a CUDA allreduce of sub-group collectives on lane streams
(src/subgroups/); every rule of docs/design.md's CUDA section is about which stream
waits for what. The Gloo vehicle (FAIRRING_TEST_CPU_SUBGROUPS) has no streams, so a
wrong order there is invisible; here the very same code runs on the stream vehicle
(tests/stream_vehicle.py, tests/native/vehicle_*): a test-only accelerator whose kernels
run at once but whose Ledger keeps what the device *may* do, every launch with the
stream it ran on, every event and wait, every allocator notice, and reports as a race
any two accesses to the same bytes that nothing orders, and any block freed while a
stream the allocator was not told about may still use it. Its world group and
sub-groups behave as ProcessGroupNCCL does with streams (a communication stream that
waits for the caller's, record_stream, a Work whose wait() orders streams only).

Each job runs every scenario below on one fairring group, the device synchronised
between scenarios, and each test reads one scenario's outcome: the races the Ledger saw,
the exact values every rank computed from the known inputs of all ranks, and the
sub-group path's counters. A scenario that reads a result it did not wait for checks
that the Ledger does see races (the vehicle can fail).

The planted bugs these tests were watched failing with (each a one-line change in
src/subgroups/): the future marked outside the done stream's scope (as it was before
this file existed), a lane that skips the caller's position, the lanes not joined before
done, keepAlive off, the byte-range check off, a delegated collective not ordered after
the allreduces in flight (or an allreduce not after a delegated collective in flight), a
barrier that does not wait for the device.
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import Callable
from typing import Any

import pytest
import stream_mutants
import stream_vehicle
import torch
import torch.distributed as dist
from multiprocess import SHAPES, fairring_env, memoised, run_ranks

from fairring_pg.group_info import subgroup_stats

DEVICE = stream_vehicle.DEVICE
SLICE_SIZE = 4 * 1024  # 512 float64: several slices per tensor, on both lanes
TOTAL_MEMORY = 64 * 1024
N = 3 * 512 + 3  # three slices and a tail (fewer elements than a group: a direct unit)
SMALL = 16  # 128 bytes: the plan's first row, the delegate's own allreduce
TIMEOUT_S = 240


def value(rank: int, n: int, offset: int = 0) -> torch.Tensor:
    """Rank r's input: distinct per rank and element, exact in float64 sums."""
    i = torch.arange(offset, offset + n, dtype=torch.float64)
    return (i % 97) * 0.25 + rank * 1000.5 + 1


def total(world: int, n: int, offset: int = 0) -> torch.Tensor:
    return sum(value(r, n, offset) for r in range(world))


def on_vehicle(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def exact(got: torch.Tensor, want: torch.Tensor) -> str | None:
    if torch.equal(got.cpu(), want):
        return None
    bad = (got.cpu() != want).nonzero()[:3].flatten().tolist()
    return f"differs at {bad}: got {got.cpu()[bad].tolist()}, want {want[bad].tolist()}"


def produced(rank: int, n: int) -> torch.Tensor:
    """The rank's input, written on the device by a kernel on the current stream (as
    backward writes a gradient): the allreduce must wait for it."""
    t = on_vehicle(value(rank, n) - 1)
    t.add_(1)
    return t


def ordering_waits() -> int:
    """How often the sub-group path made a call wait for another on the same bytes (0
    where the plan composes nothing: the delegate orders its own calls)."""
    stats = subgroup_stats(None, DEVICE)
    return 0 if stats is None else stats["ordering_waits"]


def launches(v: Any) -> int:
    return len(v.launches())


def on_stream(v: Any, name: str, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``fn()`` with a new stream current, then the host waits for the device (as
    torch.cuda.synchronize() would), so that the test reads its result safely."""
    side = v.new_stream(name)
    previous = v.current_stream()
    v.set_stream(side)
    try:
        result = fn()
    finally:
        v.set_stream(previous)
    v.synchronize()
    return result


# ------------------------------------------------------------------ the scenarios
# Each takes (rank, world, vehicle) and returns what its test checks: a dict with
# "errors" (exactness failures) and anything else; the races are added by the job.


def future_wait(rank: int, world: int, v: Any) -> dict[str, Any]:
    """get_future().wait(), then a kernel on the caller's stream reads the result (what
    DDP's reducer does with a bucket)."""
    t = produced(rank, N)
    dist.all_reduce(t, async_op=True).get_future().wait()
    return {"errors": [exact(t * 1, total(world, N))]}


def work_wait(rank: int, world: int, v: Any) -> dict[str, Any]:
    t = produced(rank, N)
    dist.all_reduce(t, async_op=True).wait()
    return {"errors": [exact(t * 1, total(world, N))]}


def work_synchronize(rank: int, world: int, v: Any) -> dict[str, Any]:
    t = produced(rank, N)
    dist.all_reduce(t, async_op=True).synchronize()
    return {"errors": [exact(t * 1, total(world, N))]}


def sync_call(rank: int, world: int, v: Any) -> dict[str, Any]:
    t = produced(rank, N)
    dist.all_reduce(t)
    return {"errors": [exact(t * 1, total(world, N))]}


def then_callback(rank: int, world: int, v: Any) -> dict[str, Any]:
    """A then() callback (a DDP comm hook) reads the result on the stream c10 makes
    current for it; whoever waits on the chained future reads what it returned."""
    t = produced(rank, N)
    fut = dist.all_reduce(t, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] * 2)
    return {"errors": [exact(chained.wait() + 0, 2 * total(world, N))]}


def is_completed_poll(rank: int, world: int, v: Any) -> dict[str, Any]:
    """The host polls is_completed() until it says so; then any stream may read."""
    t = produced(rank, N)
    work = dist.all_reduce(t, async_op=True)
    while not work.is_completed():
        pass
    got = on_stream(v, "a reader that never waited", lambda: t * 1)
    return {"errors": [exact(got, total(world, N))]}


def side_stream_caller(rank: int, world: int, v: Any) -> dict[str, Any]:
    """The caller's current stream is one of its own: the lanes wait for that stream,
    and the result is ordered on it."""

    def call() -> torch.Tensor:
        t = produced(rank, N)
        dist.all_reduce(t, async_op=True).wait()
        return t * 1

    got = on_stream(v, "the caller's own stream", call)
    return {"errors": [exact(got, total(world, N))]}


def unwaited_read(rank: int, world: int, v: Any) -> dict[str, Any]:
    """Reading a result without waiting for it is a race the vehicle must see (else
    every other scenario here proves nothing)."""
    t = produced(rank, N)
    work = dist.all_reduce(t, async_op=True)
    t * 1  # noqa: B018 - a kernel that reads the result, not ordered after the allreduce
    work.wait()
    return {"errors": [exact(t * 1, total(world, N))]}


def averaged_view(rank: int, world: int, v: Any) -> dict[str, Any]:
    """A non-contiguous view, AVG: the lanes reduce a dense copy made on the first lane
    after its waits, and the result is copied back on the done lane. Where the plan
    composes nothing, the delegate refuses it as NCCL does ("Tensors must be
    contiguous")."""
    n = 2 * 512 + 4
    base = on_vehicle(torch.zeros(n, 3, dtype=torch.float64))
    view = base[:, 1]
    view.copy_(on_vehicle(value(rank, n)))
    want = torch.zeros(n, 3, dtype=torch.float64)
    if subgroup_stats(None, DEVICE) is None:
        with pytest.raises(ValueError, match="contiguous"):
            dist.all_reduce(view, op=dist.ReduceOp.AVG)
        want[:, 1] = value(rank, n)
        return {"errors": [exact(base * 1, want)]}
    dist.all_reduce(view, op=dist.ReduceOp.AVG, async_op=True).wait()
    want[:, 1] = total(world, n) / world
    return {"errors": [exact(base * 1, want)]}


def int16_and_coalesced(rank: int, world: int, v: Any) -> dict[str, Any]:
    """int16 travels widened to int32 and is narrowed back; coalesced tensors are fused
    into one buffer and scattered back: buffers made on the lanes, read on others. Where
    the plan composes nothing, int16 is the delegate's to refuse (NCCL reduces no int16)."""
    n = 2 * 512 + 5
    small = on_vehicle(((torch.arange(n) % 50) * (rank + 1) - 70).to(torch.int16))
    want_small = sum(((torch.arange(n) % 50) * (r + 1) - 70) for r in range(world)).to(torch.int16)
    if subgroup_stats(None, DEVICE) is not None:
        dist.all_reduce(small, async_op=True).wait()
    else:
        with pytest.raises(RuntimeError, match="scalar type"):
            dist.all_reduce(small)
        small = on_vehicle(want_small)
    pair = [produced(rank, 700), produced(rank, 900) * 2]
    work = dist.distributed_c10d._get_default_group().allreduce_coalesced(pair)
    work.wait()
    return {
        "errors": [
            exact(small * 1, want_small),
            exact(pair[0] * 1, total(world, 700)),
            exact(pair[1] * 1, 2 * total(world, 900)),
        ]
    }


def freed_at_once(rank: int, world: int, v: Any) -> dict[str, Any]:
    """The caller drops the tensor and the work at once, without waiting: the allocator
    must have been told which streams still use the tensor's memory (the lanes' own
    kernels: a view's copy and its write-back, AVG's division; the delegate's hold on a
    call it runs, which takes no view)."""
    n = 2 * 512 + 4
    base = on_vehicle(torch.zeros(n, 2, dtype=torch.float64))
    base[:, 0].copy_(on_vehicle(value(rank, n)))
    composes = subgroup_stats(None, DEVICE) is not None
    view = base[:, 0] if composes else base[:, 0].contiguous()
    work = dist.all_reduce(view, op=dist.ReduceOp.AVG, async_op=True)
    small = produced(rank, 5)
    work_small = dist.all_reduce(small, op=dist.ReduceOp.AVG, async_op=True)
    del base, view, work, small, work_small
    return {"errors": []}


def overlapping_views(rank: int, world: int, v: Any) -> dict[str, Any]:
    """Two allreduces in flight on views that share bytes run in call order, as behind
    NCCL's one stream: the second reduces the first's result where they meet."""
    n = 512
    buf = produced(rank, 2 * n)
    before = ordering_waits()
    first_begin = launches(v)
    w1 = dist.all_reduce(buf[:n], async_op=True)
    first_end = launches(v)
    w2 = dist.all_reduce(buf[n // 2 : n + n // 2], async_op=True)
    second_begin = first_end + 1
    w1.wait()
    w2.wait()
    want = value(rank, 2 * n)
    s = total(world, 2 * n)
    want[: n // 2] = s[: n // 2]
    want[n // 2 : n] = world * s[n // 2 : n]
    want[n : n + n // 2] = s[n : n + n // 2]
    return {
        "errors": [exact(buf * 1, want)],
        "waits": ordering_waits() - before,
        "ordered": v.happens_before(first_end, second_begin),
        "first": first_end - first_begin,
    }


def disjoint_views(rank: int, world: int, v: Any) -> dict[str, Any]:
    """Views of one buffer that do not meet (DDP's buckets) do not wait for each other:
    the second's first launch is not ordered after the first's last."""
    n = 512
    buf = produced(rank, 2 * n)
    before = ordering_waits()
    w1 = dist.all_reduce(buf[:n], async_op=True)
    first_end = launches(v)
    w2 = dist.all_reduce(buf[n:], async_op=True)
    w1.wait()
    w2.wait()
    return {
        "errors": [exact(buf * 1, total(world, 2 * n))],
        "waits": ordering_waits() - before,
        "ordered": v.happens_before(first_end, first_end + 1),
    }


def delegated_after_allreduce(rank: int, world: int, v: Any) -> dict[str, Any]:
    """A collective fairring hands to the delegate (a broadcast) on memory an allreduce
    still writes runs after it; one on other memory does not wait."""
    t = produced(rank, N)
    other = produced(rank, 64)
    before = ordering_waits()
    dist.all_reduce(t, async_op=True)
    dist.broadcast(other, src=1)
    unrelated = ordering_waits() - before
    dist.broadcast(t, src=0)
    return {
        "errors": [exact(t * 1, total(world, N)), exact(other * 1, value(1, 64))],
        "waits": ordering_waits() - before,
        "unrelated_waits": unrelated,
    }


def allreduce_after_delegated(rank: int, world: int, v: Any) -> dict[str, Any]:
    """An allreduce of a tensor a delegated collective still writes (a broadcast not
    waited for) runs after it, as both would on NCCL's one stream."""
    t = produced(rank, N)
    before = ordering_waits()
    dist.broadcast(t, src=0, async_op=True)
    dist.all_reduce(t, async_op=True).wait()
    return {
        "errors": [exact(t * 1, world * value(0, N))],
        "waits": ordering_waits() - before,
    }


def barrier_waits_for_device(rank: int, world: int, v: Any) -> dict[str, Any]:
    """Past barrier() the allreduces issued before it are done on the device: a stream
    that never waited for them may read their results."""
    t = produced(rank, N)
    dist.all_reduce(t, async_op=True)
    dist.barrier()
    got = on_stream(v, "a reader after the barrier", lambda: t * 1)
    return {"errors": [exact(got, total(world, N))]}


def delegated_gather_of_a_temporary(rank: int, world: int, v: Any) -> dict[str, Any]:
    """An async all-gather handed to the delegate, of a temporary only its Work holds
    (``x.contiguous()`` of a view), then allocations on the caller's stream: the
    temporary must stay held until wait() (today's ProcessGroupNCCL keeps it on the
    Work's shelf, with no record_stream), or the allocator hands it out under the
    collective."""
    base = on_vehicle(torch.stack([value(rank, 64), value(rank, 64, 64)], dim=1))
    gathered = on_vehicle(torch.zeros(world * 64, dtype=torch.float64))
    work = dist.all_gather_into_tensor(gathered, base[:, 0].contiguous(), async_op=True)
    gc.collect()
    on_vehicle(torch.zeros(64, dtype=torch.float64)).fill_(-1.0)  # the block's next owner
    work.wait()
    want = torch.cat([value(r, 64) for r in range(world)])
    return {"errors": [exact(gathered * 1, want)]}


def delegated_reduce_scatter_list(rank: int, world: int, v: Any) -> dict[str, Any]:
    """The list form of reduce_scatter, async: the delegate flattens the inputs into a
    temporary that only its Work holds."""
    parts = [produced(rank, 32) * (j + 1) for j in range(world)]
    out = on_vehicle(torch.zeros(32, dtype=torch.float64))
    work = dist.reduce_scatter(out, parts, async_op=True)
    del parts
    gc.collect()
    on_vehicle(torch.zeros(32 * world, dtype=torch.float64)).fill_(-1.0)
    work.wait()
    return {"errors": [exact(out * 1, total(world, 32) * (rank + 1))]}


def direct_row_is_the_delegates(rank: int, world: int, v: Any) -> dict[str, Any]:
    """A call of a row that does not compose (and every call where the plan composes
    nothing) is the delegate's own Work, returned as it is."""
    t = produced(rank, SMALL)
    work = dist.all_reduce(t, async_op=True)
    own = v.is_streamed_work(work)
    work.wait()
    return {"errors": [exact(t * 1, total(world, SMALL))], "own": own}


def direct_after_composed(rank: int, world: int, v: Any) -> dict[str, Any]:
    """A call the delegate runs (a small row) on bytes a composed allreduce still
    writes runs after it, and a composed one after it in turn."""
    buf = produced(rank, 1024)
    w1 = dist.all_reduce(buf[:1000], async_op=True)
    w2 = dist.all_reduce(buf[992:1000], async_op=True)
    w3 = dist.all_reduce(buf[:1000], async_op=True)
    for w in (w1, w2, w3):
        w.wait()
    s = total(world, 1024)
    want = value(rank, 1024)
    want[:1000] = world * s[:1000]
    want[992:1000] = world * world * s[992:1000]
    return {"errors": [exact(buf * 1, want)]}


def rails_run_at_once(rank: int, world: int, v: Any) -> dict[str, Any]:
    """The rail exchanges of two pieces of one call, on two lanes, are not ordered one
    after the other (the steps overlap), also under TORCH_NCCL_BLOCKING_WAIT, where a
    step that waited with wait() would block the host until it ended."""
    dist.all_reduce(produced(rank, N))  # the sub-groups connect here, not below
    t = produced(rank, N)
    first = launches(v) + 1
    work = dist.all_reduce(t, async_op=True)
    ops = v.launches()[first - 1 :]
    work.wait()
    rails = [(op["id"], op["op"]) for op in ops if "-lane" in op["op"]]
    concurrent = None
    if rails:
        a_id, a_op = rails[0]
        lane = a_op.split("-lane")[1].split("-")[0]
        others = [i for i, op in rails if f"-lane{lane}-" not in op]
        concurrent = bool(others) and not v.happens_before(a_id, others[0])
    return {"errors": [exact(t * 1, total(world, N))], "concurrent": concurrent}


def empty_tensor(rank: int, world: int, v: Any) -> dict[str, Any]:
    t = on_vehicle(torch.zeros(0, dtype=torch.float64))
    dist.all_reduce(t, async_op=True).get_future().wait()
    return {"errors": [exact(t * 1, torch.zeros(0, dtype=torch.float64))]}


SCENARIOS: dict[str, Callable[[int, int, Any], dict[str, Any]]] = {
    f.__name__: f
    for f in (
        future_wait,
        work_wait,
        work_synchronize,
        sync_call,
        then_callback,
        is_completed_poll,
        side_stream_caller,
        unwaited_read,
        averaged_view,
        int16_and_coalesced,
        freed_at_once,
        overlapping_views,
        disjoint_views,
        delegated_after_allreduce,
        allreduce_after_delegated,
        barrier_waits_for_device,
        delegated_gather_of_a_temporary,
        delegated_reduce_scatter_list,
        direct_row_is_the_delegates,
        direct_after_composed,
        rails_run_at_once,
        empty_tensor,
    )
}


def run_scenarios(rank: int, world: int, names: list[str]) -> dict[str, dict[str, Any]]:
    stream_mutants.arm_from_env()
    v = stream_vehicle.init_fairring()
    outcomes: dict[str, dict[str, Any]] = {}
    try:
        for name in names:
            scenario = SCENARIOS[name]
            v.synchronize()
            v.clear_races()
            outcome = scenario(rank, world, v)
            gc.collect()  # what the scenario dropped is freed (and checked) now
            outcome["races"] = v.races()
            outcome["errors"] = [e for e in outcome["errors"] if e]
            outcomes[name] = outcome
        outcomes["_stats"] = {"stats": subgroup_stats(None, DEVICE)}
    finally:
        stream_vehicle.finish()
    return outcomes


# Below 1 KiB the delegate's own allreduce; pieces of at most SLICE_SIZE bytes, the
# all-to-all exchange with three or more pieces per call below 8 KiB (the views), NCCL's
# reduce-scatter and all-gather on the rail with two or more from 8 KiB (N float64):
# every row, both exchanges, several pieces on both lanes.
PLAN = "0:nccl,1K:compose:3:alltoall,8K:compose:2:reduce_scatter"


def vehicle_env() -> dict[str, str | None]:
    return fairring_env(
        total_memory=TOTAL_MEMORY,
        slice_size=SLICE_SIZE,
        FAIRRING_SLICE_SCALING="off",
        FAIRRING_LANES=2,
        FAIRRING_TEST_CUDA_PLAN=PLAN,
    )


# 2x2: local reduce-scatter and all-gather groups and two lanes; 3x1: the rail alone,
# where the lanes read and write the caller's tensor themselves; 1x2: one machine, where
# the plan composes nothing and every call is the delegate's own.
JOB_SHAPES = ("2x2", "3x1", "1x2")
MACHINES = {**SHAPES, "1x2": ["m0", "m0"]}


def selected() -> list[str]:
    """The scenarios a job runs: all, or those FAIRRING_TEST_SCENARIOS names (how
    scripts/stream_mutants.sh runs only the tests that catch one plant)."""
    names = os.environ.get("FAIRRING_TEST_SCENARIOS")
    return list(SCENARIOS) if not names else names.split(",")


@memoised
def job(shape: str) -> list[dict[str, dict[str, Any]]]:
    stream_vehicle.ensure_built()
    machines = MACHINES[shape]
    return run_ranks(
        run_scenarios,
        len(machines),
        machines,
        env=vehicle_env(),
        timeout_s=TIMEOUT_S,
        init_group=False,
        names=selected(),
    )


def outcome(shape: str, scenario: str) -> list[dict[str, Any]]:
    return [per_rank[scenario] for per_rank in job(shape)]


CLEAN = [s for s in SCENARIOS if s != "unwaited_read"]


@pytest.mark.parametrize("scenario", CLEAN)
@pytest.mark.parametrize("shape", JOB_SHAPES)
def test_no_race_and_exact(shape: str, scenario: str) -> None:
    for rank, got in enumerate(outcome(shape, scenario)):
        assert got["races"] == [], f"rank {rank}: " + "\n".join(got["races"])
        assert got["errors"] == [], f"rank {rank}: {got['errors']}"


@pytest.mark.parametrize("shape", JOB_SHAPES)
def test_a_read_not_waited_for_is_a_race(shape: str) -> None:
    for rank, got in enumerate(outcome(shape, "unwaited_read")):
        assert any("'aten::mul'" in r for r in got["races"]), (rank, got["races"])
        assert got["errors"] == []


@pytest.mark.parametrize("shape", ("2x2", "3x1"))
def test_overlapping_views_wait_disjoint_ones_do_not(shape: str) -> None:
    for got in outcome(shape, "overlapping_views"):
        assert got["waits"] == 1 and got["ordered"], got
    for got in outcome(shape, "disjoint_views"):
        assert got["waits"] == 0 and not got["ordered"], got


@pytest.mark.parametrize("shape", JOB_SHAPES)
def test_delegated_collectives_wait_only_on_shared_memory(shape: str) -> None:
    # One machine: every call is the delegate's, which orders them on its own stream.
    want = 0 if shape == "1x2" else 1
    for got in outcome(shape, "delegated_after_allreduce"):
        assert got["unrelated_waits"] == 0 and got["waits"] == want, got
    for got in outcome(shape, "allreduce_after_delegated"):
        assert got["waits"] == want, got


@memoised
def blocking_wait_job() -> list[dict[str, dict[str, Any]]]:
    stream_vehicle.ensure_built()
    return run_ranks(
        run_scenarios,
        4,
        MACHINES["2x2"],
        env={**vehicle_env(), "TORCH_NCCL_BLOCKING_WAIT": "1"},
        timeout_s=TIMEOUT_S,
        init_group=False,
        names=["rails_run_at_once"],
    )


@pytest.mark.parametrize("blocking", [False, True])
def test_the_rail_exchanges_of_a_call_overlap(blocking: bool) -> None:
    """A step's collective is waited for on the device only: under
    TORCH_NCCL_BLOCKING_WAIT a wait() per step would run the steps one at a time."""
    outcomes = blocking_wait_job() if blocking else job("2x2")
    for rank, per_rank in enumerate(outcomes):
        got = per_rank["rails_run_at_once"]
        assert got["errors"] == [] and got["races"] == [], (rank, got)
        assert got["concurrent"] is True, (rank, got)


@pytest.mark.parametrize("shape", JOB_SHAPES)
def test_a_call_that_does_not_compose_is_the_delegates_own(shape: str) -> None:
    for got in outcome(shape, "direct_row_is_the_delegates"):
        assert got["own"], got


@functools.cache
def _paths() -> dict[str, Any]:
    return {shape: job(shape)[0]["_stats"]["stats"] for shape in JOB_SHAPES}


@pytest.mark.parametrize("shape", JOB_SHAPES)
def test_the_scenarios_took_the_paths_they_test(shape: str) -> None:
    stats = _paths()[shape]
    if shape == "1x2":
        # One machine: the plan composes nothing, and nothing of fairring's is in the way.
        assert stats is None, stats
        return
    assert stats["operations"] > len(SCENARIOS)
    assert stats["sliced_units"] > 2 * len(SCENARIOS) and stats["direct_units"] > 0, stats
    # Every row of the plan: the delegate's, and both rail exchanges.
    assert len(stats["rows"]) == 3 and min(stats["rows"]) > 0, stats
    # The events come from a pool: far fewer than the steps that recorded one.
    assert 0 < stats["events_created"] < stats["sliced_units"], stats
