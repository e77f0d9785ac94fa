"""A peer SIGKILLed in the middle of an allreduce (tests/test_faults.py): the rank
function, the survivors' outcomes, and the bound they are held to. (The sub-group path
issues synchronously on CPU, so tests/test_subgroup_faults.py kills its peer between
allreduces instead.)"""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import fault_points
import torch
import torch.distributed as dist
from chaos_verdict import KILL_S
from multiprocess import RankOutcome
from reliability_helpers import default_store, wait_key

# README: every survivor raises within 0.1 s of the kill, naming the rank that died, as
# fast as Gloo in the same job (the reason travels ahead of a close, nothing waits).
KILL_FAST_S = 0.1
# destroy_process_group() once a peer was killed: the aborts to it fail at once, the
# others' are read, no callback runs, so nothing waits (docs/design.md, "Failure"); a
# regression that sits out one 2 s abort grace fails this.
DESTROY_FAST_S = 1.0
GROUP_TIMEOUT_S = 10.0  # for the SIGKILL groups: far above any kill bound
BIG_NUMEL = 8 * 1024 * 1024
JOB_TIMEOUT_S = 120


def gloo_slowest(survivors: list[RankOutcome]) -> float:
    """Gloo's slowest survivor in the same job; Gloo must have raised on every one."""
    silent = [o.rank for o in survivors if o.value["gloo_message"] is None]
    assert not silent, f"Gloo's allreduce completed without the killed rank on ranks {silent}"
    return max(o.value["gloo_detect_s"] for o in survivors)


def kill_bound(gloo_worst: float | None, mate_after_s: float | None) -> float:
    """How soon after a kill every survivor must have raised: 0.1 s where Gloo, in the
    same job, raised that fast on every survivor (a host idle enough for it); on a
    machine too loaded for that, before the dead rank's machine-mate dies (torchrun's
    agent ends it: from then on a close could be blamed on the wrong rank), or, where no
    mate dies, the chaos verdict's absolute bound (KILL_S, 1 s). Never Gloo's own time:
    a bound that grows with Gloo's passes a backend as slow as Gloo's timeout, and one
    equal to it failed under CI's load (0.144 s against Gloo's 0.124 s, load 20)."""
    if gloo_worst is not None and gloo_worst <= KILL_FAST_S:
        return KILL_FAST_S
    if mate_after_s is not None:
        return mate_after_s
    return KILL_S


def warm_up(rank: int, group: Any) -> None:
    """One exact allreduce: every connection of the group is up before the fault."""
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t, group=group)
    expected = float(sum(range(1, dist.get_world_size() + 1)))
    assert torch.equal(t, torch.full((1000,), expected)), f"warm-up gave {t[:4]}"


def call_after_error(group: Any) -> tuple[float, str | None]:
    """Seconds an allreduce on a failed group takes to raise, and its message
    (None if it did not raise)."""
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10), group=group)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return time.monotonic() - t0, str(exc)
    return time.monotonic() - t0, None


def _die_inside(
    store: Any, world: int, victim: int, groups: dict[str, Any], big: dict[str, Any] | None
) -> None:
    """Once the others are inside the allreduce, join it (unless ``big`` is None) and
    die a few slices in (the whole 32 MiB takes a fraction of a second)."""
    store.wait([f"kill/posted/{r}" for r in range(world) if r != victim])
    if big is not None:
        for name, g in groups.items():
            dist.all_reduce(big[name], group=g, async_op=True)
        time.sleep(0.005)
    store.set("kill/at", repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def killed_peer(
    rank: int,
    world: int,
    group_backend: str,
    victim: int,
    big_numel: int,
    group_timeout_s: float,
    victim_joins: bool = True,
    mate: int | None = None,
    mate_after_s: float = 0.0,
    yardstick: bool = False,
    slow_to_see_close: int | None = None,
) -> dict[str, Any] | None:
    """In a group of its own (so that its short timeout does not cover start-up), rank
    ``victim`` joins a big allreduce once the others are inside it and SIGKILLs itself
    a few slices in (with ``victim_joins=False``, without joining it); rank ``mate``, if
    given, dies ``mate_after_s`` after it (as torchrun's agent ends the rest of a
    machine whose rank died). With ``yardstick``, the same allreduce runs at the same
    time on a Gloo group of the same ranks. Rank ``slow_to_see_close``, if given, reads
    its connections from the victim as closed only 2 s late and the others' aborts 0.15 s
    late (fault points engine.lost and engine.abort): its ring call has failed on Gloo and
    waits to name the lost peer when another rank's abort arrives. Each survivor reports
    the error it got (None if the allreduce completed), how long after the kill it came
    (Gloo's too), what a call after it did, and how long destroying the group then took."""
    if rank == slow_to_see_close:  # before the group's short timeout runs
        fault_points.arm("engine.lost", "delay", delay_ms=2000, times=1000, key=victim)
        fault_points.arm("engine.abort", "delay", delay_ms=150, times=1000)
    store = default_store()
    timeout = timedelta(seconds=group_timeout_s)
    group = dist.new_group(backend=group_backend, timeout=timeout)
    groups = {"main": group}
    if yardstick:
        groups["gloo"] = dist.new_group(backend="gloo", timeout=timeout)
    for g in groups.values():
        warm_up(rank, g)
    big = {name: torch.ones(big_numel) for name in groups}
    dist.barrier(group=group)
    if rank == victim:
        _die_inside(store, world, victim, groups, big if victim_joins else None)
    ended: dict[str, float] = {}
    works = {}
    for name, g in groups.items():
        works[name] = dist.all_reduce(big[name], group=g, async_op=True)
        # Stamped when the future ends, whichever of the two this rank waits on first.
        works[name].get_future().add_done_callback(
            lambda _, name=name: ended.setdefault(name, time.time())
        )
    store.set(f"kill/posted/{rank}", "1")
    if rank == mate:
        killed_at = float(wait_key(store, "kill/at", 30))
        time.sleep(max(0.0, killed_at + mate_after_s - time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    messages: dict[str, str | None] = {}
    for name, work in works.items():
        messages[name] = None
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - the message is the result
            messages[name] = str(exc)
        ended.setdefault(name, time.time())
    killed_at = float(wait_key(store, "kill/at", 30))
    out: dict[str, Any] = {
        "message": messages["main"],
        "detect_s": ended["main"] - killed_at,
        "host": socket.gethostname(),
    }
    if yardstick:
        out["gloo_message"] = messages["gloo"]
        out["gloo_detect_s"] = ended["gloo"] - killed_at
        dist.destroy_process_group(groups["gloo"])
    if group_backend == "fairring":
        # Gloo makes no promise about calls after an error (it may wait for the timeout).
        out["after_s"], out["after_message"] = call_after_error(group)
        t0 = time.monotonic()
        dist.destroy_process_group(group)
        out["destroy_s"] = time.monotonic() - t0
    return out


def surviving(outcomes: tuple[RankOutcome, ...], *dead: int) -> list[RankOutcome]:
    for rank in dead:
        assert outcomes[rank].status == "crashed", outcomes[rank].describe()
    bad = [o for o in outcomes if o.rank not in dead and not o.ok]
    assert not bad, "survivors failed or hung:\n" + "\n".join(o.describe() for o in bad)
    return [o for o in outcomes if o.rank not in dead]
