"""References computed on Gloo without Gloo's own threads running Python.

Gloo completes an allreduce's future on one of its worker threads, so a comm hook's
``then()`` callbacks (PowerSGD's, which issue and wait on nested allreduces) run there,
concurrently across buckets, and may still be touching Python objects when the main
thread finishes: a reference run could hang, or abort at interpreter exit
("terminate called without an active exception"), for reasons that are Gloo's, not
fairring's. ``inline_collectives()`` makes every async ``dist.all_reduce`` wait before
it returns and hand back an already completed future: callbacks then run inline, on
the calling thread, in program order, and the sums are still Gloo's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _DoneWork:
    """What an async allreduce returns once it has completed: its future, done."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        self._future.set_result([tensor])

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future

    def result(self) -> list[torch.Tensor]:
        return self._future.value()


def inline_collectives() -> None:
    """In this (reference) process, from now on: async allreduces complete before they
    return, so that no Python callback ever runs on a backend thread."""
    blocking = dist.all_reduce
    if getattr(blocking, "_inline_reference", False):
        return

    def all_reduce(
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        blocking(tensor, op=op, group=group, async_op=False)
        return _DoneWork(tensor) if async_op else None

    all_reduce._inline_reference = True  # type: ignore[attr-defined]
    dist.all_reduce = all_reduce
