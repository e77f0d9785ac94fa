"""A peer SIGKILLed in the middle of an allreduce (tests/test_faults.py): the rank
function, and the survivors' outcomes. (The sub-group path issues synchronously on CPU,
so tests/test_subgroups.py kills its peer between allreduces instead.)"""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from multiprocess import RankOutcome
from reliability_helpers import default_store, wait_key


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
) -> dict[str, Any] | None:
    """In a group of its own (so that its short timeout does not cover start-up), rank
    ``victim`` joins a big allreduce once the others are inside it and SIGKILLs itself
    a few slices in (with ``victim_joins=False``, without joining it); rank ``mate``, if
    given, dies ``mate_after_s`` after it (as torchrun's agent ends the rest of a
    machine whose rank died). Each survivor reports the error it got (None if the
    allreduce completed), how long after the kill it came, what a call after it did,
    and how long destroying the group then took."""
    store = default_store()
    group = dist.new_group(backend=group_backend, timeout=timedelta(seconds=group_timeout_s))
    warm_up(rank, group)
    big = torch.ones(big_numel)
    dist.barrier(group=group)
    if rank == victim:
        # Once the others are inside the allreduce, join it and die a few slices in
        # (the whole 32 MiB takes a fraction of a second).
        store.wait([f"kill/posted/{r}" for r in range(world) if r != victim])
        if victim_joins:
            dist.all_reduce(big, group=group, async_op=True)
            time.sleep(0.005)
        store.set("kill/at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    work = dist.all_reduce(big, group=group, async_op=True)
    assert work is not None
    store.set(f"kill/posted/{rank}", "1")
    if rank == mate:
        killed_at = float(wait_key(store, "kill/at", 30))
        time.sleep(max(0.0, killed_at + mate_after_s - time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    message = None
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        message = str(exc)
    raised_at = time.time()
    killed_at = float(wait_key(store, "kill/at", 30))
    out: dict[str, Any] = {
        "message": message,
        "detect_s": raised_at - killed_at,
        "host": socket.gethostname(),
    }
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
