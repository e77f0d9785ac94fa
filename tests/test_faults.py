"""Faults: a peer killed or frozen mid-allreduce, and allreduces that differ between ranks.

Each scenario runs in its own process group made with ``new_group(timeout=...)``
inside a normal 2x2 job, so the short timeout applies to the fault and not to the
job's start-up (ranks of a loaded 2-core machine may start seconds apart).

What must hold (README, "When things go wrong"):

* SIGKILL of one rank: every survivor's pending allreduce raises within 0.1 s, naming
  the lost rank and its host, also on ranks that never exchange data with it (the first
  rank to notice forwards the error), as fast as Gloo running the same allreduce in the
  same job (on a machine too loaded for 0.1 s, before the dead rank's machine-mate
  dies, where it does); the next call raises at once; destroy is prompt.
* SIGSTOP of one rank (its sockets stay open, nothing arrives): every other rank raises
  at the group's timeout, saying it timed out.
* Size, dtype or op differing between ranks: every rank raises naming both
  descriptions; results of earlier allreduces and unrelated tensors are untouched.

Gloo is the yardstick for the SIGKILL case: the same allreduce runs at the same time on a
Gloo group in the same job, which must raise too, and both times are printed side by side.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from killed_peer import (
    BIG_NUMEL,
    DESTROY_FAST_S,
    GROUP_TIMEOUT_S,
    JOB_TIMEOUT_S,
    call_after_error,
    gloo_slowest,
    kill_bound,
    killed_peer,
    surviving,
    warm_up,
)
from multiprocess import SHAPES, RankOutcome, fairring_env, launch, memoised
from reliability_helpers import default_store, wait_key

SHAPE = SHAPES["2x2"]
WORLD = len(SHAPE)
MATE_AFTER_S = 0.15  # torchrun's agent ends the rest of a machine whose rank died
FREEZE_TIMEOUT_S = 5.0
# 256 KiB slices and 1 MiB of staging: a 32 MiB allreduce is a pipeline of 128 slices,
# each cut into 16 pipeline chunks, so a fault lands with chunks of many slices in flight.
# The engine's allreduce (at 3x1 a big one would otherwise be Gloo's ring: see
# tests/test_ring_kill.py).
ENV = fairring_env(
    slice_size=256 * 1024,
    total_memory=1024 * 1024,
    FAIRRING_PIPELINE_CHUNK="16K",
    FAIRRING_CPU_ALLREDUCE="engine",
)
# Small slices for the mismatch job, so that its "size_slices" case differs in the
# number of slices too.
MISMATCH_ENV = fairring_env(slice_size=64 * 1024, total_memory=512 * 1024)


# ------------------------------------------------------------------------ SIGKILL


@memoised
def _kill_job(victim: int, shape: str = "2x2", mate: int | None = None) -> tuple[RankOutcome, ...]:
    outcomes = launch(
        killed_peer,
        len(SHAPES[shape]),
        SHAPES[shape],
        env=ENV,
        timeout_s=JOB_TIMEOUT_S,
        abort_grace_s=45,
        group_backend="fairring",
        victim=victim,
        big_numel=BIG_NUMEL,
        group_timeout_s=GROUP_TIMEOUT_S,
        mate=mate,
        mate_after_s=MATE_AFTER_S,
        yardstick=True,
    )
    return tuple(outcomes)


# 2x2, rank 3 killed: its machine-mate, rank 2, dies 0.15 s later, as torchrun's agent
# ends the rest of a machine whose rank died. 3x1: the rail connections of a track share
# one writer (src/transport/peer_mesh.h).
KILLS = {("2x2", 3): 2, ("2x2", 1): None, ("3x1", 1): None}  # (shape, victim): mate


@pytest.mark.parametrize(("shape", "victim"), list(KILLS))
def test_killed_peer_every_survivor_raises_promptly(shape: str, victim: int) -> None:
    mate = KILLS[shape, victim]
    dead = (victim,) if mate is None else (victim, mate)
    survivors = surviving(_kill_job(victim, shape, mate), *dead)
    gloo_worst = gloo_slowest(survivors)
    bound = kill_bound(gloo_worst, None if mate is None else MATE_AFTER_S)
    problems = []
    for o in survivors:
        v = o.value
        culprit = f"rank {victim} (host {v['host']})"
        if v["message"] is None:
            problems.append(f"rank {o.rank}: the allreduce completed although rank {victim} died")
            continue
        if culprit not in v["message"]:
            problems.append(f"rank {o.rank}: error does not name {culprit!r}: {v['message']}")
        if not v["detect_s"] <= bound:
            problems.append(
                f"rank {o.rank}: raised {v['detect_s']:.3f} s after the kill (bound "
                f"{bound:.3f} s, Gloo's slowest {gloo_worst:.3f} s): {v['message']}"
            )
        # After an error, every call raises at once, with the first error.
        if v["after_message"] is None:
            problems.append(f"rank {o.rank}: an allreduce after the failure did not raise")
        elif v["after_s"] > 1.0 or culprit not in v["after_message"]:
            problems.append(
                f"rank {o.rank}: the call after the failure took {v['after_s']:.2f} s "
                f"or lost the culprit: {v['after_message']}"
            )
        if v["destroy_s"] > DESTROY_FAST_S:
            problems.append(f"rank {o.rank}: destroying the group took {v['destroy_s']:.2f} s")
    detect = {o.rank: round(o.value["detect_s"], 3) for o in survivors}
    gloo = {o.rank: round(o.value["gloo_detect_s"], 3) for o in survivors}
    print(f"SIGKILL of rank {victim}: fairring raised after {detect} s, Gloo after {gloo} s")
    assert not problems, "\n".join(problems)


def test_killed_peer_is_named_before_its_machine_mate_dies() -> None:
    """torchrun's agent ends the rest of a machine whose rank died: rank 2 dies 0.15 s
    after rank 3. Ranks 0 and 1 must have raised before that, naming rank 3, and Gloo,
    running the same allreduce in the same job, must have raised too."""
    victim = 3
    mate = KILLS["2x2", victim]
    survivors = surviving(_kill_job(victim, "2x2", mate), victim, mate)
    gloo_worst = gloo_slowest(survivors)
    problems = []
    for o in survivors:
        v = o.value
        culprit = f"rank {victim} (host {v['host']})"
        if v["message"] is None or culprit not in v["message"]:
            problems.append(f"rank {o.rank}: does not name {culprit}: {v['message']}")
        elif v["detect_s"] >= MATE_AFTER_S:
            problems.append(
                f"rank {o.rank}: raised {v['detect_s']:.3f} s after the kill, once rank {mate} "
                f"had died too (Gloo's slowest: {gloo_worst:.3f} s)"
            )
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------ SIGSTOP


def _wait_stopped(pid: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            # Field 3, after the parenthesised command name.
            state = f.read().rpartition(")")[2].split()[0]
        if state == "T":
            return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not stop")


def _frozen_peer(rank: int, world: int, victim: int) -> dict[str, Any] | None:
    store = default_store()
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=FREEZE_TIMEOUT_S))
    warm_up(rank, group)
    dist.barrier(group=group)
    if rank == victim:
        store.set("freeze/pid", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)  # never reached in practice: rank 0 SIGKILLs this process
        return None
    pid = int(wait_key(store, "freeze/pid", 30))
    _wait_stopped(pid)
    tensor = torch.ones(100_000)
    t0 = time.monotonic()
    posted_at = time.time()  # one host: comparable across the ranks
    message = None
    try:
        dist.all_reduce(tensor, group=group)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        message = str(exc)
    elapsed = time.monotonic() - t0
    raised_at = time.time()
    after_s, after_message = call_after_error(group)
    # Only once every survivor has its answer may the frozen rank go away: its
    # death would otherwise be reported instead of the timeout.
    store.add("freeze/done", 1)
    if rank == 0:
        deadline = time.monotonic() + 60
        while store.add("freeze/done", 0) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
    return {
        "message": message,
        "elapsed_s": elapsed,
        "posted_at": posted_at,
        "raised_at": raised_at,
        "after_s": after_s,
        "after_message": after_message,
    }


def test_frozen_peer_every_rank_raises_at_timeout() -> None:
    victim = 3
    outcomes = launch(
        _frozen_peer,
        WORLD,
        SHAPE,
        env=ENV,
        timeout_s=JOB_TIMEOUT_S,
        abort_grace_s=45,
        victim=victim,
    )
    survivors = surviving(tuple(outcomes), victim)
    problems = []
    for o in survivors:
        v = o.value
        if v["message"] is None:
            problems.append(f"rank {o.rank}: the allreduce completed with rank {victim} frozen")
            continue
        if "timed out" not in v["message"]:
            problems.append(f"rank {o.rank}: error does not say 'timed out': {v['message']}")
        if v["elapsed_s"] > FREEZE_TIMEOUT_S + 5.0:
            problems.append(
                f"rank {o.rank}: raised after {v['elapsed_s']:.2f} s, expected about the "
                f"group timeout of {FREEZE_TIMEOUT_S} s: {v['message']}"
            )
        if v["after_message"] is None or v["after_s"] > 1.0:
            problems.append(
                f"rank {o.rank}: the call after the timeout took {v['after_s']:.2f} s and "
                f"raised {v['after_message']!r}"
            )
    # Not before the timeout: the first rank to time out forwards its error, so a rank
    # that posted late (a loaded machine) hears of it before its own deadline; but no
    # rank raises before the timeout has run out for the first rank that posted.
    answered = [o.value for o in survivors if o.value["message"] is not None]
    if answered:
        first_raise = min(v["raised_at"] for v in answered)
        first_post = min(v["posted_at"] for v in answered)
        if first_raise - first_post < FREEZE_TIMEOUT_S - 0.1:
            problems.append(
                f"a rank raised {first_raise - first_post:.2f} s after the first post, "
                f"before the group timeout of {FREEZE_TIMEOUT_S} s"
            )
    print({o.rank: round(o.value["elapsed_s"], 3) for o in survivors})
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------ mismatch

ODD_RANK = 3  # rank 0 never exchanges data with it: rank 0 learns by forwarding
# kind: (what the odd rank calls instead of 1000 float32 elements with SUM, the two
# descriptions that the error must name)
# (A tuple lists equivalent spellings: torch's C++ name of a dtype, or Python's.)
MISMATCHES: dict[str, tuple[dict[str, Any], tuple[str | tuple[str, ...], ...]]] = {
    "size": ({"numel": 1001}, ("1000 elements", "1001 elements")),
    "size_slices": ({"numel": 70_000, "base": 100_000}, ("100000 elements", "70000 elements")),
    "dtype": (
        {"dtype": torch.int32},
        (("of Float", "float32"), ("of Int", "int32")),
    ),
    "op": ({"op": dist.ReduceOp.MAX}, ("ReduceOp.SUM", "ReduceOp.MAX")),
    # An empty tensor on one rank (say, an empty bucket): that rank has nothing to
    # send, yet it too must learn that the others disagree.
    "size_zero": ({"numel": 0}, ("1000 elements", "0 elements")),
}
# The group timeout of a mismatch case: detection must come well before it (see
# MISMATCH_DETECT_S), so a rank that only times out is told apart.
MISMATCH_GROUP_TIMEOUT_S = 12.0
MISMATCH_DETECT_S = 6.0


def _mismatch_case(rank: int, world: int, kind: str) -> dict[str, Any]:
    change, _ = MISMATCHES[kind]
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=MISMATCH_GROUP_TIMEOUT_S))
    earlier = torch.arange(1000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(earlier, group=group)
    # Completed on every rank, not only on this one, before anything goes wrong.
    dist.barrier(group=group)
    bystander = torch.arange(500, dtype=torch.float32) + rank
    bystander_before = bystander.clone()
    numel = change["base"] if "base" in change else 1000
    dtype, op = torch.float32, dist.ReduceOp.SUM
    if rank == ODD_RANK:
        numel = change.get("numel", numel)
        dtype = change.get("dtype", dtype)
        op = change.get("op", op)
    tensor = torch.ones(numel, dtype=dtype)
    t0 = time.monotonic()
    message = None
    try:
        dist.all_reduce(tensor, op=op, group=group)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        message = str(exc)
    elapsed = time.monotonic() - t0
    after_s, after_message = call_after_error(group)
    expected_earlier = torch.arange(1000, dtype=torch.float32) * sum(range(1, world + 1))
    return {
        "message": message,
        "elapsed_s": elapsed,
        "after_s": after_s,
        "after_message": after_message,
        "earlier_intact": torch.equal(earlier, expected_earlier),
        "bystander_intact": torch.equal(bystander, bystander_before),
    }


def _inflight_case(rank: int, world: int) -> dict[str, Any]:
    """An allreduce every rank has posted, still in flight when a mismatched one
    follows: it must complete, exactly, on every rank (Gloo and NCCL run collectives
    in order, so a later collective's error never fails an earlier one)."""
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=30))
    dist.all_reduce(torch.ones(10), group=group)  # connections up
    first = torch.arange(200_000, dtype=torch.float32) * (rank + 1)
    work = dist.all_reduce(first, group=group, async_op=True)
    assert work is not None
    bad = torch.ones(1001 if rank == ODD_RANK else 1000)
    message = None
    try:
        dist.all_reduce(bad, group=group)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        message = str(exc)
    first_error = None
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        first_error = str(exc)
    expected = torch.arange(200_000, dtype=torch.float32) * sum(range(1, world + 1))
    return {
        "message": message,
        "first_error": first_error,
        "first_exact": first_error is None and torch.equal(first, expected),
    }


def _mismatched(rank: int, world: int, kinds: list[str]) -> dict[str, dict[str, Any]]:
    """Every scenario on its own group; an unexpected exception is recorded, not
    raised, so that the ranks stay in step for the next scenario."""
    results: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        try:
            if kind == "inflight":
                results[kind] = _inflight_case(rank, world)
            else:
                results[kind] = _mismatch_case(rank, world, kind)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results[kind] = {"unexpected": f"{type(exc).__name__}: {exc}"}
    # The failed groups are separate from the default group, which still works.
    t = torch.full((10,), float(rank))
    dist.all_reduce(t)
    results["default_group_after"] = {"ok": torch.equal(t, torch.full((10,), 6.0))}
    return results


@memoised
def _mismatch_job() -> tuple[RankOutcome, ...]:
    return tuple(
        launch(
            _mismatched,
            WORLD,
            SHAPE,
            env=MISMATCH_ENV,
            timeout_s=JOB_TIMEOUT_S,
            kinds=[*MISMATCHES, "inflight"],
        )
    )


def _mismatch_values(
    outcomes: tuple[RankOutcome, ...], kind: str
) -> tuple[list[str], list[tuple[int, dict[str, Any]]]]:
    """Every rank's record of mismatch ``kind`` once the job ran clean: the problems so
    far (a rank that met an unexpected error) and (rank, record) of the others."""
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    problems, values = [], []
    for o in outcomes:
        v = o.value[kind]
        if "unexpected" in v:
            problems.append(f"rank {o.rank}: unexpected error: {v['unexpected']}")
        else:
            values.append((o.rank, v))
    return problems, values


def _lacking(rank: int, message: str, words: Sequence[str | tuple[str, ...]]) -> list[str]:
    """A problem for each of ``words`` (a word, or a tuple of its spellings) that
    ``message`` lacks."""
    problems = []
    for word in words:
        spellings = (word,) if isinstance(word, str) else word
        if not any(w in message for w in spellings):
            problems.append(f"rank {rank}: error lacks {spellings}: {message}")
    return problems


@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_mismatch_every_rank_raises_naming_the_difference(kind: str) -> None:
    _, descriptions = MISMATCHES[kind]
    problems, values = _mismatch_values(_mismatch_job(), kind)
    for rank, v in values:
        if v["message"] is None:
            problems.append(f"rank {rank}: the mismatched allreduce did not raise")
            continue
        problems += _lacking(rank, v["message"], ("differs between ranks", *descriptions))
        if v["elapsed_s"] > MISMATCH_DETECT_S:  # detected, not timed out
            problems.append(
                f"rank {rank}: raised only after {v['elapsed_s']:.1f} s (group timeout "
                f"{MISMATCH_GROUP_TIMEOUT_S:.0f} s): {v['message']}"
            )
        if v["after_message"] is None or v["after_s"] > 1.0:
            problems.append(
                f"rank {rank}: the next call took {v['after_s']:.2f} s and raised "
                f"{v['after_message']!r}"
            )
        if not v["earlier_intact"]:
            problems.append(f"rank {rank}: the result of an earlier allreduce changed")
        if not v["bystander_intact"]:
            problems.append(f"rank {rank}: a tensor no allreduce touched changed")
    assert not problems, "\n".join(problems)


def test_mismatch_does_not_fail_an_earlier_allreduce_in_flight() -> None:
    outcomes = _mismatch_job()
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    problems = []
    for o in outcomes:
        v = o.value["inflight"]
        if "unexpected" in v:
            problems.append(f"rank {o.rank}: unexpected error: {v['unexpected']}")
            continue
        if v["message"] is None:
            problems.append(f"rank {o.rank}: the mismatched allreduce did not raise")
        if not v["first_exact"]:
            problems.append(
                f"rank {o.rank}: the earlier allreduce, posted by every rank, "
                + (f"failed: {v['first_error']}" if v["first_error"] else "was not exact")
            )
    assert not problems, "\n".join(problems)


def test_mismatch_leaves_other_groups_working() -> None:
    outcomes = _mismatch_job()
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)
    assert all(o.value["default_group_after"]["ok"] for o in outcomes)


# ------------------------------------------------------- mismatch on Gloo's ring

# One rank per machine: an allreduce of 1 MiB or more runs on Gloo's ring
# (FAIRRING_CPU_ALLREDUCE=auto), which reduces whatever each rank gives it. Its turn on
# the engine announces the call, so ranks that disagree fail as on the engine (found by
# scripts/chaos.py, seed 74: an op that differed completed, silently, on every rank).
RING_NUMEL = 1 << 18  # 1 MiB of float32
RING_ODD_RANK = 2
RING_MISMATCHES: dict[str, tuple[dict[str, Any], tuple[str | tuple[str, ...], ...]]] = {
    "op": ({"op": dist.ReduceOp.MAX}, ("ReduceOp.SUM", "ReduceOp.MAX")),
    "dtype": ({"dtype": torch.int32}, (("of Float", "float32"), ("of Int", "int32"))),
    "size": ({"numel": RING_NUMEL + 1}, ("262144 elements", "262145 elements")),
    # Below 1 MiB the odd rank runs it on the engine while the others take the ring.
    "path": ({"numel": 1000}, ("262144 elements", "1000 elements")),
}


def _ring_mismatch_case(rank: int, world: int, kind: str) -> dict[str, Any]:
    change, _ = RING_MISMATCHES[kind]
    timeout = timedelta(seconds=MISMATCH_GROUP_TIMEOUT_S)
    group = dist.new_group(backend="fairring", timeout=timeout)
    earlier = torch.full((RING_NUMEL,), float(rank + 1))
    dist.all_reduce(earlier, group=group)
    ring_calls = group._get_backend(torch.device("cpu")).cpu_allreduce_stats()["ring"]
    numel, dtype, op = RING_NUMEL, torch.float32, dist.ReduceOp.SUM
    if rank == RING_ODD_RANK:
        numel = change.get("numel", numel)
        dtype = change.get("dtype", dtype)
        op = change.get("op", op)
    t0 = time.monotonic()
    message = None
    try:
        dist.all_reduce(torch.ones(numel, dtype=dtype), op=op, group=group)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        message = str(exc)
    elapsed = time.monotonic() - t0
    after_s, after_message = call_after_error(group)
    want = torch.full((RING_NUMEL,), float(sum(range(1, world + 1))))
    return {
        "message": message,
        "elapsed_s": elapsed,
        "after_s": after_s,
        "after_message": after_message,
        "earlier_intact": torch.equal(earlier, want),
        "ring_calls": ring_calls,
    }


def _ring_mismatched(rank: int, world: int) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for kind in RING_MISMATCHES:
        try:
            results[kind] = _ring_mismatch_case(rank, world, kind)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results[kind] = {"unexpected": f"{type(exc).__name__}: {exc}"}
    return results


@memoised
def _ring_mismatch_job() -> tuple[RankOutcome, ...]:
    env = fairring_env(FAIRRING_CPU_ALLREDUCE="model")
    return tuple(launch(_ring_mismatched, 3, SHAPES["3x1"], env=env, timeout_s=JOB_TIMEOUT_S))


@pytest.mark.parametrize("kind", list(RING_MISMATCHES))
def test_a_mismatch_on_the_ring_raises_on_every_rank_naming_both(kind: str) -> None:
    _, descriptions = RING_MISMATCHES[kind]
    problems, values = _mismatch_values(_ring_mismatch_job(), kind)
    for rank, v in values:
        if v["ring_calls"] != 1:
            problems.append(f"rank {rank}: the earlier allreduce was not on the ring")
        if not v["earlier_intact"]:
            problems.append(f"rank {rank}: the earlier allreduce on the ring was not exact")
        if v["message"] is None:
            problems.append(f"rank {rank}: the mismatched allreduce completed")
            continue
        words = ("differs between ranks", f"rank {RING_ODD_RANK}", *descriptions)
        problems += _lacking(rank, v["message"], words)
        if v["elapsed_s"] > MISMATCH_DETECT_S:
            problems.append(f"rank {rank}: raised only after {v['elapsed_s']:.1f} s")
        if v["after_message"] is None or v["after_s"] > 1.0:
            problems.append(f"rank {rank}: the next call: {v['after_message']!r}")
    assert not problems, "\n".join(problems)
