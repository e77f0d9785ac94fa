"""One rank of a chaos job (scripts/chaos.py): the job's program on a fairring group of
its own (and, where the job says so, the same program on a Gloo group beside it), the
fault where it falls, every outcome recorded with its time; the verdict is
tests/chaos_verdict.py's, in the parent.

Signals between ranks go through the job's store; a killed rank's time of death and
its pid go through files in ``job_dir`` (the parent's), which a dying process can write
and a machine-mate's watcher thread can read without the store.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import stream_mutants
import torch
import torch.distributed as dist
from chaos_calls import Model, Pending, Runner, warm_ddp
from chaos_plan import MATE_AFTER_S, Call, Job
from reliability_helpers import default_store

_POLL_S = 0.005
_SETTLE_S = 3.0  # how long threads that are on their way out may take to go


# ------------------------------------------------------------------ what is left


def _threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
    return sorted(names)


def resources() -> dict[str, Any]:
    from reliability_helpers import _socket_inodes, listening_sockets

    return {
        "threads": _threads(),
        "sockets": sorted(_socket_inodes()),
        "listening": listening_sockets(),
    }


def _named_resources() -> dict[str, Any]:
    """resources(), once the default group's watchdog thread has named itself (it names
    itself after it starts), so that fairring's threads can be counted by name."""
    deadline = time.monotonic() + _SETTLE_S
    while "fairring-watch" not in (now := resources())["threads"]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return now


def settled_resources(before: dict[str, Any], settle_s: float = _SETTLE_S) -> dict[str, Any]:
    """What this process holds once threads on their way out are gone (or after
    ``settle_s``): a completion thread that has just run a callback exits after it.
    Threads are counted, not named: one that started just before ``before`` may not
    have named itself yet."""
    deadline = time.monotonic() + settle_s
    while True:
        now = resources()
        settled = len(now["threads"]) <= len(before["threads"])
        if settled and not set(now["sockets"]) - set(before["sockets"]):
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.05)


# --------------------------------------------------------------------- the faults


def _arm(point: str, action: str, delay_ms: int = 0, times: int = 1, key: int = -1) -> None:
    import fault_points

    fault_points.arm(point, action, delay_ms=delay_ms, times=times, key=key)


def _fired(point: str) -> int:
    import fault_points

    return fault_points.uses(point)


def _kill_the_store(job_dir: Path, store: Any, world: int) -> None:
    """The process that hosts the job's store dies (tests/multiprocess.py's
    store_in_process), as the host of torchrun's rendezvous store may, once every rank's
    group has started (a rank may still be starting when another is at its turn: its
    first calls may be empty, or Gloo's)."""
    store.wait([f"chaos/ready/{r}" for r in range(world)], timedelta(seconds=60))
    _write_time(job_dir / "store_dead_at")
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(os.environ["FAIRRING_TEST_STORE_PID"]), signal.SIGKILL)


def _fired_at(point: str) -> float:
    import fault_points

    return fault_points.last_use(point)


def _write_time(path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(repr(time.time()))
    os.replace(tmp, path)


def _watch_for_mates_death(job_dir: Path, rank: int) -> None:
    """As torchrun's agent does: once a rank of this machine died, the rest of the
    machine dies MATE_AFTER_S later (stamped, so that the verdict tells this death from
    a crash of fairring's before it)."""

    def watch() -> None:
        path = job_dir / "kill_at"
        while not path.exists():
            time.sleep(_POLL_S)
        killed_at = float(path.read_text())
        time.sleep(max(0.0, killed_at + MATE_AFTER_S - time.time()))
        _write_time(job_dir / f"mate_at_{rank}")
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="chaos-mate").start()


def _await_posted(store: Any, job: Job, turn: int) -> None:
    """The fault's rank waits for every other rank to be inside the call of its turn."""
    others = [r for r in range(job.world) if r != job.fault.rank]
    store.wait([f"chaos/posted/{r}/{turn}" for r in others], timedelta(seconds=60))


class LeftEarly(Exception):
    """A leaving rank's program ends at its turn (FAULTS' "leave", how "exit")."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # as a training script's handler does: atexit runs


def _die(job: Job, job_dir: Path, store: Any, runners: list[Runner], call: Call) -> None:
    """The killed, leaving or frozen rank at its turn: once the others are inside the
    call, it posts it (an asynchronous one) and dies, leaves or stops a few ms later."""
    fault = job.fault
    _await_posted(store, job, call.index)
    if fault.kind in ("kill", "leave"):
        if call.kind not in ("barrier", "ddp"):
            for runner in runners:
                runner.issue(call)
        time.sleep(fault.after_ms / 1000)
        _write_time(job_dir / "kill_at")
        if fault.how == "exit":
            raise LeftEarly
        os.kill(os.getpid(), signal.SIGTERM if fault.kind == "leave" else signal.SIGKILL)
        time.sleep(600)  # the handler (sigterm_handled) raises here
    _write_time(job_dir / "freeze_at")
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)  # the first survivor SIGKILLs this process once every survivor is done


# ---------------------------------------------------------------------- the rank


def _kill_during_start(job_dir: Path, after_ms: int) -> None:
    def kill() -> None:
        time.sleep(after_ms / 1000)
        _write_time(job_dir / "kill_at")
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill, daemon=True, name="chaos-kill").start()


def chaos_rank(rank: int, world: int, job: Job, job_dir: str) -> dict[str, Any]:
    stream_mutants.arm_from_env()
    directory = Path(job_dir)
    (directory / f"rank{rank}.pid").write_text(str(os.getpid()))
    store = default_store()
    fault = job.fault
    if fault.kind == "kill" and fault.mates_die and rank in job.mates(fault.rank):
        _watch_for_mates_death(directory, rank)
    if fault.how == "sigterm_handled" and rank == fault.rank:
        signal.signal(signal.SIGTERM, _on_sigterm)
    armed: list[str] = []
    if rank == fault.rank and fault.kind == "delay" and fault.turn < 0:
        _arm(fault.point, "delay", fault.delay_ms, fault.times, fault.peer)
        armed.append(fault.point)
    if fault.kind == "bad_call" and fault.held_abort_ms and rank == (fault.rank + 1) % world:
        _arm("mesh.send.first", "delay", fault.held_abort_ms, times=8)
        armed.append("mesh.send.first")
    timeout = timedelta(seconds=job.group_timeout_s)
    # Gloo's group first: what is left once fairring's group is gone is fairring's.
    gloo = dist.new_group(backend="gloo", timeout=timeout) if job.mirror_gloo else None
    if any(c.kind == "ddp" for c in job.calls):
        warm_ddp()
    before = _named_resources()
    if fault.kind == "start_kill" and rank == fault.rank:
        _kill_during_start(directory, fault.after_ms)
    started_at = time.time()
    try:
        group = dist.new_group(backend="fairring", timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a peer lost while the group starts: the outcome
        error = {"error": f"{type(exc).__name__}: {exc}", "posted_at": started_at}
        return {"start_error": error | {"ended_at": time.time()}, **_regroup(job, rank)}
    ready_at = time.time()
    if fault.kind == "store_death":
        store.set(f"chaos/ready/{rank}", "1")
    # Everything that holds the group (DDP, works, runners) lives in _program's frame
    # and is gone once it returns: what is left after destroy is fairring's own.
    try:
        out = _program(job, rank, group, gloo, directory, store, armed)
    except LeftEarly:
        return {"left": True}  # the harness then destroys every group, as a script's end does
    out["start_s"] = (started_at, ready_at)
    t0 = time.monotonic()
    dist.destroy_process_group(group)
    out["destroy_s"] = time.monotonic() - t0
    freed = weakref.ref(group)
    del group
    gc.collect()
    # Python's last reference gone: what the group held (its Gloo delegates) is too.
    out["group_freed"] = freed() is None
    if not out["group_freed"]:
        out["group_held_by"] = _holders(freed())
    # A call Gloo still runs for nobody (a ring call given up on, a DDP step's that
    # raised) ends at Gloo's timeout at the latest: its group goes then.
    gloo_may_run = out["ring_abandoned"] or any(
        r["error"] for r in out.get("records", []) if r.get("after_ddp_failure") is not None
    )
    settle_s = job.group_timeout_s + _SETTLE_S if gloo_may_run else _SETTLE_S
    out["after"] = settled_resources(before, settle_s)
    out["before"] = before
    if gloo is not None:
        dist.destroy_process_group(gloo)
    out["fired"] = {point: _fired(point) for point in set(armed)}
    out["fired_at"] = {point: _fired_at(point) for point in set(armed)}
    _release_frozen(store, job, rank, directory)
    return out | _regroup(job, rank)


REGROUP_TIMEOUT_S = 90.0


def _holders(obj: Any) -> list[str]:
    """What holds ``obj`` (Python's referrers, two levels up), for the verdict."""
    out = []
    for ref in gc.get_referrers(obj):
        if isinstance(ref, type(_holders.__code__)) or ref is None:
            continue
        up = [type(r).__name__ for r in gc.get_referrers(ref)][:4]
        out.append(f"{type(ref).__name__} {str(ref)[:80]!r} in {up}")
    return out[:6]


def _regroup(job: Job, rank: int) -> dict[str, Any]:
    """After a rank died or left: the survivors make a new fairring group of their own in
    the same process, as an elastic job does, and an allreduce on it is exact."""
    survivors = sorted(set(range(job.world)) - job.dead())
    if len(survivors) == job.world or len(survivors) < 2:
        return {}
    out: dict[str, Any] = {"error": None, "check": None}
    try:
        group = dist.new_group(
            ranks=survivors,
            backend="fairring",
            # The survivors come here up to Gloo's timeout apart (the Gloo group beside).
            timeout=timedelta(seconds=REGROUP_TIMEOUT_S),
            use_local_synchronization=True,
        )
        tensor = torch.full((1000,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(tensor, group=group)
        want = float(sum(r + 1 for r in survivors))
        if not torch.equal(tensor, torch.full_like(tensor, want)):
            out["check"] = f"the new group's allreduce gave {tensor[:3].tolist()}, not {want}"
        t0 = time.monotonic()
        dist.destroy_process_group(group)
        out["destroy_s"] = time.monotonic() - t0
    except Exception as exc:  # noqa: BLE001 - the outcome
        out["error"] = f"{type(exc).__name__}: {exc}"
    return {"regroup": out}


def _program(
    job: Job, rank: int, group: Any, gloo: Any, directory: Path, store: Any, armed: list[str]
) -> dict[str, Any]:
    """The program on ``group`` (and ``gloo``), the fault where it falls; every call's
    record, DDP's set-up errors and the group's ring statistics."""
    fault = job.fault
    at_fault = rank == fault.rank
    hook = next((c.form for c in job.calls if c.kind == "ddp"), None)
    models: dict[str, Model] = {}
    runners = [Runner(job, rank, group, "fairring", models)]
    if gloo is not None:
        runners.append(Runner(job, rank, gloo, "gloo", models))
    setup_errors = []
    started_at = time.time()
    try:
        for runner in runners if hook is not None else []:
            models[runner.name] = Model(job, runner.group, hook)
            # DDP's second iteration broadcasts its rebuilt buckets: before the program,
            # so that no program step issues a collective another rank may skip.
            for step in (-2, -1):
                if err := models[runner.name].step(step, rank):
                    setup_errors.append(f"{runner.name}: {err}")
    except Exception as exc:  # noqa: BLE001 - DDP's broadcast met a rank lost at start-up
        for model in models.values():
            model.release()
        error = {"error": f"{type(exc).__name__}: {exc}", "posted_at": started_at}
        error |= {"what": "setting up DDP", "ended_at": time.time()}
        return {"start_error": error, "ring_abandoned": 0}
    waits = random.Random(f"chaos/{job.seed}/waits/{rank}")  # differs between ranks
    pending: list[Pending] = []
    for call in job.calls:
        if call.index == fault.turn and not _fault_falls(
            job, rank, directory, store, runners, armed
        ):
            continue  # the skipped call
        wrong = fault.kind == "bad_call" and at_fault and call.index == fault.turn
        bad = fault.variant if wrong else ""
        sync = call.kind in ("barrier", "ddp")
        posts = call.index == fault.turn and fault.kind != "store_death"
        if sync and posts:
            store.set(f"chaos/posted/{rank}/{call.index}", "1")
        if sync and len(runners) == 2:
            # Both groups' calls at once: Gloo's time to raise must not wait for fairring's.
            side = threading.Thread(target=runners[1].issue, args=(call,))
            side.start()
            runners[0].issue(call, bad)
            side.join()
        else:
            for runner in runners:
                if (p := runner.issue(call, bad if runner.name == "fairring" else "")) is not None:
                    pending.append(p)
        if not sync and posts:
            store.set(f"chaos/posted/{rank}/{call.index}", "1")
        while pending and waits.random() < 0.4:
            pending.pop(waits.randrange(len(pending))).finish()
    waits.shuffle(pending)
    for item in pending:
        item.finish()
    stats = None
    with contextlib.suppress(Exception):
        stats = group._get_backend(torch.device("cpu")).cpu_allreduce_stats()
    for model in models.values():
        model.release()
    return {
        "records": [r for runner in runners for r in runner.records],
        "setup_errors": setup_errors,
        "ring_abandoned": int(stats.get("ring_abandoned", 0)) if stats else 0,
    }


def _fault_falls(
    job: Job, rank: int, directory: Path, store: Any, runners: list[Runner], armed: list[str]
) -> bool:
    """The fault at its turn, on the ranks it falls on; False where this rank skips the
    call."""
    fault = job.fault
    call = job.calls[fault.turn]
    ends = {fault.rank: fault.peer, fault.peer: fault.rank}
    if fault.kind == "partition" and rank in ends:
        _arm(fault.point, "delay", fault.delay_ms, 1, ends[rank])  # each end stops reading
        armed.append(fault.point)
    if rank != fault.rank:
        return True
    if fault.kind in ("kill", "leave", "freeze"):
        _die(job, directory, store, runners, call)
    if fault.kind == "slow":
        time.sleep(fault.delay_ms / 1000)
    if fault.kind == "store_death":
        _kill_the_store(directory, store, job.world)
    if fault.kind in ("cut", "delay"):
        action = "close" if fault.kind == "cut" else "delay"
        _arm(fault.point, action, fault.delay_ms, fault.times, fault.peer)
        armed.append(fault.point)
    return fault.kind != "skip"


def _release_frozen(store: Any, job: Job, rank: int, directory: Path) -> None:
    """A frozen rank is SIGKILLed once every survivor is done: its death must not be
    reported in place of the timeout."""
    if job.fault.kind != "freeze":
        return
    survivors = [r for r in range(job.world) if r != job.fault.rank]
    store.add("chaos/done", 1)
    if rank != survivors[0]:
        return
    deadline = time.monotonic() + 120
    while store.add("chaos/done", 0) < len(survivors) and time.monotonic() < deadline:
        time.sleep(0.02)
    pid = int((directory / f"rank{job.fault.rank}.pid").read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
