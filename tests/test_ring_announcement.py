"""A call handed to Gloo's ring is announced to the rank's machine and rail peers in one
empty gather-track message (src/pipeline/announce_steps.cpp), which may reach a peer
before that peer makes the call. The peer reads it at once: the gather track carries the
results of earlier operations behind it, which the peer may be waiting for before it
makes the call.

At 2 x 1 under ``FAIRRING_CPU_ALLREDUCE=model`` (the engine below 1 MiB, the ring from
there): rank 0 issues an engine allreduce and a ring allreduce at once; rank 1, once
rank 0 has issued both, the engine one, waits for it, then the ring one. Rank 0's
announcement is on its way before the engine allreduce's results; with it left unread (the plant
``announcement_parked``) rank 1 never gets those results and the job hangs to its
timeout.
"""

from __future__ import annotations

import time
from typing import Any

import stream_mutants
import torch
import torch.distributed as dist
from multiprocess import fairring_env, run_ranks

SMALL = 16 * 1024  # float32 elements: 64 KiB, the engine's
BIG = 512 * 1024  # 2 MiB, the ring's


def _values(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * (rank + 1)


def _stats() -> tuple[int, int]:
    s = dist.group.WORLD._get_backend(torch.device("cpu")).cpu_allreduce_stats()
    return int(s["engine"]), int(s["ring"])


def ahead_and_behind(rank: int, world: int) -> dict[str, Any]:
    stream_mutants.arm_from_env()
    small, big = _values(rank, SMALL), _values(rank, BIG)
    start = time.monotonic()
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.wait(["test/armed"])  # a plant rank 1 arms is armed before anything arrives
        first = dist.all_reduce(small, async_op=True)
        second = dist.all_reduce(big, async_op=True)
        store.set("test/both_issued", "1")
        first.wait()
        second.wait()
    else:
        store.set("test/armed", "1")
        # After rank 0 issued both: its announcement is on the way before the engine
        # allreduce's results can be (they need this rank's part).
        store.wait(["test/both_issued"])
        time.sleep(0.2)
        dist.all_reduce(small)
        dist.all_reduce(big)
    scale = sum(range(1, world + 1))
    return {
        "small": torch.equal(small, torch.arange(SMALL, dtype=torch.float32) * scale),
        "big": torch.equal(big, torch.arange(BIG, dtype=torch.float32) * scale),
        "ways": _stats(),
        "took": time.monotonic() - start,
    }


def test_an_announcement_ahead_of_its_call_does_not_stop_the_gather_track() -> None:
    env = fairring_env(FAIRRING_CPU_ALLREDUCE="model")
    got = run_ranks(ahead_and_behind, 2, ["m0", "m1"], env=env, timeout_s=90, pg_timeout_s=20)
    for rank, r in enumerate(got):
        assert r["small"] and r["big"], (rank, r)
        assert r["ways"] == (1, 1), (rank, r)  # one call on the engine, one on the ring
        assert r["took"] < 10, (rank, r)
