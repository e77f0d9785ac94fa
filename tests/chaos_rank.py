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
import zlib
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import stream_mutants
import torch
import torch.distributed as dist
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


# --------------------------------------------------------------- the collectives


def _allreduce_inputs(job: Job, call: Call, rank: int, dtype: str = "", numel: int = -1) -> Any:
    from values import make_values

    return make_values(
        f"chaos/{job.seed}/{call.index}",
        rank,
        call.op,
        dtype or call.dtype,
        call.numel if numel < 0 else numel,
        job.world,
        "wide",
    )


def check_allreduce(job: Job, call: Call, got: torch.Tensor) -> str | None:
    from values import compare, reference

    inputs = [_allreduce_inputs(job, call, r) for r in range(job.world)]
    want, tolerance = reference(inputs, call.op, call.dtype)
    return compare(got, want, tolerance, call.describe())


def _allreduce(
    inputs: torch.Tensor, form: str, op: str, group: Any
) -> tuple[Callable[[], torch.Tensor], Any]:
    """``inputs`` allreduced in ``form`` (tests/chaos_plan.py, ALLREDUCE_FORMS): how to
    read the result once done, and the work."""
    reduce_op = getattr(dist.ReduceOp, op)
    if form == "coalesced":
        half = inputs.numel() // 2
        parts = [inputs[:half].clone(), inputs[half:].clone()]
        work = dist.all_reduce_coalesced(parts, op=reduce_op, group=group, async_op=True)
        return lambda: torch.cat(parts), work
    if form == "strided":
        room = torch.zeros(2 * inputs.numel(), dtype=inputs.dtype)
        view = room[::2]
        view.copy_(inputs)
        work = dist.all_reduce(view, op=reduce_op, group=group, async_op=True)
        return lambda: view, work
    work = dist.all_reduce(inputs, op=reduce_op, group=group, async_op=True)
    return lambda: inputs, work


def _broadcast_values(job: Job, call: Call) -> torch.Tensor:
    gen = torch.Generator().manual_seed(job.seed * 1000 + call.index)
    return torch.randn(call.numel, generator=gen)


class _Model:
    """A linear layer under DDP whose gradients are exact small integers before DDP
    averages them: weight' = sum over the batch of w^T x, bias' = sum of w."""

    def __init__(self, job: Job, group: Any, hook: str) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(job.seed)
        self.world = job.world
        self.seed = job.seed
        self.ddp = DDP(torch.nn.Linear(6, 3), process_group=group)
        if hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        elif hook == "chained":
            # Unannotated: DDP compares annotations with dist.GradBucket, and this module's
            # are strings (postponed).
            self.ddp.register_comm_hook(group, lambda state, bucket: _chained_hook(state, bucket))
        self.tolerance = (5e-3, 5e-2) if hook == "fp16" else (1e-6, 1e-6)

    def release(self) -> None:
        """Lets go of the group where DDP would keep it: after a backward that raised,
        torch can keep the DDP object alive from C++, and with it the group (its
        reducer holds it, and the comm hook's state) and the group's Gloo delegates."""
        self.ddp.reducer = None
        self.ddp.logger = None  # its C++ Logger holds the reducer too
        self.ddp.process_group = None
        self.ddp._comm_hooks = []  # (hook, state): the state is the group

    def _batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 7919 + step * 31 + rank)
        x = torch.randint(-3, 4, (4, 6), generator=gen).float()
        w = torch.randint(-2, 3, (4, 3), generator=gen).float()
        return x, w

    def step(self, step: int, rank: int) -> str | None:
        """One forward and backward; what is wrong with the averaged gradients."""
        self.ddp.zero_grad(set_to_none=True)
        x, w = self._batch(step, rank)
        (self.ddp(x) * w).sum().backward()
        batches = [self._batch(step, r) for r in range(self.world)]
        want_w = sum(wr.t() @ xr for xr, wr in batches) / self.world
        want_b = sum(wr.sum(0) for _, wr in batches) / self.world
        rtol, atol = self.tolerance
        module = self.ddp.module
        for name, got, want in (
            ("weight", module.weight.grad, want_w),
            ("bias", module.bias.grad, want_b),
        ):
            if got is None or not torch.allclose(got, want, rtol=rtol, atol=atol):
                return f"ddp step {step}: {name} gradient {got} differs from {want}"
        return None


def _chained_hook(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """An allreduce, then in its callback a second one that blocks (as PowerSGD does):
    the number of ranks, which the sum is divided by."""

    def divide(fut: torch.futures.Future[Any]) -> torch.Tensor:
        count = torch.ones(1)
        dist.all_reduce(count, group=group)
        return fut.value()[0].div_(count.item())

    return dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future().then(divide)


def _ended(work: Any) -> Any:
    """A future that ends when ``work`` does (its first error, or all of it done); None
    where it has none. A coalescing manager's calls are its ``works``: without them the
    stamp would wait for the rank's wait, which other calls' waits may hold up (chaos
    seed 475: a coalesced all-gather stamped 0.35 s after the kill, behind a Gloo
    yardstick's wait, that had raised at 0.02 s)."""
    if work is None:
        return None
    parts = getattr(work, "works", None)
    with contextlib.suppress(Exception):
        if parts is None:
            return work.get_future()
        return _first_error_or_all([w.get_future() for w in parts])
    return None


def _first_error_or_all(futures: list[Any]) -> Any:
    """Ends at the first of ``futures`` to fail, or once all have ended (a call raises
    then; torch.futures.collect_all waits for all of them)."""
    if not futures:
        return None
    ended: torch.futures.Future = torch.futures.Future()
    lock = threading.Lock()
    left = [len(futures)]

    def one(f: Any) -> None:
        failed = False
        try:
            f.value()
        except Exception:  # noqa: BLE001 - an error ends the whole call
            failed = True
        with lock:
            left[0] -= 1
            if ended.done() or not (failed or left[0] == 0):
                return
            ended.set_result(None)

    for f in futures:
        f.add_done_callback(one)
    return ended


class _Pending:
    """A call in flight on one group: how to wait for it and check it, and when it
    ended (stamped by its future where it has one, so that the order of waits does
    not delay the stamp)."""

    def __init__(
        self,
        record: dict[str, Any],
        wait: Callable[[], None],
        check: Callable[[], str | None],
        work: Any,
    ) -> None:
        self.record = record
        self.wait_fn = wait
        self.check_fn = check
        future = _ended(work)
        if future is not None:
            future.add_done_callback(lambda _: record.setdefault("ended_at", time.time()))

    def finish(self) -> None:
        try:
            self.wait_fn()
        except Exception as exc:  # noqa: BLE001 - the error is the outcome
            self.record.setdefault("ended_at", time.time())
            self.record["error"] = f"{type(exc).__name__}: {exc}"
            return
        self.record.setdefault("ended_at", time.time())
        self.record["check"] = self.check_fn()
        self.record["done"] = True


class _Runner:
    def __init__(
        self, job: Job, rank: int, group: Any, name: str, models: dict[str, _Model]
    ) -> None:
        self.job = job
        self.rank = rank
        self.group = group
        self.name = name
        self.models = models
        self.records: list[dict[str, Any]] = []
        self.ddp_failed = False

    def _record(self, call: Call) -> dict[str, Any]:
        record: dict[str, Any] = {
            "index": call.index,
            "group": self.name,
            "posted_at": time.time(),
            "done": False,
            "error": None,
            "check": None,
        }
        self.records.append(record)
        return record

    def issue(self, call: Call, bad: str = "") -> _Pending | None:
        """Posts ``call`` (as ``bad`` gets it wrong, on the bad call's rank); a
        synchronous call is over on return (None)."""
        record = self._record(call)
        if bad:
            record["bad"] = bad
        try:
            return self._issue(call, record, bad)
        except Exception as exc:  # noqa: BLE001 - raised at the call: the outcome
            record["ended_at"] = time.time()
            record["error"] = f"{type(exc).__name__}: {exc}"
            return None

    def _issue(self, call: Call, record: dict[str, Any], bad: str) -> _Pending | None:
        job, rank, group = self.job, self.rank, self.group
        gloo = self.name == "gloo"
        if call.kind == "allreduce":
            dtype, op, numel = call.dtype, call.op, call.numel
            if gloo:  # Gloo has no AVG, bool or int16; the same sizes, as float32 sums
                dtype, op = "float32", "SUM"
            if bad == "size":
                numel += 1
            elif bad == "empty":
                numel = 0 if numel else 1
            elif bad == "dtype":
                # Another dtype the call is valid with (AVG needs a float): a mismatch,
                # not a call refused on this rank alone.
                floats = op == "AVG" or dtype == "int32"
                dtype = ("float64" if dtype != "float64" else "float32") if floats else "int32"
            elif bad == "op":
                op = "MAX" if op != "MAX" else "MIN"
            inputs = _allreduce_inputs(job, call, rank, dtype, numel)
            tensor, work = _allreduce(inputs, "" if gloo else call.form, op, group)

            def check() -> str | None:
                if gloo or bad:
                    return None
                got = tensor()
                # Every rank receives the same bytes (one reduction per shard, copied
                # to all): the verdict compares these across ranks.
                record["digest"] = zlib.crc32(got.contiguous().view(torch.uint8).numpy())
                return check_allreduce(job, call, got)

            return _Pending(record, work.wait, check, work)
        if call.kind in ("reduce_scatter", "all_gather"):
            return self._sharded(call, record, bad)
        if call.kind == "broadcast":
            want = _broadcast_values(job, call)
            tensor = want.clone() if rank == call.src else torch.zeros(call.numel)
            work = dist.broadcast(tensor, src=call.src, group=group, async_op=True)
            what = call.describe()

            def check() -> str | None:
                return None if torch.equal(tensor, want) else f"{what}: wrong values"

            return _Pending(record, work.wait, check, work)
        if call.kind == "barrier":
            dist.barrier(group=group)
        elif call.kind == "ddp":
            record["after_ddp_failure"] = self.ddp_failed
            try:
                record["check"] = self.models[self.name].step(call.index, rank)
            except Exception:
                self.ddp_failed = True
                raise
        record["ended_at"] = time.time()
        record["done"] = True
        return None

    def _sharded(self, call: Call, record: dict[str, Any], bad: str) -> _Pending:
        from collective_forms import _all_gather, _reduce_scatter, issue

        job, group = self.job, self.group
        key = f"chaos/{job.seed}/{call.index}"
        form = call.form if self.name == "fairring" else call.kind  # Gloo: the tensor forms
        if bad == "refused":
            n, world = call.numel, job.world
            if call.kind == "reduce_scatter":
                work = _reduce_scatter(
                    torch.empty(n, dtype=torch.int64),
                    torch.ones(world * n + 1, dtype=torch.int64),
                    group=group,
                    async_op=True,
                )
            else:
                work = _all_gather(
                    torch.empty(world * n + 1, dtype=torch.int64),
                    torch.ones(n, dtype=torch.int64),
                    group=group,
                    async_op=True,
                )
            return _Pending(record, work.wait, lambda: None, work)
        issued = issue(form, key, call.numel + (1 if bad == "size" else 0), group=group)
        check = issued.check if not bad and self.name == "fairring" else (lambda: None)
        return _Pending(record, issued.wait, check, issued.work)


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


def _die(job: Job, job_dir: Path, store: Any, runners: list[_Runner], call: Call) -> None:
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
    models: dict[str, _Model] = {}
    runners = [_Runner(job, rank, group, "fairring", models)]
    if gloo is not None:
        runners.append(_Runner(job, rank, gloo, "gloo", models))
    setup_errors = []
    started_at = time.time()
    try:
        for runner in runners if hook is not None else []:
            models[runner.name] = _Model(job, runner.group, hook)
            # DDP's second iteration broadcasts its rebuilt buckets: before the program,
            # so that no program step issues a collective another rank may skip.
            for step in (-2, -1):
                if err := models[runner.name].step(step, rank):
                    setup_errors.append(f"{runner.name}: {err}")
    except Exception as exc:  # noqa: BLE001 - DDP's broadcast met a rank lost at start-up
        for model in models.values():
            model.release()
        error = {"error": f"{type(exc).__name__}: {exc}", "posted_at": started_at}
        return {"start_error": error | {"ended_at": time.time()}, "ring_abandoned": 0}
    waits = random.Random(f"chaos/{job.seed}/waits/{rank}")  # differs between ranks
    pending: list[_Pending] = []
    for call in job.calls:
        if call.index == fault.turn and at_fault:
            if fault.kind in ("kill", "leave", "freeze"):
                _die(job, directory, store, runners, call)
            if fault.kind == "slow":
                time.sleep(fault.delay_ms / 1000)
            if fault.kind == "store_death":
                _kill_the_store(directory, store, job.world)
            if fault.kind == "skip":
                continue
            if fault.kind == "cut":
                _arm(fault.point, "close", key=fault.peer)
                armed.append(fault.point)
            if fault.kind == "delay":
                _arm(fault.point, "delay", fault.delay_ms, fault.times, fault.peer)
                armed.append(fault.point)
        ends = {fault.rank: fault.peer, fault.peer: fault.rank}
        if fault.kind == "partition" and call.index == fault.turn and rank in ends:
            _arm(fault.point, "delay", fault.delay_ms, 1, ends[rank])  # each end stops reading
            armed.append(fault.point)
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
