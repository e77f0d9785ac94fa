"""Corners of today's ProcessGroupNCCL that the CUDA path must expect, on the stream
vehicle (tests/stream_vehicle.py), each once a defect found by reading (issue 49):

- a synchronous call returns no Work (torch's distributed_c10d.py: "the backend has
  sync'ed at CPP level"): timed trial calls of a measured size class must not need one;
- point-to-point calls involve two ranks: nothing they mark may change what a later
  collective of every rank does (the delegate's barrier);
- a coalesced Work's future carries no event (ProcessGroupNCCL::endCoalescing marks it
  with an empty list): waiting on it orders nothing, so a composed allreduce of its
  output must be ordered another way;
- calls only the composition takes (int16, views: NCCL refuses them) are no trials;
- AVG of float16 near the top of its range premultiplies as NCCL does, not overflows;
- a wait that times out aborts the composition's communicators;
- a composed Work leaves torch's registry of in-flight collectives when waited for.

Each job runs its scenario on every rank and returns what every rank saw; the plants
(src/faults/plants.h) put each of the first four defects back, and
scripts/stream_mutants.sh shows these tests catching them.
"""

from __future__ import annotations

import gc
from datetime import timedelta
from typing import Any

import pytest
import stream_mutants
import stream_vehicle
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from test_stream_order import MACHINES, exact, on_vehicle, produced, total, value, vehicle_env

from fairring_pg import measured
from fairring_pg.group_info import subgroup_stats

DEVICE = stream_vehicle.DEVICE
# The 1-8 KiB class measured (NCCL's own against the composition), larger calls composed.
MEASURED_PLAN = "0:nccl,1K:measure:3:alltoall,8K:compose:2:reduce_scatter"
MEASURED_N = 256  # 2 KiB of float64: a call of the measured class
TIMEOUT_S = 120


def job(
    fn: Any, shape: str, plan: str | None = None, timeout_s: float = TIMEOUT_S, **kwargs: Any
) -> list[Any]:
    stream_vehicle.ensure_built()
    env = vehicle_env()
    if plan is not None:
        env["FAIRRING_TEST_CUDA_PLAN"] = plan
    machines = MACHINES[shape]
    return run_ranks(
        fn,
        len(machines),
        machines,
        env=env,
        timeout_s=timeout_s,
        init_group=False,
        **kwargs,
    )


def started() -> Any:
    stream_mutants.arm_from_env()
    return stream_vehicle.init_fairring(timeout=timedelta(seconds=60))


def outcome(v: Any, errors: list[str | None], **more: Any) -> dict[str, Any]:
    gc.collect()
    v.synchronize()
    return {"errors": [e for e in errors if e], "races": v.races(), **more}


def decisions(device: str = DEVICE) -> list[dict[str, Any]]:
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return measured.decisions_of(backend, (device,))


# ------------------------------------------------------------------ 1. no Work


def sync_calls_of_a_measured_class(rank: int, world: int) -> dict[str, Any]:
    """Synchronous allreduces (async_op=False, as DDP-less training loops call them)
    through every trial call of a measured class and past its decision."""
    v = started()
    try:
        errors = []
        for call in range(measured.TRIAL_CALLS + 2):
            t = produced(rank, MEASURED_N) * (call + 1)
            dist.all_reduce(t)
            errors.append(exact(t * 1, total(world, MEASURED_N) * (call + 1)))
        return outcome(v, errors, decisions=decisions())
    finally:
        stream_vehicle.finish()


def test_synchronous_calls_through_a_measured_class_are_timed_and_exact() -> None:
    for rank, got in enumerate(job(sync_calls_of_a_measured_class, "2x2", MEASURED_PLAN)):
        assert got["errors"] == [] and got["races"] == [], (rank, got)
        # Every trial call was timed (a synchronous one on the caller's stream): the
        # class was decided, alike on every rank.
        assert len(got["decisions"]) == 1, (rank, got["decisions"])
        assert got["decisions"][0]["trial_calls"] == measured.TRIAL_CALLS


# ------------------------------------------------------------------ 2. pairs


def pairs_then_barrier(rank: int, world: int, batched: bool) -> dict[str, Any]:
    """Ranks 0 and 1 exchange (send/recv, or batch_isend_irecv); the others do not;
    then every rank's barrier, then an allreduce."""
    v = started()
    try:
        errors = []
        dist.all_reduce(produced(rank, 3 * 512 + 3))  # the sub-groups connect
        if rank in (0, 1):
            peer = 1 - rank
            mine = on_vehicle(value(rank, 40))
            got = on_vehicle(torch.zeros(40, dtype=torch.float64))
            if batched:
                ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            elif rank == 0:
                dist.send(mine, 1)
                dist.recv(got, 1)
            else:
                dist.recv(got, 0)
                dist.send(mine, 0)
            errors.append(exact(got * 1, value(peer, 40)))
        dist.barrier()
        t = produced(rank, 64)
        dist.all_reduce(t)
        errors.append(exact(t * 1, total(world, 64)))
        return outcome(v, errors)
    finally:
        stream_vehicle.finish()


@pytest.mark.parametrize("batched", [False, True], ids=["send_recv", "batch_isend_irecv"])
def test_point_to_point_then_barrier_does_not_hang(batched: bool) -> None:
    # A hang (the bug) ends at the job's deadline: 6 times a healthy run (4 s), shorter
    # than the others', so that the plant's run ends sooner.
    for rank, got in enumerate(job(pairs_then_barrier, "2x2", timeout_s=25, batched=batched)):
        assert got["errors"] == [] and got["races"] == [], (rank, got)


# ------------------------------------------------------------------ 3. eventless Works


def uneven_gather_then_allreduce(rank: int, world: int) -> dict[str, Any]:
    """An async all_gather into views of one buffer, of uneven sizes (a coalesced Work,
    its future marked with no tensor), then a composed allreduce of the whole buffer,
    not waited for in between: NCCL would run the allreduce after the gather on its one
    stream; the composition must too."""
    v = started()
    try:
        # The sub-groups connect first (connecting waits on the host, past anything before).
        dist.all_reduce(produced(rank, 3 * 512 + 3))
        sizes = [512 + 40 * r for r in range(world)]
        buf = on_vehicle(torch.zeros(sum(sizes) + 1100, dtype=torch.float64))
        outs = list(buf[: sum(sizes)].split(sizes))
        mine = on_vehicle(value(rank, sizes[rank]))
        gathered = dist.all_gather(outs, mine, async_op=True)
        eventless = gathered.get_future().value() == []
        dist.all_reduce(buf, async_op=True).wait()
        gathered.wait()
        want = torch.zeros(sum(sizes) + 1100, dtype=torch.float64)
        want[: sum(sizes)] = world * torch.cat([value(r, s) for r, s in enumerate(sizes)])
        stats = subgroup_stats(None, DEVICE)
        return outcome(v, [exact(buf * 1, want)], eventless=eventless, stats=stats)
    finally:
        stream_vehicle.finish()


def test_an_allreduce_after_a_coalesced_work_is_ordered_after_it() -> None:
    for rank, got in enumerate(job(uneven_gather_then_allreduce, "2x2")):
        assert got["eventless"], "the stand-in's uneven all_gather must model NCCL's"
        assert got["stats"]["composed_calls"] == 2, got["stats"]
        assert got["stats"]["ordering_waits"] >= 1, got["stats"]
        assert got["races"] == [], (rank, "\n".join(got["races"]))
        assert got["errors"] == [], (rank, got["errors"])


# ------------------------------------------------------------------ 4. one-way calls


def one_way_calls_in_a_measured_class(rank: int, world: int) -> dict[str, Any]:
    """int16 and non-contiguous views of the measured class's size, interleaved with
    float64 calls, past the decision: none raises, every one exact, and the float64
    calls are decided."""
    v = started()
    try:
        errors = []
        n = MEASURED_N
        for call in range(measured.TRIAL_CALLS + 2):
            small = on_vehicle(((torch.arange(4 * n) % 50) * (rank + 1) - 70).to(torch.int16))
            dist.all_reduce(small)
            want = sum(((torch.arange(4 * n) % 50) * (r + 1) - 70) for r in range(world))
            errors.append(exact(small * 1, want.to(torch.int16)))
            base = on_vehicle(torch.zeros(n, 2, dtype=torch.float64))
            base[:, 1].copy_(on_vehicle(value(rank, n)))
            dist.all_reduce(base[:, 1])
            want_view = torch.zeros(n, 2, dtype=torch.float64)
            want_view[:, 1] = total(world, n)
            errors.append(exact(base * 1, want_view))
            t = produced(rank, n) * (call + 1)
            dist.all_reduce(t)
            errors.append(exact(t * 1, total(world, n) * (call + 1)))
        return outcome(v, errors, decisions=decisions())
    finally:
        stream_vehicle.finish()


def test_calls_only_the_composition_takes_are_no_trials() -> None:
    for rank, got in enumerate(job(one_way_calls_in_a_measured_class, "2x2", MEASURED_PLAN)):
        assert got["errors"] == [] and got["races"] == [], (rank, got)
        assert len(got["decisions"]) == 1, (rank, got["decisions"])


# ------------------------------------------------------------------ AVG, timeout, registry


def half_average_near_the_top(rank: int, world: int) -> dict[str, Any]:
    """float16 AVG of 40000 on every rank: the sum (160000) is past float16's 65504, the
    average is not. Composed (a large call) and NCCL's own (a small one)."""
    v = started()
    try:
        errors = []
        for n in (3 * 2048 + 5, 8):
            t = on_vehicle(torch.full((n,), 40000.0, dtype=torch.float16))
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            errors.append(exact(t * 1, torch.full((n,), 40000.0, dtype=torch.float16)))
        return outcome(v, errors, stats=subgroup_stats(None, DEVICE))
    finally:
        stream_vehicle.finish()


def test_half_average_premultiplies_as_nccl_does() -> None:
    for rank, got in enumerate(job(half_average_near_the_top, "2x2")):
        assert got["errors"] == [] and got["races"] == [], (rank, got)
        assert got["stats"]["composed_calls"] == 1, got["stats"]


def wait_that_times_out(rank: int, world: int) -> dict[str, Any]:
    """The device never gets to a composed call (the vehicle answers 'not yet' for
    ever): wait(timeout) raises, and the composition's communicators are aborted."""
    v = started()
    dist.all_reduce(produced(rank, 3 * 512 + 3))  # the sub-groups connect
    v.synchronize()
    v.set_patience(1 << 30)
    work = dist.all_reduce(produced(rank, 3 * 512 + 3), async_op=True)
    try:
        work.wait(timeout=timedelta(milliseconds=300))
        raised = ""
    except RuntimeError as exc:
        raised = str(exc)
    stats = subgroup_stats(None, DEVICE)
    v.set_patience(8)
    stream_vehicle.finish()
    return {"raised": raised, "stats": stats}


def test_a_wait_that_times_out_aborts_the_sub_groups() -> None:
    for rank, got in enumerate(job(wait_that_times_out, "2x2")):
        assert "did not finish within 300 ms" in got["raised"], (rank, got)
        # Two lanes and two local groups: ProcessGroupNCCL aborts the communicator of
        # a Work whose blocking wait timed out; the composition aborts its own.
        assert got["stats"]["timeout_aborts"] == 4, (rank, got["stats"])


def registry_after_waits(rank: int, world: int) -> dict[str, Any]:
    """Under allow_inflight_collective_as_graph_input every Work of the group goes into
    torch's registry; wait() takes it out (WorkNCCL::synchronize does)."""
    from torch.distributed._functional_collectives import (
        allow_inflight_collective_as_graph_input_ctx,
    )

    v = started()
    try:
        registry = torch._C._distributed_c10d._get_work_registry_size
        before = registry()
        with allow_inflight_collective_as_graph_input_ctx():
            composed = produced(rank, 3 * 512 + 3)
            own = produced(rank, 8)
            works = [dist.all_reduce(t, async_op=True) for t in (composed, own)]
            during = registry()
            for work in works:
                work.wait()
        after = registry()
        errors = [exact(composed * 1, total(world, 3 * 512 + 3)), exact(own * 1, total(world, 8))]
        return outcome(v, errors, counts=(before, during, after))
    finally:
        stream_vehicle.finish()


def test_waited_works_leave_the_graph_input_registry() -> None:
    for rank, got in enumerate(job(registry_after_waits, "2x2")):
        assert got["errors"] == [] and got["races"] == [], (rank, got)
        before, during, after = got["counts"]
        assert during == before + 2 and after == before, (rank, got["counts"])


# ------------------------------------------------------------------ blocking wait's words


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, True),
        ({"TORCH_NCCL_BLOCKING_WAIT": "TRUE"}, True),
        ({"TORCH_NCCL_BLOCKING_WAIT": "yes"}, True),
        ({"TORCH_NCCL_BLOCKING_WAIT": "Y"}, True),
        ({"TORCH_NCCL_BLOCKING_WAIT": "t"}, True),
        ({"TORCH_NCCL_BLOCKING_WAIT": "0"}, False),
        ({"TORCH_NCCL_BLOCKING_WAIT": "No"}, False),
        ({"NCCL_BLOCKING_WAIT": "1"}, True),  # the old name
        ({"TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "1"}, False),  # new wins
        ({"TORCH_NCCL_BLOCKING_WAIT": "1", "NCCL_BLOCKING_WAIT": "false"}, True),
    ],
)
def test_blocking_wait_is_read_as_torch_reads_it(env: dict[str, str], on: bool) -> None:
    import native_module

    assert native_module.load().read_blocking_wait(env) == (on, "")


@pytest.mark.parametrize(
    "env",
    [{"TORCH_NCCL_BLOCKING_WAIT": "2"}, {"NCCL_BLOCKING_WAIT": "maybe"}],
)
def test_a_blocking_wait_that_is_no_truth_value_names_the_variable(env: dict[str, str]) -> None:
    import native_module

    on, error = native_module.load().read_blocking_wait(env)
    (name, raw), *_ = env.items()
    assert not on and name in error and repr(raw) in error.replace('"', "'"), error


# ------------------------------------------------------------------ Gloo's local groups


def local_gloo_allreduce(rank: int, world: int) -> dict[str, Any]:
    """Composed allreduces with Gloo's local groups (FAIRRING_TEST_LOCAL_GLOO, as on one
    GPU shared by the ranks of a simulated machine): Gloo's reduce-scatter of device
    tensors writes its output only in wait(), so a step that only synchronize()d would
    reduce the machine's chunk unreduced."""
    v = started()
    try:
        errors = []
        for n in (3 * 512 + 3, 3 * 2048 + 7):
            t = produced(rank, n)
            dist.all_reduce(t, async_op=True).wait()
            errors.append(exact(t * 1, total(world, n)))
        return outcome(v, errors, stats=subgroup_stats(None, DEVICE))
    finally:
        stream_vehicle.finish()


def test_gloo_local_groups_are_waited_for() -> None:
    stream_vehicle.ensure_built()
    env = {**vehicle_env(), "FAIRRING_TEST_LOCAL_GLOO": "on"}
    results = run_ranks(
        local_gloo_allreduce, 4, MACHINES["2x2"], env=env, timeout_s=TIMEOUT_S, init_group=False
    )
    for rank, got in enumerate(results):
        assert got["stats"]["composed_calls"] == 2, got["stats"]
        assert got["errors"] == [] and got["races"] == [], (rank, got)
