"""One group, one failure: a connection that breaks under a collective issued from a
callback (a comm hook's, on the callbacks' engine) fails the program's later calls
too, on every rank, with the same reason (chaos seed 201: a DDP step whose chained
hook's allreduce met a cut raised, and the reduce-scatters and all-gathers after it
completed)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import fault_points
import stream_mutants
import torch
import torch.distributed as dist
from killed_peer import warm_up
from multiprocess import launch
from reliability_helpers import default_store, store_barrier

GROUP_TIMEOUT_S = 30.0
TOLD_S = 1.0  # the reason travels ahead of the close: nothing waits for the timeout


def _nested(group: Any, arm: bool) -> Any:
    """An allreduce whose callback issues another (on the callbacks' engine); with
    ``arm``, the callback first arms a break of the next body read from rank 1."""

    def callback(f: torch.futures.Future[Any]) -> str | None:
        if arm:
            fault_points.arm("mesh.read.close", "close", key=1)
        try:
            dist.all_reduce(torch.ones(10), group=group)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            return str(exc)
        return None

    return dist.all_reduce(torch.ones(10), group=group, async_op=True).get_future().then(callback)


def _after_a_callbacks_failure(rank: int, world: int) -> dict[str, Any]:
    stream_mutants.arm_from_env()
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    warm_up(rank, group)
    assert _nested(group, arm=False).wait() is None  # the callbacks' engine is up
    store_barrier(default_store(), "started", world, 30)
    nested = _nested(group, arm=rank == 0).wait()
    results = {}
    for name, call in (
        ("allreduce", lambda: dist.all_reduce(torch.ones(100), group=group)),
        (
            "reduce_scatter",
            lambda: dist.reduce_scatter_tensor(torch.empty(5), torch.ones(5 * world), group=group),
        ),
    ):
        t0 = time.monotonic()
        try:
            call()
            results[name] = (None, time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            results[name] = (str(exc), time.monotonic() - t0)
    dist.destroy_process_group(group)
    return {"nested": nested, "later": results}


def test_a_failure_under_a_callbacks_collective_fails_the_programs_later_calls() -> None:
    outcomes = launch(_after_a_callbacks_failure, 2, ["m0", "m1"], timeout_s=120)
    bad = [o.describe() for o in outcomes if not o.ok]
    assert not bad, "\n".join(bad)
    for o in outcomes:
        v = o.value
        assert v["nested"] is not None and "rank 1" in v["nested"], (o.rank, v["nested"])
        for name, (message, took) in v["later"].items():
            assert message is not None, f"rank {o.rank}: the {name} after it completed"
            assert "rank 0" in message and "rank 1" in message, (o.rank, name, message)
            assert took < TOLD_S, f"rank {o.rank}: the {name} raised after {took:.2f} s"
