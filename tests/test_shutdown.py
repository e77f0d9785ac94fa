"""Shutdown: destroy_process_group() with work in flight, and exit without it.

The ranks run without the harness's process group (reliability_helpers.run_bare), so
each can count its threads, sockets and shared memory *before* the first
init_process_group and after every destroy_process_group. A Gloo cycle first measures
what torch itself leaves behind after a destroy; fairring may leave no more than that,
and nothing may grow from one fairring cycle to the next.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from multiprocess import SHAPES, memoised
from reliability_helpers import (
    BareOutcome,
    Resources,
    count_resources,
    fd_targets,
    run_bare,
    settle,
    shm_entries,
    store_barrier,
)

SHAPE = SHAPES["2x2"]
ENV = {"FAIRRING_SLICE_SIZE": "64K", "FAIRRING_TOTAL_MEMORY": "256K"}
FAIRRING_CYCLES = 3
DESTROY_BOUND_S = 5.0
# Exit latency is held to Gloo's, measured in the same test run (a process that only
# imported torch takes ~1.6 s to exit here, 4 at once on 2 cores, more under load):
# at most twice the slowest Gloo rank's, plus this for draining work in flight.
EXIT_MARGIN_S = 2.0
# Counts that must not grow; rss is reported but not asserted (allocators keep memory).
LEAK_FIELDS = ("py_threads", "tasks", "fds", "socket_fds", "shm_fds", "shm_maps")


def _cycle(rank: int, world: int, store: Any, backend: str, name: str) -> dict[str, Any]:
    """init, exact allreduces, destroy with allreduces in flight; returns timings."""
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{name}/", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    t = torch.full((10_000,), float(rank + 1))
    dist.all_reduce(t)
    exact = torch.equal(t, torch.full((10_000,), float(sum(range(1, world + 1)))))
    dist.all_gather_object([None] * world, rank)  # a delegated collective too
    # Many slices each (64 KiB slices, 256 KiB staging): in flight at the destroy.
    works = [dist.all_reduce(torch.ones(300_000), async_op=True) for _ in range(6)]
    # Every rank has posted before any destroys: the work is in flight everywhere
    # (a rank posting after a peer's destroy would rightly be refused at once).
    store_barrier(store, f"{name}/posted", world, timeout_s=60)
    t0 = time.monotonic()
    dist.destroy_process_group()
    destroy_s = time.monotonic() - t0
    # Whatever was in flight completed or failed; waiting on it must not hang.
    waits = []
    for work in works:
        assert work is not None
        t1 = time.monotonic()
        try:
            work.wait()
            outcome = "completed"
        except Exception as exc:  # noqa: BLE001 - reported
            outcome = f"raised: {str(exc)[:200]}"
        waits.append((time.monotonic() - t1, outcome))
    return {"exact": exact, "destroy_s": destroy_s, "waits": waits}


def _lifecycle(rank: int, world: int, store: Any) -> dict[str, Any]:
    before = count_resources()
    shm_before = shm_entries()
    cycles: dict[str, Any] = {}
    counts: dict[str, Resources] = {}
    cycles["gloo"] = _cycle(rank, world, store, "gloo", "gloo")
    counts["gloo"] = settle(count_resources, before)
    fds_after_gloo = fd_targets()
    for k in range(FAIRRING_CYCLES):
        name = f"fairring{k}"
        cycles[name] = _cycle(rank, world, store, "fairring", name)
        counts[name] = settle(count_resources, counts["gloo"])
    return {
        "before": before,
        "counts": counts,
        "cycles": cycles,
        "new_shm": sorted(shm_entries() - shm_before),
        "new_fds": {fd: t for fd, t in fd_targets().items() if fds_after_gloo.get(fd) != t},
    }


@memoised
def _lifecycle_job() -> tuple[BareOutcome, ...]:
    return tuple(run_bare(_lifecycle, SHAPE, env=ENV, timeout_s=180))


def _values(outcomes: tuple[BareOutcome, ...]) -> list[dict[str, Any]]:
    bad = [o for o in outcomes if o.status != "ok"]
    assert not bad, "\n".join(o.describe() for o in bad)
    return [o.value for o in outcomes]


def test_destroy_with_work_in_flight_is_prompt() -> None:
    problems = []
    for rank, v in enumerate(_values(_lifecycle_job())):
        for name, cycle in v["cycles"].items():
            if not cycle["exact"]:
                problems.append(f"rank {rank} {name}: the allreduce before destroy was not exact")
            if cycle["destroy_s"] > DESTROY_BOUND_S:
                problems.append(f"rank {rank} {name}: destroy took {cycle['destroy_s']:.2f} s")
            for i, (wait_s, outcome) in enumerate(cycle["waits"]):
                if wait_s > 1.0:
                    problems.append(
                        f"rank {rank} {name}: waiting on in-flight work {i} after destroy "
                        f"took {wait_s:.2f} s ({outcome})"
                    )
    assert not problems, "\n".join(problems)


def test_destroy_leaks_nothing() -> None:
    problems = []
    for rank, v in enumerate(_values(_lifecycle_job())):
        before: Resources = v["before"]
        gloo: Resources = v["counts"]["gloo"]
        first: Resources = v["counts"]["fairring0"]
        # What torch itself leaves after one init/destroy, measured with Gloo.
        torch_residue = gloo.minus(before)
        # fairring's transport is its own sockets and threads: after destroy, nothing of
        # it may remain, not even a descriptor torch's own libraries would keep.
        new_fds = v["new_fds"]
        if new_fds:
            problems.append(f"rank {rank}: descriptors left open by fairring: {new_fds}")
        for k in range(FAIRRING_CYCLES):
            now: Resources = v["counts"][f"fairring{k}"]
            over_gloo = now.minus(gloo)
            grown = {f: over_gloo[f] for f in LEAK_FIELDS if over_gloo[f] > 0}
            if grown:
                problems.append(
                    f"rank {rank}: after fairring cycle {k}, more than after a gloo cycle: "
                    f"{grown} (torch's own residue after gloo: {torch_residue})"
                )
            since_first = now.minus(first)
            growth = {f: since_first[f] for f in LEAK_FIELDS if since_first[f] > 0}
            if growth:
                problems.append(f"rank {rank}: cycle {k} grew since cycle 0: {growth}")
        if v["new_shm"]:
            problems.append(f"rank {rank}: new /dev/shm entries remain: {v['new_shm']}")
        print(
            f"rank {rank}: before {before}\n  after gloo {gloo}\n"
            f"  after fairring cycles {[v['counts'][f'fairring{k}'] for k in range(3)]}"
        )
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- exit without destroy


def _exit_without_destroy(
    rank: int, world: int, store: Any, in_flight: bool, group_backend: str = "fairring"
) -> dict[str, Any]:
    dist.init_process_group(
        group_backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    t = torch.full((10_000,), float(rank + 1))
    dist.all_reduce(t)
    if in_flight:
        # Posted and never waited for; the interpreter exits with them in flight
        # (on each rank at a different moment).
        for _ in range(6):
            dist.all_reduce(torch.ones(300_000), async_op=True)
    return {"exact": torch.equal(t, torch.full((10_000,), float(sum(range(1, world + 1)))))}


@memoised
def _gloo_exit_latency_s() -> float:
    """The slowest rank's exit latency of the same job on Gloo, now."""
    outcomes = run_bare(
        _exit_without_destroy, SHAPE, env=ENV, timeout_s=60, in_flight=False, group_backend="gloo"
    )
    bad = [o for o in outcomes if o.status != "ok" or o.exit_latency_s is None]
    assert not bad, "the Gloo baseline failed:\n" + "\n".join(o.describe() for o in bad)
    return max(o.exit_latency_s or 0.0 for o in outcomes)


def _check_exits(outcomes: list[BareOutcome]) -> None:
    bound_s = 2 * _gloo_exit_latency_s() + EXIT_MARGIN_S
    problems = []
    for o in outcomes:
        if o.status != "ok" or o.exitcode != 0:
            problems.append(o.describe())
            continue
        if not o.value["exact"]:
            problems.append(f"rank {o.rank}: the allreduce was not exact")
        latency = o.exit_latency_s
        if latency is None or latency > bound_s:
            problems.append(
                f"rank {o.rank}: exited {latency} s after its work was done (bound "
                f"{bound_s:.2f} s from Gloo's {_gloo_exit_latency_s():.2f} s)"
            )
    print({o.rank: o.exit_latency_s for o in outcomes}, "gloo:", _gloo_exit_latency_s())
    assert not problems, "\n".join(problems)


def test_exit_without_destroy_is_prompt_and_clean() -> None:
    """A training script that ends without destroy_process_group(): exit code 0.

    (A thread that drops the last reference to a Python tensor while the interpreter
    finalises dies in take_gil -> pthread_exit -> std::terminate: SIGABRT.)"""
    _check_exits(run_bare(_exit_without_destroy, SHAPE, env=ENV, timeout_s=60, in_flight=False))


def test_exit_without_destroy_with_work_in_flight() -> None:
    _check_exits(run_bare(_exit_without_destroy, SHAPE, env=ENV, timeout_s=60, in_flight=True))
