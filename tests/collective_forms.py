"""The collectives fairring's CPU engine runs, in every form a program can call them, with
inputs from (key, rank) and the exact result each rank must get: shared by the order
tests (test_kind_order.py) and the soak (scripts/soak.py).

Every form is issued asynchronously and returns an ``Issued``: ``wait()`` waits for it,
``check()`` (after a wait) says what is wrong with the result, or None. Inputs are int64
SUMs of values up to 2**40 in magnitude: exact in any order of reduction, wide enough
that a missing, doubled or misplaced term shows in the high bits, and distinct per
element, rank and key, so that a result from another operation never passes.
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from values import compare_exact

# Allreduce, reduce-scatter and all-gather, each as tensor, list and coalesced calls.
FORMS = (
    "allreduce",
    "allreduce_coalesced",
    "reduce_scatter",
    "reduce_scatter_list",
    "reduce_scatter_coalesced",
    "all_gather",
    "all_gather_list",
    "all_gather_coalesced",
)
# The first tensor of a coalesced call has n elements (per rank, for the sharded kinds),
# the second this many.
SECOND_NUMEL = 13
_SPAN = 2**40
# torch 2.14 renamed the tensor forms (the old names warn); 2.13 has both.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def values(key: str, rank: int, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}/{rank}".encode()))
    return torch.randint(-_SPAN, _SPAN, (numel,), generator=gen, dtype=torch.int64)


@dataclasses.dataclass
class Issued:
    """One collective in flight on this rank."""

    form: str
    key: str
    wait: Callable[[], None]
    results: list[torch.Tensor]
    expected: list[torch.Tensor]
    work: Any = None  # the Work, where the call returns one

    def check(self) -> str | None:
        for i, (got, want) in enumerate(zip(self.results, self.expected, strict=True)):
            if err := compare_exact(got, want, f"{self.form} {self.key}: output {i}"):
                return err
        return None


def _summed(key: str, world: int, numel: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    inputs = [values(key, r, numel) for r in range(world)]
    return inputs, torch.stack(inputs).sum(0)


def issue(form: str, key: str, numel: int, group: Any = None) -> Issued:
    """Issues `form` on every rank's inputs for (key, numel): numel elements for an
    allreduce, per rank for a reduce-scatter's output and an all-gather's input."""
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if form.startswith("allreduce"):
        sizes = [numel] if form == "allreduce" else [numel, SECOND_NUMEL]
        tensors, expected = [], []
        for i, n in enumerate(sizes):
            inputs, total = _summed(f"{key}/{i}", world, n)
            tensors.append(inputs[rank].clone())
            expected.append(total)
        if form == "allreduce":
            work = dist.all_reduce(tensors[0], group=group, async_op=True)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # deprecated, still routed here
                work = dist.all_reduce_coalesced(tensors, group=group, async_op=True)
        return Issued(form, key, work.wait, tensors, expected, work)
    if form.startswith("reduce_scatter"):
        sizes = [numel] if form != "reduce_scatter_coalesced" else [numel, SECOND_NUMEL]
        ins, outs, expected = [], [], []
        for i, n in enumerate(sizes):
            inputs, total = _summed(f"{key}/{i}", world, world * n)
            ins.append(inputs[rank].clone())
            outs.append(torch.full((n,), -1, dtype=torch.int64))
            expected.append(total[rank * n : (rank + 1) * n])
        if form == "reduce_scatter":
            work = _reduce_scatter(outs[0], ins[0], group=group, async_op=True)
        elif form == "reduce_scatter_list":
            parts = list(ins[0].chunk(world))
            work = dist.reduce_scatter(outs[0], parts, group=group, async_op=True)
        else:
            with dist._coalescing_manager(group=group, async_ops=True) as work:
                for o, i in zip(outs, ins, strict=True):
                    _reduce_scatter(o, i, group=group)
        return Issued(form, key, work.wait, outs, expected, work)
    if form.startswith("all_gather"):
        sizes = [numel] if form != "all_gather_coalesced" else [numel, SECOND_NUMEL]
        ins, outs, expected = [], [], []
        for i, n in enumerate(sizes):
            parts = [values(f"{key}/{i}", r, n) for r in range(world)]
            ins.append(parts[rank].clone())
            outs.append(torch.full((world * n,), -1, dtype=torch.int64))
            expected.append(torch.cat(parts))
        if form == "all_gather":
            work = _all_gather(outs[0], ins[0], group=group, async_op=True)
        elif form == "all_gather_list":
            pieces = list(outs[0].chunk(world))
            work = dist.all_gather(pieces, ins[0], group=group, async_op=True)
        else:
            with dist._coalescing_manager(group=group, async_ops=True) as work:
                for o, i in zip(outs, ins, strict=True):
                    _all_gather(o, i, group=group)
        return Issued(form, key, work.wait, outs, expected, work)
    raise ValueError(form)
