"""The CPU collectives fairring does not run (broadcast, reduce, gather, scatter,
all_to_all, ...) go to Gloo only once every rank announced the same call at its turn on
the engine (src/cpu/gloo_calls.h). Gloo pairs calls by issue order alone: a rank
that skips a broadcast pairs its next one with the others' skipped one, and where the
sizes differ Gloo ends the process on its own thread (``gloo::EnforceNotMet``, SIGABRT).
Announced, the call fails on every rank naming both sides (the plant
``delegated_unannounced`` hands it to Gloo at once, as before: the ranks die).

A barrier is Gloo's, behind every collective handed to Gloo before it. Calls reach Gloo
in issue order, one thread handing them over at a time: where a callback's broadcast is
held in its hand-over (fault point ``gloo.hand_over``) on one rank, the program's
broadcast issued meanwhile waits behind it, and the barrier after both must wait for
both (the plant ``barrier_before_hand_over`` lets it go first: Gloo pairs that rank's
barrier with the others' broadcast).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import fault_points
import stream_mutants
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from test_failure_semantics import _attempt, _destroy

MACHINES_2X2 = ["m0", "m0", "m1", "m1"]
SKIPPER, ROOT = 2, 3
FIRST, NEXT = 28, 17  # elements of the skipped broadcast and of the next one
GROUP_TIMEOUT_S = 10.0


def _skipped_broadcast(rank: int, world: int) -> dict[str, Any]:
    stream_mutants.arm_from_env()
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    warm = torch.full((8,), float(rank))
    dist.all_reduce(warm, group=group)
    first = torch.full((FIRST,), float(rank))
    nxt = torch.full((NEXT,), float(rank))
    errors: list[str | None] = []
    t0 = time.monotonic()
    if rank != SKIPPER:
        errors.append(_attempt(lambda: dist.broadcast(first, src=ROOT, group=group))[0])
    errors.append(_attempt(lambda: dist.broadcast(nxt, src=ROOT, group=group))[0])
    took = time.monotonic() - t0
    return {"warm": warm.tolist(), "errors": errors, "took": took, "destroy_s": _destroy(group)}


def test_a_skipped_broadcast_fails_on_every_rank_naming_both_sizes() -> None:
    got = run_ranks(_skipped_broadcast, 4, MACHINES_2X2, timeout_s=90)
    for rank, r in enumerate(got):
        assert r["warm"] == [6.0] * 8, (rank, r)  # 0 + 1 + 2 + 3: the calls before are exact
        assert all(e is not None for e in r["errors"]), f"rank {rank}: a call completed: {r}"
        first = r["errors"][0]
        assert "broadcast #1 differs between ranks" in first, (rank, first)
        assert f"{FIRST} elements" in first and f"{NEXT} elements" in first, (rank, first)
        assert "rooted at rank 3" in first, (rank, first)
        # Told at the announcement, not at the timeout.
        assert r["took"] < GROUP_TIMEOUT_S / 2, (rank, r)
        assert r["destroy_s"] < 2.0, (rank, r)


def _refused_by_gloo(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    # Split sizes that do not add up to the input: Gloo checks them when the call is made.
    out, inp = torch.empty(8), torch.ones(8)
    refused, _ = _attempt(
        lambda: dist.all_to_all_single(out, inp, [1] * world, [1] * world, group=group)
    )
    t = torch.full((9,), float(rank))
    after, _ = _attempt(lambda: dist.broadcast(t, src=2, group=group))
    return {"refused": refused, "after": after, "t": t.tolist(), "destroy_s": _destroy(group)}


def test_a_call_gloo_refuses_raises_its_error_and_the_group_goes_on() -> None:
    """Gloo checks some arguments when the call is made, and a handed-over call is made
    later: its refusal still raises Gloo's own error on every rank, and fails nothing
    else (as with Gloo alone)."""
    got = run_ranks(_refused_by_gloo, 4, MACHINES_2X2, timeout_s=90)
    for rank, r in enumerate(got):
        assert r["refused"] is not None and "split sizes" in r["refused"].lower(), (rank, r)
        assert "differs between ranks" not in r["refused"], (rank, r)
        assert r["after"] is None and r["t"] == [2.0] * 9, (rank, r)
        assert r["destroy_s"] < 2.0, (rank, r)


HELD = 1  # the rank whose callback's hand-over to Gloo is held
HELD_MS = 800


def _barrier_behind_held_hand_over(rank: int, world: int) -> dict[str, Any]:
    stream_mutants.arm_from_env()
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    store = dist.distributed_c10d._get_default_store()
    dist.barrier(group=group)
    if rank == HELD:
        fault_points.arm("gloo.hand_over", "delay", delay_ms=HELD_MS)
    started = threading.Event()
    from_callback = torch.full((50,), float(rank))
    works: list[Any] = []

    def callback(_: Any) -> None:
        started.set()  # then the hand-over below holds HELD_MS on rank HELD
        works.append(dist.broadcast(from_callback, src=3, group=group, async_op=True))

    first = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    # Rank HELD's allreduce completes only once its callback is attached: the callback
    # runs on a completion thread, not inline on this one.
    if rank == HELD:
        first.get_future().then(callback)
        store.set("test/attached", "1")
    else:
        store.wait(["test/attached"])
        first.get_future().then(callback)
    started.wait(timeout=30)
    time.sleep(0.2)  # rank HELD: its callback's hand-over is held now
    t = torch.arange(1000, dtype=torch.float64) + 1000 * rank
    work = dist.broadcast(t, src=0, group=group, async_op=True)
    message, _ = _attempt(lambda: dist.barrier(group=group))
    if message is None:
        work.wait()
        for w in works:
            w.wait()
    return {
        "barrier": message,
        "broadcast": torch.equal(t, torch.arange(1000, dtype=torch.float64)),
        "from_callback": from_callback.tolist() == [3.0] * 50,
        "fired": fault_points.uses("gloo.hand_over"),
        "destroy_s": _destroy(group),
    }


def test_a_barrier_reaches_gloo_behind_every_call_before_it() -> None:
    got = run_ranks(_barrier_behind_held_hand_over, 4, MACHINES_2X2, timeout_s=90)
    for rank, r in enumerate(got):
        assert r["barrier"] is None, (rank, r)
        assert r["broadcast"] and r["from_callback"], (rank, r)
        assert r["fired"] == (1 if rank == HELD else 0), (rank, r)
        assert r["destroy_s"] < 2.0, (rank, r)


def _every_delegated_kind(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    gathered = [torch.empty(3, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
    g = dist.gather(
        torch.full((3,), rank + 10, dtype=torch.int64), gathered, dst=0, group=group, async_op=True
    )
    summed = torch.full((7,), float(rank + 1))
    s = dist.all_reduce(summed, group=group, async_op=True)  # the engine's, between
    scattered = torch.empty(2, dtype=torch.int32)
    parts = (
        [torch.full((2,), 100 + r, dtype=torch.int32) for r in range(world)] if rank == 3 else None
    )
    dist.scatter(scattered, parts, src=3, group=group)
    reduced = torch.full((5,), float(rank + 1), dtype=torch.float64)
    dist.reduce(reduced, dst=2, op=dist.ReduceOp.PRODUCT, group=group)
    out = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.int64) + 10 * rank, group=group)
    # Uneven splits: rank r sends r + 1 elements to every rank.
    uneven = torch.empty(sum(r + 1 for r in range(world)), dtype=torch.int32)
    dist.all_to_all_single(
        uneven,
        torch.full((world * (rank + 1),), rank, dtype=torch.int32),
        output_split_sizes=[r + 1 for r in range(world)],
        input_split_sizes=[rank + 1] * world,
        group=group,
    )
    g.wait()
    s.wait()
    return {
        "gathered": [x.tolist() for x in gathered] if gathered else None,
        "summed": summed.tolist(),
        "scattered": scattered.tolist(),
        "reduced": reduced.tolist(),
        "all_to_all": out.tolist(),
        "uneven": uneven.tolist(),
        "destroy_s": _destroy(group),
    }


def test_every_delegated_kind_exact_beside_the_engine() -> None:
    got = run_ranks(_every_delegated_kind, 4, MACHINES_2X2, timeout_s=90)
    for rank, r in enumerate(got):
        assert r["summed"] == [10.0] * 7, (rank, r)
        assert r["scattered"] == [100 + rank] * 2, (rank, r)
        assert r["all_to_all"] == [10 * s + rank for s in range(4)], (rank, r)
        assert r["uneven"] == [s for s in range(4) for _ in range(s + 1)], (rank, r)
        assert r["destroy_s"] < 2.0, (rank, r)
    assert got[0]["gathered"] == [[r + 10] * 3 for r in range(4)]
    assert got[2]["reduced"] == [24.0] * 5  # 1 * 2 * 3 * 4
