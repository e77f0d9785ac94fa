"""The sub-group allreduce's size mismatch and killed peer, on CPU (the test switch
FAIRRING_TEST_CPU_SUBGROUPS=on, tests/test_subgroups.py): a rank whose size differs
never passes, and a peer killed between calls fails every survivor.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import SHAPES, launch
from test_subgroups import subgroup_env

# ------------------------------------------------------------------ size mismatch

MISMATCH_TIMEOUT_S = 10


def mismatched_sizes(rank: int, world: int) -> str:
    """Rank 1 reduces one element more than rank 0 (an extra slice tail), then both
    reduce 10 elements."""
    t = torch.ones(1000 + rank)
    dist.all_reduce(t)
    u = torch.ones(10)
    dist.all_reduce(u)
    return f"passed with {t[:2].tolist()} and {u[:2].tolist()}"


@pytest.mark.parametrize("debug", ["off", "DETAIL"])
def test_size_mismatch_never_passes(debug: str) -> None:
    """NCCL does not compare sizes, and neither do the sub-groups: ranks that disagree
    issue different collectives and wait for each other until the group's timeout
    (NCCL's watchdog on CUDA). TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch wrap fairring
    as it wraps NCCL, comparing every collective's shapes first: a clear error at once."""
    env = subgroup_env()
    if debug == "DETAIL":
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    start = time.monotonic()
    outcomes = launch(
        mismatched_sizes,
        2,
        ["m0", "m1"],
        env=env,
        timeout_s=MISMATCH_TIMEOUT_S + 60,
        pg_timeout_s=MISMATCH_TIMEOUT_S,
        abort_grace_s=None,
    )
    elapsed = time.monotonic() - start
    for o in outcomes:
        assert o.status == "error", o.describe()
        if debug == "DETAIL":
            assert "mismatch" in (o.error_message or "").lower(), o.describe()
            assert "1000" in o.error_message and "1001" in o.error_message, o.describe()
        else:
            # The ranks start together (the launcher's start gate): the timeout is the
            # mismatched allreduces' (raised from one of them), not one from start-up.
            assert o.phase == "fn", o.describe()
            assert "in mismatched_sizes" in (o.remote_traceback or ""), o.describe()
            message = (o.error_message or "").lower()
            assert "timed out" in message or "timeout" in message, o.describe()
    assert elapsed < MISMATCH_TIMEOUT_S + 45, elapsed


# ------------------------------------------------------------------ a killed peer

KILL_TIMEOUT_S = 10


def killed_peer(rank: int, world: int) -> dict[str, Any]:
    """Rank 3 dies (SIGKILL) after a warm-up; the others reduce until they fail, then
    call once more."""
    import os
    import signal

    t = torch.ones(100_000)
    dist.all_reduce(t)
    dist.barrier()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    first = None
    for _ in range(1000):
        try:
            dist.all_reduce(t)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            first = str(exc)
            break
    failed_after = time.monotonic() - start
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10))
        again = None
    except Exception as exc:  # noqa: BLE001
        again = str(exc)
    return {
        "first": first,
        "failed_after": failed_after,
        "again": again,
        "again_s": time.monotonic() - start,
    }


def test_killed_peer_fails_every_survivor() -> None:
    outcomes = launch(
        killed_peer,
        4,
        SHAPES["2x2"],
        env=subgroup_env(),
        timeout_s=KILL_TIMEOUT_S + 60,
        pg_timeout_s=KILL_TIMEOUT_S,
        abort_grace_s=None,
    )
    assert outcomes[3].status == "crashed", outcomes[3].describe()
    for o in outcomes[:3]:
        assert o.ok, o.describe()
        v = o.value
        assert v["first"] is not None, f"rank {o.rank}: 1000 allreduces passed without rank 3"
        assert v["failed_after"] < KILL_TIMEOUT_S + 5, v
        # Every later call fails at once, with the first error.
        assert v["again"] is not None and "failed earlier" in v["again"], v
        assert v["again_s"] < 1, v
