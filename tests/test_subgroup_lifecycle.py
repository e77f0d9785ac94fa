"""The sub-group path's life cycle on CPU (FAIRRING_TEST_CPU_SUBGROUPS over Gloo):
connecting and checking the sub-groups before the first allreduce, the Work it hands
out, and destroy_process_group() after it: graceful after healthy work, an abort of
every sub-group (the world group included) at once after a failure.

On CUDA the same code creates and connects every NCCL communicator at the first
allreduce, drains the device at destroy, and gives ProcessGroupNCCL's Work semantics;
the stream-only parts of that need a GPU (tests/test_cuda*.py). Here each job makes a
second fairring group with ``dist.new_group`` so that it can break or destroy it while
the harness's default group stays.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from multiprocess import fairring_env, launch, run_ranks

from fairring_pg.group_info import subgroup_stats

SHAPE = ["m0", "m0", "m1", "m1"]  # 2 machines x 2 ranks: local groups and lanes


def env(**extra: str | int) -> dict[str, str | None]:
    return fairring_env(
        total_memory=64 * 1024,
        slice_size=4 * 1024,
        FAIRRING_SLICE_SCALING="off",
        FAIRRING_TEST_CPU_SUBGROUPS="on",
        FAIRRING_LANES=2,
        FAIRRING_DIRECT_BELOW=0,
        FAIRRING_CUDA_ALLREDUCE="lanes",  # composed: auto runs NCCL's allreduce on unknown nodes
        **extra,
    )


def value(rank: int, n: int) -> torch.Tensor:
    """Distinct, non-integer values per rank and element: a shard in the wrong place
    shows."""
    return torch.arange(n, dtype=torch.float64) * 0.25 + rank * 1000.5


def expected_sum(world: int, n: int) -> torch.Tensor:
    return sum(value(r, n) for r in range(world))


# ------------------------------------------------------------ connecting, checked


def with_reversed_rails(rank: int, world: int) -> str:
    """A second fairring group whose lanes number the machines of the rail backwards
    (a consistent, connected Gloo group, but not the one fairring asked for): its first
    allreduce must refuse it on every rank instead of putting shards in wrong places."""
    from fairring_pg import process_groups

    made = process_groups.gloo_maker

    def reversed_lanes(store: Any, timeout: Any, config: Any, global_ranks: list[int]) -> Any:
        make = made(store, timeout, config, global_ranks)

        def make_group(prefix: str, r: int, size: int, members: list[int], name: str) -> Any:
            if "-lane" in name:
                return make(prefix, size - 1 - r, size, members[::-1], name)
            return make(prefix, r, size, members, name)

        return make_group

    process_groups.gloo_maker = reversed_lanes
    try:
        group = dist.new_group(backend="fairring")
    finally:
        process_groups.gloo_maker = made
    t = value(rank, 4000)
    dist.all_reduce(t, group=group)
    return f"allreduce on misbuilt lanes returned {t[:3].tolist()}"


def test_misbuilt_sub_groups_are_refused_before_the_first_unit() -> None:
    outcomes = launch(with_reversed_rails, 4, SHAPE, env=env(), timeout_s=120, abort_grace_s=30)
    for o in outcomes:
        assert o.status == "error", o.describe()
        message = o.error_message or ""
        assert "lane 0 of the rail (all-to-all)" in message, o.describe()
        assert "does not hold the ranks it was built from" in message, o.describe()
        assert f"rank {o.rank}" in message, o.describe()


# ------------------------------------------------------------------- the Work


def work_semantics(rank: int, world: int) -> dict[str, Any]:
    n = 5001  # a slice tail: units on both paths
    t = value(rank, n)
    work = dist.all_reduce(t, async_op=True)
    assert work is not None
    waited = work.wait(timeout=timedelta(seconds=30))
    work.synchronize()
    work.block_current_stream()
    future = work.get_future()
    try:
        exception = work.exception()
    except TypeError:
        # torch 2.11 cannot hand Work.exception() to Python for any backend (its
        # std::exception_ptr has no binding): nothing to compare there.
        assert torch.__version__ < "2.12", torch.__version__
        exception = None
    return {
        "waited": waited,
        "completed": work.is_completed(),
        "success": work.is_success(),
        "exception": exception,
        "future_done": future.done(),
        "exact": torch.equal(t, expected_sum(world, n)),
        "future_value_is_result": future.value()[0] is t or torch.equal(future.value()[0], t),
    }


def test_work_reports_like_process_group_nccls() -> None:
    for r in run_ranks(work_semantics, 4, SHAPE, env=env(), timeout_s=120):
        assert r == {
            "waited": True,
            "completed": True,
            "success": True,
            "exception": None,
            "future_done": True,
            "exact": True,
            "future_value_is_result": True,
        }, r


# --------------------------------------------------------------- destroy after work


def destroy_after_work(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(backend="fairring")
    backend = group._get_backend(torch.device("cpu"))
    n = 9000
    tensors = [value(rank + i, n) for i in range(4)]
    for t in tensors:
        dist.all_reduce(t, group=group, async_op=True)
    dist.destroy_process_group(group)
    exact = [
        torch.equal(t, sum(value(r + i, n) for r in range(world))) for i, t in enumerate(tensors)
    ]
    try:
        backend.allreduce([value(rank, 10)])
        after = "an allreduce after destroy was accepted"
    except RuntimeError as exc:
        after = str(exc)
    # The default group (and so the job) carries on.
    u = value(rank, 7)
    dist.all_reduce(u)
    return {
        "exact": exact,
        "after": after,
        "default_group": torch.equal(u, expected_sum(world, 7)),
        "stats": backend.subgroup_stats("cpu"),
    }


def test_destroy_keeps_results_and_refuses_later_work() -> None:
    for r in run_ranks(destroy_after_work, 4, SHAPE, env=env(), timeout_s=120):
        assert r["exact"] == [True] * 4, r
        assert "after the process group was shut down" in r["after"], r
        assert r["default_group"], r
        # A healthy group ends gracefully: nothing aborted.
        assert r["stats"]["shutdown"] == "drained" and r["stats"]["aborted_groups"] == 0, r


# ------------------------------------------------------------- destroy after a failure

FAILED_GROUP_TIMEOUT_S = 20


def destroy_after_failure(rank: int, world: int) -> dict[str, Any]:
    """The last rank dies (SIGKILL) after a warm-up; the others reduce on the group until
    it fails, then destroy it (timed)."""
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=FAILED_GROUP_TIMEOUT_S))
    backend = group._get_backend(torch.device("cpu"))
    t = value(rank, 9000)
    dist.all_reduce(t, group=group)
    warm = torch.equal(t, expected_sum(world, 9000))
    dist.barrier(group=group)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    error = None
    for _ in range(1000):
        try:
            dist.all_reduce(t, group=group)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            error = str(exc)
            break
    before = subgroup_stats(group, "cpu")
    start = time.monotonic()
    dist.destroy_process_group(group)
    return {
        "warm": warm,
        "error": error,
        "destroy_s": time.monotonic() - start,
        "before": before,
        "after": backend.subgroup_stats("cpu"),
    }


def test_destroy_after_a_failure_aborts_at_once() -> None:
    """A group whose sub-groups failed is not drained: destroy aborts every one of them,
    the world group included (2 lanes, 2 local groups and the world at 2x2), well within
    the group's 20 s timeout."""
    outcomes = launch(
        destroy_after_failure,
        4,
        SHAPE,
        env=env(),
        timeout_s=FAILED_GROUP_TIMEOUT_S + 60,
        abort_grace_s=None,
    )
    assert outcomes[3].status == "crashed", outcomes[3].describe()
    for o in outcomes[:3]:
        assert o.ok, o.describe()
        r = o.value
        assert r["warm"] and r["error"] is not None and "failed on rank" in r["error"], r
        assert r["before"]["shutdown"] == "running", r
        assert r["after"]["shutdown"] == "aborted: failed", r
        assert r["after"]["aborted_groups"] == 5, r
        assert r["destroy_s"] < FAILED_GROUP_TIMEOUT_S / 10, r


# ------------------------------------------- a failed call: GroupFailure's rules


def failing_turn(rank: int, world: int) -> dict[str, Any]:
    """Every rank's third composed call on a second fairring group fails as it is issued
    (the fault point ``subgroups.issue`` at turn 2, armed on every rank, so that no rank
    waits for another's missing call): the two before it complete exactly; it raises
    its own error; every later allreduce of the group (composed, and one the plan gives
    to the delegate) and its barrier raise that first error as a refusal; destroy does
    not drain it."""
    import fault_points

    group = dist.new_group(backend="fairring")
    backend = group._get_backend(torch.device("cpu"))
    fault_points.arm("subgroups.issue", "throw", key=2)
    ts = [value(rank, 4000) for _ in range(4)]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in ts[:2]]

    def outcome(call: Any) -> str | None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return str(exc)
        return None

    third = outcome(lambda: dist.all_reduce(ts[2], group=group))
    for w in works:
        w.wait()
    exact = [torch.equal(t, expected_sum(world, 4000)) for t in ts[:2]]
    later = outcome(lambda: dist.all_reduce(ts[3], group=group))
    small = outcome(lambda: dist.all_reduce(torch.ones(3), group=group))
    barrier = outcome(lambda: dist.barrier(group=group))
    fired = fault_points.uses("subgroups.issue")
    start = time.monotonic()
    dist.destroy_process_group(group)
    return {
        "exact": exact,
        "third": third,
        "later": later,
        "small": small,
        "barrier": barrier,
        "fired": fired,
        "destroy_s": time.monotonic() - start,
        "stats": backend.subgroup_stats("cpu"),
    }


def test_a_failed_call_fails_the_group_from_its_turn() -> None:
    for r in run_ranks(failing_turn, 4, SHAPE, env=env(), timeout_s=120):
        assert r["fired"] == 1, r
        assert r["exact"] == [True, True], r
        assert r["third"] is not None and "fault point subgroups.issue" in r["third"], r
        assert "failed on rank" in r["third"], r
        refusal = r["third"] + " (this process group failed earlier and cannot be used)"
        assert r["later"] == refusal and r["small"] == refusal and r["barrier"] == refusal, r
        # Failed: the sub-groups are aborted, not drained, and at once.
        assert r["stats"]["shutdown"] == "aborted: failed", r
        assert r["destroy_s"] < 2, r
