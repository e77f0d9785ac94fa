"""fairring_pg.cpu.future_callbacks: the mark that tells an allreduce it is issued from a
torch Future's callback, whichever thread runs it (docs/design.md, "Completion order and
comm hooks"). tests/test_completion.py covers ``then()``; this covers
``add_done_callback()`` run inline on some ranks and on completion threads on others,
and that the wrapped callbacks behave as torch's own."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from multiprocess import DEFAULT_BACKEND, memoised, run_ranks
from reliability_helpers import default_store

MACHINES = ["m0", "m0", "m1"]
COUNT = 12


def _thread_name() -> str:
    """The calling thread's name as the kernel knows it (fairring's completion threads
    name themselves "fairring-cb"; Python has no name for a thread it did not start)."""
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


def done_callbacks(rank: int, world: int) -> dict[str, Any]:
    """Each allreduce gets an add_done_callback that issues an allreduce of its own. On
    every other rank (alternating per allreduce) the future is waited for first, so the
    callback runs inline on the main thread; elsewhere it runs on a completion thread.
    The callbacks' allreduces must still pair up across ranks. On rank 0 the others
    post each allreduce only once rank 0 has attached its callback, so that where rank 0
    does not wait the future is not complete yet and the callback must run on a
    completion thread."""
    store = default_store()
    got: dict[int, tuple[float, float, str]] = {}
    lock = threading.Lock()
    for i in range(COUNT):
        size = 1 + 1000 * (i % 3)  # sizes differ, so that mispaired allreduces fail
        attached = f"done_callbacks/attached/{i}"
        if rank != 0:
            # Polled: the store's own wait holds the GIL, which a callback of this
            # rank may need meanwhile on a completion thread.
            deadline = time.monotonic() + 60
            while not store.check([attached]) and time.monotonic() < deadline:
                time.sleep(0.005)
        fut = dist.all_reduce(torch.full((size,), float(rank + i)), async_op=True).get_future()
        if (rank + i) % 2 == 0:
            if rank == 0:
                store.set(attached, "1")
            fut.wait()  # complete before add_done_callback: the callback runs here

        def callback(f: torch.futures.Future, i: int = i) -> None:
            x = torch.full((i + 1,), float(10 * (rank + 1)))
            dist.all_reduce(x)
            with lock:
                got[i] = (f.value()[0][0].item(), x[0].item(), _thread_name())

        fut.add_done_callback(callback)
        if rank == 0 and (rank + i) % 2 == 1:
            store.set(attached, "1")
    deadline = time.monotonic() + 60
    while len(got) < COUNT and time.monotonic() < deadline:
        time.sleep(0.01)

    # The wrapped then() hands back what the callback returns, and its errors.
    base = dist.all_reduce(torch.ones(3), async_op=True).get_future()
    doubled = base.then(lambda f: f.value()[0] * 2).wait()

    def boom(f: torch.futures.Future) -> None:
        raise ValueError("raised in the callback")

    try:
        base.then(boom).wait()
        raised = ""
    except Exception as exc:  # noqa: BLE001 - its message is checked
        raised = str(exc)
    try:
        base.then(42)  # type: ignore[arg-type]
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    return {
        "got": got,
        "main": _thread_name(),
        "doubled": doubled.tolist(),
        "raised": raised,
        "refused": refused,
    }


def foreign_and_collected(rank: int, world: int) -> dict[str, Any]:
    """Two programs Gloo completes. (1) An allreduce issued from the callback of a future
    that is not fairring's (a plain torch Future, run inline) on some ranks and directly
    on others: it is the program's own collective, in its order, on every rank. (2) A
    callback of ``collect_all`` over fairring futures issues an allreduce, inline on some
    ranks and on a completion thread on others: it is a fairring callback everywhere."""
    foreign = []
    for i in range(4):
        x = torch.full((1000 + i,), float(rank + 1))
        if (rank + i) % 2 == 0:
            plain: torch.futures.Future[None] = torch.futures.Future()
            plain.set_result(None)
            plain.then(lambda f, x=x: dist.all_reduce(x)).wait()
        else:
            dist.all_reduce(x)
        foreign.append(x[0].item())
    collected = []
    for i in range(4):
        futs = [
            dist.all_reduce(torch.full((7 + j,), float(rank)), async_op=True).get_future()
            for j in range(2)
        ]
        both = torch.futures.collect_all(futs)
        if (rank + i) % 2 == 0:
            both.wait()  # complete: the callback runs inline, here

        def issue(f: torch.futures.Future, i: int = i) -> float:
            y = torch.full((30 + i,), float(10 * (rank + 1)))
            dist.all_reduce(y)
            return y[0].item()

        collected.append(both.then(issue).wait())
    return {"foreign": foreign, "collected": collected}


@memoised
def _foreign_results() -> list[dict[str, Any]]:
    return run_ranks(
        foreign_and_collected,
        len(MACHINES),
        MACHINES,
        DEFAULT_BACKEND,
        timeout_s=90,
        pg_timeout_s=20,
    )


def test_collectives_from_callbacks_of_other_futures_are_the_programs_own() -> None:
    world = len(MACHINES)
    for rank, r in enumerate(_foreign_results()):
        assert r["foreign"] == [float(sum(q + 1 for q in range(world)))] * 4, f"rank {rank}"


def test_callbacks_of_collect_all_over_fairring_futures_are_fairrings() -> None:
    world = len(MACHINES)
    for rank, r in enumerate(_foreign_results()):
        assert r["collected"] == [float(sum(10 * (q + 1) for q in range(world)))] * 4, (
            f"rank {rank}"
        )


@memoised
def _results() -> list[dict[str, Any]]:
    return run_ranks(done_callbacks, len(MACHINES), MACHINES, DEFAULT_BACKEND, timeout_s=120)


def test_done_callbacks_issue_allreduces_that_pair_up_inline_or_not() -> None:
    world = len(MACHINES)
    for rank, r in enumerate(_results()):
        assert sorted(r["got"]) == list(range(COUNT)), f"rank {rank}: callbacks {sorted(r['got'])}"
        for i, (value, issued, thread) in r["got"].items():
            assert value == sum(q + i for q in range(world)), f"rank {rank}, allreduce {i}"
            assert issued == sum(10 * (q + 1) for q in range(world)), f"rank {rank}, callback {i}"
            if (rank + i) % 2 == 0:
                assert thread == r["main"], f"rank {rank}: callback {i} ran on {thread}"
            elif rank == 0 and DEFAULT_BACKEND == "fairring":
                # Attached before the others posted: not complete, so not inline.
                assert thread == "fairring-cb", f"rank 0: callback {i} ran on {thread}"


def test_wrapped_callbacks_behave_as_torchs_own() -> None:
    world = len(MACHINES)
    for rank, r in enumerate(_results()):
        assert r["doubled"] == [2.0 * world] * 3, f"rank {rank}"
        assert "raised in the callback" in r["raised"], f"rank {rank}: {r['raised']!r}"
        assert r["refused"], f"rank {rank}: then(42) was accepted"


def registry_under_contention(rank: int, world: int, rounds: int) -> float:
    """Allreduces adopt their futures into the core's registry with the GIL released,
    and now and then prune the entries of futures Python has dropped; those of then()
    futures hold Python objects, freed under the GIL. Meanwhile another thread attaches
    callbacks, asking the registry (holding the GIL) whether a future is fairring's.
    Freeing a Python object while holding the registry's lock deadlocked the two."""
    stop = threading.Event()
    asked = 0

    def attach_in_a_loop() -> None:
        nonlocal asked
        done = torch.futures.Future()
        done.set_result(0)
        while not stop.is_set():
            done.then(lambda f: f.value())  # a foreign future: only the question is asked
            asked += 1

    # Hand the GIL over often: the main thread's rounds do not wait out the attacher's
    # default 5 ms turns.
    sys.setswitchinterval(0.0005)
    attacher = threading.Thread(target=attach_in_a_loop, daemon=True)
    attacher.start()
    total = 0.0
    try:
        for i in range(rounds):
            fut = dist.all_reduce(torch.full((4,), float(rank + i)), async_op=True).get_future()
            # A then() future whose value is a Python object, dropped at once: its last
            # reference is the registry's, until a later allreduce prunes it.
            fut.then(lambda f: {"held": [f.value()[0]]}).wait()
            total += fut.wait()[0][0].item()
    finally:
        stop.set()
        attacher.join()
    assert asked > 0
    return total


def test_the_registry_frees_python_values_outside_its_lock() -> None:
    # The registry prunes every few dozen adoptions: 400 rounds prune it about a dozen
    # times (about 10 s on an idle 2-core host); before the fix every try of 1000
    # rounds deadlocked.
    rounds = 400
    results = run_ranks(
        registry_under_contention, len(MACHINES), MACHINES, timeout_s=150, rounds=rounds
    )
    world = len(MACHINES)
    want = float(sum(sum(r + i for r in range(world)) for i in range(rounds)))
    assert results == [want] * world
