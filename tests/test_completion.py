"""Completion order of allreduce futures (docs/design.md, "Completion order and comm hooks").

c10d's contract, as DDP comm hooks rely on it: callbacks of allreduce futures run in
issue order on every rank, never on a thread an unfinished allreduce needs, and a
callback that blocks on a later allreduce does not stop that allreduce from
completing. Each case runs with per-rank random delays (in the issuing loop and inside
the callbacks) and allreduces of very different sizes, so that the operations finish
in a different order on every rank and in every run; callbacks that issue collectives
give each of them a size and values that depend on the callback, so a callback run
out of order on one rank would pair different operations across ranks (refused as a
mismatch, or wrong sums: both are caught). Callbacks are attached right after the
issue, while the allreduce is in flight, as DDP does.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from case_job import CaseJob
from multiprocess import DEFAULT_BACKEND, SHAPES, fairring_env, run_ranks

BACKEND = DEFAULT_BACKEND
MACHINES = SHAPES["2x2"]
# Small slices and staging: the big allreduces take many slices and finish late.
ENV = fairring_env(total_memory=256 * 1024, slice_size=32 * 1024, FAIRRING_SLICE_SCALING="off")
SIZES = (1, 7, 1000, 30_000, 200_000)
ROUNDS = 3  # each case repeats with fresh random timing
CALLBACK_THREAD = "fairring-cb"
INLINE_AT = 5  # in_order: the allreduce whose callback is attached after its wait
# The random delays derive from this seed (FAIRRING_TEST_SEED replays a failed run);
# every error a case reports names it.
SEED = int(os.environ.get("FAIRRING_TEST_SEED") or random.SystemRandom().randrange(1 << 32))


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    count: int = 16
    seed: int = SEED


def _thread_name() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


def _rank_sum(world: int, value: Callable[[int], float]) -> float:
    return float(sum(value(r) for r in range(world)))


def _delays(case: Case, what: str, rank: int, n: int, most_s: float) -> list[float]:
    """Per-rank random pauses: different on every rank, in every round and (with a
    fresh seed) in every run; the same again for the same seed."""
    rng = random.Random(f"{case.seed}/{case.id}/{what}/{rank}/{_round.index}")
    return [rng.random() * most_s for _ in range(n)]


class _Round(threading.local):
    index = 0


_round = _Round()


def _rounds(
    one: Callable[[int, int, Case], str | None], rank: int, world: int, case: Case
) -> str | None:
    """ROUNDS runs of a check, each with fresh random timing; the first error."""
    for index in range(ROUNDS):
        _round.index = index
        if err := one(rank, world, case):
            return f"{err} (round {index}; FAIRRING_TEST_SEED={case.seed} replays the delays)"
    return None


def _expect(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if torch.equal(got, want):
        return None
    return f"{what}: got {got.flatten()[:4].tolist()}..., expected {want.flatten()[:4].tolist()}..."


def _in_order_round(rank: int, world: int, case: Case) -> str | None:
    """Callbacks of concurrent allreduces run in issue order, on completion threads."""
    sizes = [random.Random(f"{case.id}/{i}").choice(SIZES) for i in range(case.count)]
    issue_pause = _delays(case, "issue", rank, case.count, 0.004)
    callback_pause = _delays(case, "callback", rank, case.count, 0.004)
    ran: list[tuple[int, str]] = []
    # The thread attaching the callbacks, where c10 runs one inline. Not
    # threading.main_thread().native_id: in a forked rank (tests/rank_zygote.py)
    # Python keeps the parent's there, so inline runs looked like another thread's.
    here = threading.get_native_id()
    inline = f"inline on {here}"

    def make_callback(i: int) -> Callable[[torch.futures.Future], torch.Tensor]:
        def callback(fut: torch.futures.Future) -> torch.Tensor:
            ran.append((i, inline if threading.get_native_id() == here else _thread_name()))
            time.sleep(callback_pause[i])
            return fut.value()[0]

        return callback

    futures = []
    for i, n in enumerate(sizes):
        t = torch.full((n,), float(rank + 1 + i))
        fut = dist.all_reduce(t, async_op=True).get_future()
        if i == INLINE_AT:
            fut.wait()  # every round has one callback that runs inline, told apart
        futures.append(fut.then(make_callback(i)))
        time.sleep(issue_pause[i])
    for i, (n, fut) in enumerate(zip(sizes, futures, strict=True)):
        want = torch.full((n,), _rank_sum(world, lambda r, i=i: r + 1 + i))
        if err := _expect(f"allreduce #{i}", fut.wait(), want):
            return err
    # A callback attached after its future completed runs inline, on the attaching
    # thread (c10's rule; rare here but at INLINE_AT, as callbacks are attached right
    # after the issue): the others ran on completion threads, in issue order.
    order = [i for i, name in ran if name != inline]
    if len(ran) != case.count:
        return f"{len(ran)} of {case.count} callbacks ran"
    if (INLINE_AT, inline) not in ran:
        return f"allreduce #{INLINE_AT}'s callback, attached after its wait, ran elsewhere: {ran}"
    # Inline runs are the exception: a core that ran every callback inline (or most)
    # would leave nothing here to check the order of.
    if len(order) < case.count // 2:
        return f"only {len(order)} of {case.count} callbacks ran on completion threads"
    if order != sorted(order):
        return f"callbacks ran in the order {order}"
    threads = {name for _, name in ran if name != inline}
    if threads - {CALLBACK_THREAD}:
        return f"callbacks ran on threads {threads}, expected only {CALLBACK_THREAD}"
    return None


def _issuing_round(rank: int, world: int, case: Case) -> str | None:
    """Callbacks that issue collectives (allreduce waited at once, allreduce with a
    callback of its own, a collective delegated to Gloo) issue them in the same order
    on every rank, with exact results."""
    sizes = [random.Random(f"{case.id}/{i}").choice(SIZES) for i in range(case.count)]
    issue_pause = _delays(case, "issue", rank, case.count, 0.003)
    callback_pause = _delays(case, "callback", rank, case.count, 0.003)
    errors: list[str] = []

    def make_callback(i: int) -> Callable[[torch.futures.Future], torch.Tensor]:
        def callback(fut: torch.futures.Future) -> torch.Tensor:
            time.sleep(callback_pause[i])
            # Size and values depend on i: out of order, ranks would pair them wrong.
            x = torch.full((i + 1,), float((rank + 1) * (i + 1)))
            dist.all_reduce(x)
            want_x = torch.full((i + 1,), (i + 1) * _rank_sum(world, lambda r: r + 1))
            doubled = (
                dist.all_reduce(torch.full((i + 2,), float(rank)), async_op=True)
                .get_future()
                .then(lambda f: f.value()[0] * 2)
                .wait()
            )
            want_doubled = torch.full((i + 2,), 2 * _rank_sum(world, float))
            gathered = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(gathered, torch.tensor([float(100 * i + rank)]))
            want_gathered = torch.tensor([float(100 * i + r) for r in range(world)])
            for what, got, want in (
                (f"callback {i}: allreduce", x, want_x),
                (f"callback {i}: chained allreduce", doubled, want_doubled),
                (f"callback {i}: all_gather", torch.cat(gathered), want_gathered),
            ):
                if err := _expect(what, got, want):
                    errors.append(err)
            return fut.value()[0]

        return callback

    futures = []
    for i, n in enumerate(sizes):
        t = torch.full((n,), float(rank - i))
        futures.append(dist.all_reduce(t, async_op=True).get_future().then(make_callback(i)))
        time.sleep(issue_pause[i])
    for i, (n, fut) in enumerate(zip(sizes, futures, strict=True)):
        want = torch.full((n,), _rank_sum(world, lambda r, i=i: r - i))
        if err := _expect(f"allreduce #{i}", fut.wait(), want):
            return err
    if errors:
        return "; ".join(errors)
    return None


def _inline_round(rank: int, world: int, case: Case) -> str | None:
    """A callback attached after its future completed runs at once on the attaching
    thread (c10's rule), and whether that happens depends on timing. Here it is forced
    on half the ranks for each allreduce (they wait before attaching), while the others
    attach at once: the allreduces the callbacks issue still pair up across ranks, in
    issue order, behind slow callbacks of earlier allreduces still running on workers."""
    sizes = [random.Random(f"{case.id}/{i}").choice(SIZES) for i in range(case.count)]
    callback_pause = _delays(case, "callback", rank, case.count, 0.004)
    ran: list[tuple[int, str]] = []

    def make_callback(i: int) -> Callable[[torch.futures.Future], torch.Tensor]:
        def callback(fut: torch.futures.Future) -> torch.Tensor:
            time.sleep(callback_pause[i])
            ran.append((i, threading.current_thread().name))
            x = torch.full((i + 1,), float((rank + 1) * (i + 1)))
            dist.all_reduce(x)
            return fut.value()[0] + x[0]

        return callback

    futures = []
    for i, n in enumerate(sizes):
        fut = dist.all_reduce(torch.full((n,), float(rank + i)), async_op=True).get_future()
        if (rank + i) % 2 == 0:
            fut.wait()  # complete before then(): the callback runs here, inline
        futures.append(fut.then(make_callback(i)))
    for i, (n, fut) in enumerate(zip(sizes, futures, strict=True)):
        want = _rank_sum(world, lambda r, i=i: r + i) + (i + 1) * _rank_sum(world, lambda r: r + 1)
        if err := _expect(f"allreduce #{i} and its callback's", fut.wait(), torch.full((n,), want)):
            return err
    inline = {i for i, name in ran if name == threading.main_thread().name}
    if missing := {i for i in range(case.count) if (rank + i) % 2 == 0} - inline:
        return f"callbacks of waited futures {sorted(missing)} did not run inline"
    return None


def _blocking_round(rank: int, world: int, case: Case) -> str | None:
    """A callback blocks on allreduces issued after its own (by the main thread): they
    complete, and the callbacks of later allreduces wait for it, still in order."""
    later: dict[str, torch.futures.Future] = {}
    works: dict[str, dist.Work] = {}
    issued = threading.Event()
    order: list[str] = []
    pause = _delays(case, "issue", rank, 2, 0.01)

    def blocked(fut: torch.futures.Future) -> torch.Tensor:
        order.append("a")
        if not issued.wait(timeout=60):
            raise TimeoutError("the main thread never issued the later allreduces")
        b = later["b"].wait()[0]  # Future.wait on a later allreduce
        works["c"].wait()  # Work.wait on another one
        return fut.value()[0] + b.sum() + works["c"].result()[0].sum()

    def after(fut: torch.futures.Future) -> torch.Tensor:
        order.append("b")
        return fut.value()[0]

    a = torch.full((200_000,), float(rank + 1))
    b = torch.full((30_000,), float(10 * (rank + 1)))
    c = torch.full((7,), float(100 * (rank + 1)))
    fa = dist.all_reduce(a, async_op=True).get_future().then(blocked)
    time.sleep(pause[0])
    later["b"] = dist.all_reduce(b, async_op=True).get_future()
    fb = later["b"].then(after)
    time.sleep(pause[1])
    works["c"] = dist.all_reduce(c, async_op=True)
    issued.set()
    got_a = fa.wait()
    fb.wait()
    s = _rank_sum(world, lambda r: r + 1)
    want_a = torch.full((200_000,), s + 10 * s * 30_000 + 100 * s * 7)
    if err := _expect("blocked callback", got_a, want_a):
        return err
    if order != ["a", "b"]:
        return f"callbacks ran in the order {order}"
    return None


def run_raising(rank: int, world: int, case: Case) -> str | None:
    """A callback that raises fails its own chained future only; the next callbacks
    still run in order and the group stays usable."""
    order: list[int] = []

    def bad(fut: torch.futures.Future) -> torch.Tensor:
        order.append(0)
        raise ValueError("raised by callback 0")

    def good(fut: torch.futures.Future) -> torch.Tensor:
        order.append(1)
        return fut.value()[0] + 1

    f0 = dist.all_reduce(torch.ones(30_000), async_op=True).get_future().then(bad)
    f1 = dist.all_reduce(torch.ones(5), async_op=True).get_future().then(good)
    try:
        f0.wait()
        return "the raising callback's future completed without an error"
    except Exception as exc:  # noqa: BLE001 - checked below
        if "raised by callback 0" not in str(exc):
            return f"the raising callback's future failed with something else: {exc}"
    if err := _expect("callback after the raising one", f1.wait(), torch.full((5,), world + 1.0)):
        return err
    if order != [0, 1]:
        return f"callbacks ran in the order {order}"
    t = torch.ones(3)
    dist.all_reduce(t)
    return _expect("allreduce after the raising callback", t, torch.full((3,), float(world)))


RUNNERS: dict[str, Callable[[int, int, Case], str | None]] = {
    "in_order": _in_order_round,
    "issuing": _issuing_round,
    "inline": _inline_round,
    "blocking": _blocking_round,
}
CASES = [Case(name) for name in (*RUNNERS, "raising")]


def run_case(rank: int, world: int, case: Case) -> str | None:
    if case.id == "raising":
        return run_raising(rank, world, case)
    return _rounds(RUNNERS[case.id], rank, world, case)


JOB = CaseJob(
    f"completion (FAIRRING_TEST_SEED={SEED})",
    run_case,
    CASES,
    MACHINES,
    BACKEND,
    env=ENV,
    timeout_s=240,
)


def test_callbacks_run_in_issue_order_on_completion_threads() -> None:
    JOB.check("in_order")


def test_callbacks_issuing_collectives_keep_the_same_order_on_every_rank() -> None:
    JOB.check("issuing")


def test_callbacks_run_inline_take_the_same_pipeline_on_every_rank() -> None:
    JOB.check("inline")


def test_callback_blocking_on_later_allreduces_does_not_stop_them() -> None:
    JOB.check("blocking")


def test_raising_callback_fails_only_its_future() -> None:
    JOB.check("raising")


# ------------------------------------------------- a callback that waits on a later callback


def _wait_on_later_callback(rank: int, world: int) -> dict[str, object]:
    """A callback waits for what a later allreduce's callback computes: callbacks run
    one at a time in issue order, so that is a deadlock, broken (with a warning) once
    the group's timeout has passed rather than never."""
    issued = threading.Event()
    later: dict[str, torch.futures.Future] = {}

    def waits_for_later(fut: torch.futures.Future) -> torch.Tensor:
        issued.wait(timeout=60)
        return fut.value()[0] + later["b"].wait()

    fa = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(waits_for_later)
    later["b"] = (
        dist.all_reduce(torch.ones(4), async_op=True).get_future().then(lambda f: f.value()[0] * 10)
    )
    issued.set()
    start = time.monotonic()
    got = fa.wait()
    return {"seconds": time.monotonic() - start, "value": got.tolist()}


PG_TIMEOUT_S = 4.0


def test_callback_waiting_on_a_later_callback_is_released_at_the_timeout() -> None:
    if BACKEND == "gloo":
        pytest.skip("Gloo runs callbacks on its own threads, concurrently: nothing to release")
    results = run_ranks(
        _wait_on_later_callback,
        len(MACHINES),
        MACHINES,
        BACKEND,
        ENV,
        timeout_s=60,
        pg_timeout_s=PG_TIMEOUT_S,
    )
    for rank, res in enumerate(results):
        assert res["value"] == [4.0 + 40.0] * 4, f"rank {rank}: {res}"
        assert PG_TIMEOUT_S * 0.9 <= res["seconds"] < PG_TIMEOUT_S + 20, f"rank {rank}: {res}"
