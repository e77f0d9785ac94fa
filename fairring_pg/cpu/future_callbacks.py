"""Marks the threads that are running a Python callback of one of fairring's futures.

A callback attached with ``then()`` or ``add_done_callback()`` to a future that is
already complete runs at once on the attaching thread (c10's rule); otherwise it runs
where the future completes, for fairring's allreduces on its completion threads.
Which of the two happens is timing, and differs between ranks, yet the allreduces a
callback issues must take the same pipeline on every rank (docs/design.md,
"Completion order and comm hooks"). So every Python callback of a fairring future runs
with a per-thread mark set in the C++ core, which ``CpuAllreduce::run`` reads at no
cost: no interpreter lock, no look at the Python stack.

Only fairring's futures are marked: those its collectives hand out and those made from
them in Python (``then()``, ``torch.futures.collect_all``), which the core keeps in a
registry of weak references. A callback of any other future (RPC's, a checkpointer's,
a user's) runs unmarked, and the collectives it issues are the program's own, ordered
as the program issues them, as on Gloo: marking those too would send them to the
callbacks' pipeline on one rank and to the program's on another wherever ranks issue a
collective from such a callback on some ranks and directly on others.

``install`` wraps ``torch._C.Future.then``, ``add_done_callback`` (which
``torch.futures.Future`` and DDP's Python comm hooks go through) and
``torch._C._collect_all`` once per process, when the first fairring group is created.
The wrapped callback behaves as the original: same argument, same result, same
exceptions.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

_lock = threading.Lock()
_installed = False


def install(ext: Any) -> None:
    """Wrap the callbacks attached from Python from now on to fairring's futures, so that
    they run inside ``ext.enter_future_callback()`` / ``ext.exit_future_callback()``.
    Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        future = torch._C.Future
        future.then = _wrapping(future.then, ext)
        future.add_done_callback = _wrapping(future.add_done_callback, ext)
        torch._C._collect_all = _collecting(torch._C._collect_all, ext)
        _installed = True


def _wrapping(method: Callable[..., Any], ext: Any) -> Callable[..., Any]:
    enter, leave = ext.enter_future_callback, ext.exit_future_callback

    @functools.wraps(method)
    def attach(self: Any, callback: Callable[[Any], Any]) -> Any:
        if not callable(callback) or not ext.is_fairring_future(self):
            return method(self, callback)  # not fairring's (or torch's own error)

        @functools.wraps(callback)
        def marked(fut: Any) -> Any:
            enter()
            try:
                return callback(fut)
            finally:
                leave()

        made = method(self, marked)
        if made is not None:  # then(): a future of the same lineage
            ext.adopt_future(made)
        return made

    return attach


def _collecting(collect_all: Callable[..., Any], ext: Any) -> Callable[..., Any]:
    @functools.wraps(collect_all)
    def collect(futures: Any) -> Any:
        made = collect_all(futures)
        if any(ext.is_fairring_future(f) for f in futures):
            ext.adopt_future(made)
        return made

    return collect
