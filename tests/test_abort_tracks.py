"""A failed rank's close waits for one abort per peer, the one on the gather track (always
read), not for a reduce-track abort that a writer held at another peer's parked reduce
track cannot send (chaos seed 74: destroy took the whole 2 s grace). A peer that reads
the reduce track's close first waits for the gather track's end before it calls the rank
lost, so the reason still arrives. Plants close_waits_reduce_abort and
reduce_close_not_held put each half back (tests/stream_mutants.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import fault_points
import stream_mutants
import torch
import torch.distributed as dist
from killed_peer import warm_up
from multiprocess import launch
from reliability_helpers import default_store
from test_failure_semantics import _attempt, _destroy

GROUP_TIMEOUT_S = 30.0
TOLD_S = 5.0
# Planted, the holder's destroy sits out GroupFailure's 2 s grace.
DESTROY_S = 1.0
JOB_TIMEOUT_S = 120


REDUCE_HELD_MS = 8000
REDUCE_HOLDER = 1
ABORT_READ_LATE_MS = 400


def _refused_with_reduce_aborts_held(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 refuses a call, and its reduce-track aborts are held past the grace (chaos
    seed 74: one rail writer serves a track to every rail peer, and a peer whose reduce
    track is parked at a message holds it, with every abort queued behind it). Its
    gather-track abort leaves: every peer is told, so its close waits for nothing more.
    Rank 0 acts on that abort 0.4 s late, so that it reads the reduce track's close
    first: a close without an abort before it, which is not the peer's death."""
    stream_mutants.arm_from_env()
    if rank == REDUCE_HOLDER:
        fault_points.arm("mesh.send.first.reduce", "delay", delay_ms=REDUCE_HELD_MS, times=8)
    else:
        fault_points.arm(
            "engine.abort", "delay", delay_ms=ABORT_READ_LATE_MS, times=8, key=REDUCE_HOLDER
        )
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    warm_up(rank, group)
    store = default_store()
    out = torch.empty(1000)
    if rank == REDUCE_HOLDER:
        # Only once rank 0 waits for this rank's part: the close is then needed there.
        store.wait(["held_reduce/posted"], timedelta(seconds=GROUP_TIMEOUT_S))
        inp = torch.ones(world * 1000 + 1)
        message, elapsed_s = _attempt(lambda: dist.reduce_scatter_tensor(out, inp, group=group))
    else:
        inp = torch.ones(world * 1000)
        work = dist.reduce_scatter_tensor(out, inp, group=group, async_op=True)
        store.set("held_reduce/posted", "1")
        message, elapsed_s = _attempt(work.wait)
    return {
        "message": message,
        "elapsed_s": elapsed_s,
        "destroy_s": _destroy(group),
        "fired": {p: fault_points.uses(p) for p in ("mesh.send.first.reduce", "engine.abort")},
    }


def test_a_held_reduce_track_holds_neither_the_reason_nor_the_close() -> None:
    outcomes = launch(_refused_with_reduce_aborts_held, 2, ["m0", "m1"], timeout_s=JOB_TIMEOUT_S)
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    # The reader's side of the interleaving happened (the holder's writer may close
    # before it reaches its held abort: the close waits for it either way, planted).
    assert outcomes[0].value["fired"]["engine.abort"] >= 1, outcomes[0].value
    why = f"reduce_scatter on rank {REDUCE_HOLDER}"
    for o in outcomes:
        v = o.value
        assert v["message"] is not None and why in v["message"], f"rank {o.rank}: {v['message']!r}"
        assert v["elapsed_s"] < TOLD_S, f"rank {o.rank}: raised after {v['elapsed_s']:.1f} s"
        # Planted (close_waits_reduce_abort), the holder's destroy sits out the 2 s grace.
        assert v["destroy_s"] < DESTROY_S, f"rank {o.rank}: destroy took {v['destroy_s']:.2f} s"
