"""The calls of a chaos job's program (tests/chaos_rank.py): each kind issued on a
group (fairring's, or Gloo's beside it), its end stamped by its future, its result
checked against values computed from every rank's inputs; DDP steps with their hooks."""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from chaos_plan import Call, Job


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


def warm_ddp() -> None:
    """DDP's first construction in a process imports torch._dynamo, seconds on a loaded
    host (chaos seed 117: 3-4 s at load 6, counted as fairring's time to raise): done
    before the group starts, so a DDP set-up is timed by its collectives alone."""
    import torch._dynamo.utils

    torch._dynamo.utils.get_optimize_ddp_mode()


class Model:
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
    yardstick's wait, that had raised at 0.02 s). An asynchronous ``all_reduce_coalesced``
    returns its work's future itself (chaos seeds 5009, 5049: stamped at the wait, 30 s
    behind a Gloo yardstick's)."""
    if work is None:
        return None
    if isinstance(work, torch._C.Future):
        return work
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


class Pending:
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


class Runner:
    def __init__(
        self, job: Job, rank: int, group: Any, name: str, models: dict[str, Model]
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

    def issue(self, call: Call, bad: str = "") -> Pending | None:
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

    def _issue(self, call: Call, record: dict[str, Any], bad: str) -> Pending | None:
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
            record["posted_at"] = time.time()  # the call's time, not the inputs' making
            tensor, work = _allreduce(inputs, "" if gloo else call.form, op, group)

            def check() -> str | None:
                if gloo or bad:
                    return None
                got = tensor()
                # Every rank receives the same bytes (one reduction per shard, copied
                # to all): the verdict compares these across ranks.
                # A dense copy: contiguous() keeps a one-element view's stride.
                dense = torch.empty(got.shape, dtype=got.dtype).copy_(got)
                record["digest"] = zlib.crc32(dense.view(torch.uint8).numpy())
                return check_allreduce(job, call, got)

            return Pending(record, work.wait, check, work)
        if call.kind in ("reduce_scatter", "all_gather"):
            return self._sharded(call, record, bad)
        if call.kind == "broadcast":
            want = _broadcast_values(job, call)
            tensor = want.clone() if rank == call.src else torch.zeros(call.numel)
            work = dist.broadcast(tensor, src=call.src, group=group, async_op=True)
            what = call.describe()

            def check() -> str | None:
                return None if torch.equal(tensor, want) else f"{what}: wrong values"

            return Pending(record, work.wait, check, work)
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

    def _sharded(self, call: Call, record: dict[str, Any], bad: str) -> Pending:
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
            return Pending(record, work.wait, lambda: None, work)
        issued = issue(form, key, call.numel + (1 if bad == "size" else 0), group=group)
        check = issued.check if not bad and self.name == "fairring" else (lambda: None)
        return Pending(record, issued.wait, check, issued.work)
