"""One rank of a random program (tests/cuda_fuzz_programs.py) on the stream vehicle, or
a GPU (tests/cuda_fuzz_device.py): on fairring's CUDA path (``mode="fairring"``) or on
the reference alone (``mode="stand_in"``: the NCCL stand-in, what ``backend="nccl"``
would do; NCCL itself on a GPU), so that the two outcomes can be compared
(scripts/cuda_fuzz.py).

The outcome is plain data: for each op, the result tensors as CPU tensors, or the error
it raised (type and message), and the races the vehicle's Ledger saw. An op that raises
on the reference is expected to raise on fairring too; every other op's values must be
the same bits.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import cuda_fuzz_device
import torch
import torch.distributed as dist
from cuda_fuzz_programs import FLOATS, Op, Program, key

# The tensors' device: the vehicle's, or "cuda" (set by run_program).
DEVICE = "vehicle"
POLL_LIMIT_S = 60.0


def values(op: Op, rank: int, seed: int, n: int, tensor: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input for ``op`` (a CPU tensor of ``n`` elements): exact in any
    order of reduction for op.reduce over up to 6 ranks, also when doubled (then)."""
    dtype = getattr(torch, op.dtype)
    gen = torch.Generator().manual_seed(key("values", seed, rank, op.index, tensor))
    if op.reduce == "PRODUCT":
        pool = [1, 2] if op.dtype == "uint8" else [-1, 1, 2]
        picks = torch.randint(0, len(pool), (n,), generator=gen)
        return torch.tensor(pool, dtype=torch.float64)[picks].to(dtype)
    if op.reduce == "AVG":
        k = torch.randint(-4, 5, (n,), generator=gen).to(torch.float64)
        return (k * 6 * 0.5 ** (op.index % 2)).to(dtype)  # divisible by any world <= 6
    lo, hi = (0, 17) if op.dtype == "uint8" else (-8, 9)
    k = torch.randint(lo, hi, (n,), generator=gen).to(torch.float64)
    if op.dtype in FLOATS:
        k = k * 0.5 ** (op.index % 3)
    return k.to(dtype)


def reduce_op(name: str) -> Any:
    return getattr(dist.ReduceOp, name)


class Runner:
    """Issues and resolves one rank's steps; ``state[i]`` holds what op i needs later."""

    def __init__(self, rank: int, world: int, program: Program, v: Any) -> None:
        self.rank, self.world, self.program, self.v = rank, world, program, v
        self.plan = program.ranks[rank]
        self.state: dict[int, dict[str, Any]] = {}
        self.outcome: dict[int, Any] = {}
        self.main = v.current_stream()
        self.reader = v.new_stream("fuzz reader")
        self.side = v.new_stream("fuzz side stream")

    def on(self, op: Op, n: int, tensor: int = 0) -> torch.Tensor:
        """The input, written on the device by a kernel on the current stream."""
        t = values(op, self.rank, self.program.seed, n, tensor).to(DEVICE)
        return t.mul_(1)

    # ------------------------------------------------------------------ issue
    def issue(self, op: Op) -> None:
        issue = getattr(self, f"issue_{op.kind}")
        st: dict[str, Any] = {"works": [], "reads": [], "stream": self.main}
        self.state[op.index] = st
        try:
            issue(op, st)
        except Exception as exc:  # noqa: BLE001 - an outcome, compared with the reference's
            st["error"] = exc
        if op.index in self.plan.drop_work:
            st["works"] = []

    def keep(self, st: dict[str, Any], work: Any) -> None:
        if work is not None:
            st["works"].append(work)

    def issue_allreduce(self, op: Op, st: dict[str, Any], async_op: bool = True) -> None:
        if op.reuse is not None:
            t = self.state[op.reuse]["tensor"]
        else:
            t = self.on(op, op.sizes[0])
        st["tensor"] = t
        st["reads"] = [t]
        self.keep(st, dist.all_reduce(t, op=reduce_op(op.reduce), async_op=async_op))

    def issue_allreduce_sync(self, op: Op, st: dict[str, Any]) -> None:
        self.issue_allreduce(op, st, async_op=False)

    def issue_coalesced(self, op: Op, st: dict[str, Any]) -> None:
        tensors = [self.on(op, n, j) for j, n in enumerate(op.sizes)]
        st["reads"] = tensors
        if op.variant == "manager":
            with dist._coalescing_manager(async_ops=True) as cm:
                for t in tensors:
                    dist.all_reduce(t, op=reduce_op(op.reduce), async_op=True)
            st["works"] = list(cm.works)
            return
        opts = dist.AllreduceCoalescedOptions()
        opts.reduceOp = reduce_op(op.reduce)
        group = dist.distributed_c10d._get_default_group()
        self.keep(st, group.allreduce_coalesced(tensors, opts))

    def issue_allgather_list_even(self, op: Op, st: dict[str, Any]) -> None:
        outs = [
            torch.full((n,), 7, dtype=getattr(torch, op.dtype), device=DEVICE) for n in op.sizes
        ]
        st["reads"] = outs
        inp = self.on(op, op.sizes[self.rank])
        st["inputs"] = [inp]
        self.keep(st, dist.all_gather(outs, inp, async_op=True))

    issue_allgather_list_uneven = issue_allgather_list_even

    def issue_allgather_tensor(self, op: Op, st: dict[str, Any]) -> None:
        out = torch.full((sum(op.sizes),), 7, dtype=getattr(torch, op.dtype), device=DEVICE)
        st["reads"] = [out]
        inp = self.on(op, op.sizes[self.rank])
        st["inputs"] = [inp]
        self.keep(st, dist.all_gather_into_tensor(out, inp, async_op=True))

    def issue_reduce_scatter_list(self, op: Op, st: dict[str, Any]) -> None:
        parts = [self.on(op, n, j) for j, n in enumerate(op.sizes)]
        out = torch.full((op.sizes[self.rank],), 7, dtype=getattr(torch, op.dtype), device=DEVICE)
        st["reads"], st["inputs"] = [out], parts
        work = dist.reduce_scatter(out, parts, op=reduce_op(op.reduce), async_op=True)
        self.keep(st, work)

    def issue_reduce_scatter_tensor(self, op: Op, st: dict[str, Any]) -> None:
        inp = self.on(op, sum(op.sizes))
        out = torch.full((op.sizes[self.rank],), 7, dtype=getattr(torch, op.dtype), device=DEVICE)
        st["reads"], st["inputs"] = [out], [inp]
        work = dist.reduce_scatter_tensor(out, inp, op=reduce_op(op.reduce), async_op=True)
        self.keep(st, work)

    def issue_broadcast(self, op: Op, st: dict[str, Any]) -> None:
        t = self.on(op, op.sizes[0])
        st["reads"] = [t]
        self.keep(st, dist.broadcast(t, src=op.src, async_op=True))

    def issue_send_recv(self, op: Op, st: dict[str, Any]) -> None:
        pair = self.rank - self.rank % 2
        if pair + 1 >= self.world:
            return  # odd world: the last rank sits this one out
        t = self.on(op, op.sizes[0])
        st["reads"] = [t]
        blocking = op.variant == "blocking"
        if self.rank == pair:
            self.keep(st, (dist.send if blocking else dist.isend)(t, dst=pair + 1))
        else:
            t.fill_(-3)
            self.keep(st, (dist.recv if blocking else dist.irecv)(t, src=pair))
        if blocking:
            st["works"] = []

    def issue_batch_p2p(self, op: Op, st: dict[str, Any]) -> None:
        send = self.on(op, op.sizes[0])
        recv = torch.full_like(send, 5)
        st["reads"] = [recv]
        st["inputs"] = [send]
        ops = [
            dist.P2POp(dist.isend, send, (self.rank + 1) % self.world),
            dist.P2POp(dist.irecv, recv, (self.rank - 1) % self.world),
        ]
        st["works"] = list(dist.batch_isend_irecv(ops))

    def _splits(self, op: Op) -> tuple[list[int], list[int]]:
        sends = list(op.splits[self.rank])
        gets = [op.splits[j][self.rank] for j in range(self.world)]
        return sends, gets

    def issue_all_to_all_single(self, op: Op, st: dict[str, Any]) -> None:
        sends, gets = self._splits(op)
        inp = self.on(op, sum(sends))
        out = torch.full((sum(gets),), 7, dtype=inp.dtype, device=DEVICE)
        st["reads"], st["inputs"] = [out], [inp]
        if op.variant == "nosplits":
            work = dist.all_to_all_single(out, inp, async_op=True)
        else:
            work = dist.all_to_all_single(out, inp, gets, sends, async_op=True)
        self.keep(st, work)

    def issue_all_to_all(self, op: Op, st: dict[str, Any]) -> None:
        sends, gets = self._splits(op)
        inputs = [self.on(op, n, j) for j, n in enumerate(sends)]
        outs = [torch.full((n,), 7, dtype=getattr(torch, op.dtype), device=DEVICE) for n in gets]
        st["reads"], st["inputs"] = outs, inputs
        self.keep(st, dist.all_to_all(outs, inputs, async_op=True))

    def issue_barrier(self, op: Op, st: dict[str, Any]) -> None:
        barrier()

    def issue_temporary(self, op: Op, st: dict[str, Any]) -> None:
        n = op.sizes[0]
        rows = n * self.world if op.variant == "reduce_scatter" else n
        base = torch.stack([values(op, self.rank, self.program.seed, rows), torch.zeros(rows)], 1)
        base = base.to(getattr(torch, op.dtype)).to(DEVICE)
        if op.variant == "gather":
            out = torch.full((n * self.world,), 7, dtype=base.dtype, device=DEVICE)
            work = dist.all_gather_into_tensor(out, base[:, 0].contiguous(), async_op=True)
            st["reads"] = [out]
        elif op.variant == "reduce_scatter":
            out = torch.full((n,), 7, dtype=base.dtype, device=DEVICE)
            work = dist.reduce_scatter_tensor(
                out, base[:, 0].contiguous(), op=reduce_op(op.reduce), async_op=True
            )
            st["reads"] = [out]
        else:  # the result is the temporary's: nothing to read, only races to see
            work = dist.all_reduce(base[:, 0].contiguous(), op=reduce_op(op.reduce), async_op=True)
        self.keep(st, work)
        del base
        gc.collect()
        torch.full((max(n, 1),), 3, dtype=torch.float64, device=DEVICE).fill_(-1.0)

    def issue_side_stream(self, op: Op, st: dict[str, Any]) -> None:
        st["stream"] = self.side
        with self.current(self.side):
            t = self.on(op, op.sizes[0])
            st["reads"] = [t]
            self.keep(st, dist.all_reduce(t, op=reduce_op(op.reduce), async_op=True))

    def issue_then(self, op: Op, st: dict[str, Any]) -> None:
        t = self.on(op, op.sizes[0])
        work = dist.all_reduce(t, op=reduce_op(op.reduce), async_op=True)
        st["chained"] = work.get_future().then(lambda f: f.value()[0] * 2)

    def issue_ddp(self, op: Op, st: dict[str, Any]) -> None:
        st["reads"] = ddp_step(self.rank, self.world, self.program.seed, op)

    issue_ddp_hook = issue_ddp

    # ------------------------------------------------------------------ resolve
    def resolve(self, op: Op) -> None:
        st = self.state[op.index]
        style = self.plan.styles[op.index]
        if "error" in st:
            self.outcome[op.index] = ("error", type(st["error"]).__name__, str(st["error"]))
            return
        try:
            with self.current(st["stream"]):
                got = self.wait_and_read(op, st, style)
        except Exception as exc:  # noqa: BLE001 - an outcome, compared with the reference's
            self.outcome[op.index] = ("error", type(exc).__name__, str(exc))
            return
        finally:
            st.pop("inputs", None)  # the caller's inputs live until it waited
        self.outcome[op.index] = ("ok", [] if op.index in self.program.consumed else got)

    def wait_and_read(self, op: Op, st: dict[str, Any], style: str) -> list[torch.Tensor]:
        if style == "then":
            return [(st["chained"].wait() + 0).cpu()]
        for work in st["works"]:
            if style == "work":
                work.wait()
            elif style == "future":
                work.get_future().wait()
            elif style == "synchronize":
                work.synchronize()
            elif style == "poll":
                poll(work)
        if style == "device_sync":
            self.v.synchronize()
        if op.index in self.program.consumed:
            return []
        if style in ("poll", "device_sync", "barrier"):
            # The host knows the op ended: a stream that never waited may read.
            with self.current(self.reader):
                return [(t * 1).cpu() for t in st["reads"]]
        return [(t * 1).cpu() for t in st["reads"]]

    def current(self, stream: Any) -> _Current:
        return _Current(self.v, stream)


class _Current:
    def __init__(self, v: Any, stream: Any) -> None:
        self.v, self.stream, self.previous = v, stream, 0

    def __enter__(self) -> None:
        self.previous = self.v.current_stream()
        self.v.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        self.v.set_stream(self.previous)


def poll(work: Any) -> None:
    deadline = time.monotonic() + POLL_LIMIT_S
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"is_completed() still False after {POLL_LIMIT_S} s")


def barrier() -> None:
    """A barrier on the group's device backend (ProcessGroupNCCL's, which waits for the
    device), not on the CPU one (the stand-in's default group is Gloo's)."""
    opts = dist.BarrierOptions()
    opts.device = torch.device(DEVICE, 0)
    dist.distributed_c10d._get_default_group().barrier(opts).wait()


def ddp_step(rank: int, world: int, seed: int, op: Op) -> list[torch.Tensor]:
    """One step of a tiny DDP model on vehicle tensors (a comm hook for ``ddp_hook``):
    integer weights, inputs world x small integers, so that every gradient, divided by
    the world size, is an exact integer; returns the gradients, read after backward."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    inputs, outputs = op.sizes
    gen = torch.Generator().manual_seed(key("ddp", seed, op.index))
    model = torch.nn.Linear(inputs, outputs)
    with torch.no_grad():
        model.weight.copy_(torch.randint(-3, 4, model.weight.shape, generator=gen).float())
        model.bias.copy_(torch.randint(-3, 4, model.bias.shape, generator=gen).float())
    ddp = DistributedDataParallel(model.to(DEVICE))
    if op.kind == "ddp_hook":
        ddp.register_comm_hook(None, getattr(default_hooks, op.variant))
    x_gen = torch.Generator().manual_seed(key("ddp-x", seed, rank, op.index))
    x = (torch.randint(-3, 4, (2, inputs), generator=x_gen) * world).float().to(DEVICE)
    ddp(x).sum().backward()
    return [p.grad for p in ddp.parameters() if p.grad is not None]


def run_program(
    rank: int,
    world: int,
    program: Program,
    mode: str,
    plant: int | None = None,
    device: str = "vehicle",
) -> dict[str, Any]:
    """Run ``program`` on this rank, on fairring (``mode="fairring"``) or the reference
    alone (``"stand_in"``: the NCCL stand-in on the vehicle, NCCL on a GPU); ``plant``:
    an op whose first result fairring's run perturbs (tests show that the verdict fails).
    Returns {"ops": {index: ("ok", [cpu tensors]) | ("error", type, message)},
    "races": [...]}."""
    global DEVICE
    v = cuda_fuzz_device.for_name(device)
    DEVICE = v.name
    try:
        v.init(mode)
        runner = Runner(rank, world, program, v)
        by_index = {op.index: op for op in program.ops}
        for step in program.ranks[rank].steps:
            op = by_index[step.op]
            if step.action == "issue":
                runner.issue(op)
            else:
                runner.resolve(op)
        runner.state.clear()
        gc.collect()
        races = v.races()
        outcome = runner.outcome
        if plant is not None and mode == "fairring":
            got = outcome.get(plant)
            if got is not None and got[0] == "ok" and got[1] and got[1][0].numel():
                got[1][0].view(-1)[0] += 1
        return {"ops": outcome, "races": races}
    finally:
        v.finish()
