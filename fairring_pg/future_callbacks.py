"""Marks the threads that are running a Python callback of a torch Future.

A callback attached with ``then()`` or ``add_done_callback()`` to a future that is
already complete runs at once on the attaching thread (c10's rule); otherwise it runs
where the future completes, for fairring's allreduces on its completion threads.
Which of the two happens is timing, and differs between ranks, yet the allreduces a
callback issues must take the same pipeline on every rank (docs/design.md,
"Completion order and comm hooks"). So every Python callback of a torch Future runs
with a per-thread mark set in the C++ core, which ``CpuAllreduce::run`` reads at no
cost: no interpreter lock, no look at the Python stack.

``install`` wraps ``torch._C.Future.then`` and ``add_done_callback`` (which
``torch.futures.Future`` and DDP's Python comm hooks go through) once per process, when
the first fairring group is created. The wrapped callback behaves as the original: same
argument, same result, same exceptions.
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
    """Wrap the callbacks of every torch Future attached from Python from now on, so that
    they run inside ``ext.enter_future_callback()`` / ``ext.exit_future_callback()``.
    Idempotent."""
    global _installed
    with _lock:
        if _installed:
            return
        future = torch._C.Future
        future.then = _wrapping(future.then, ext)
        future.add_done_callback = _wrapping(future.add_done_callback, ext)
        _installed = True


def _wrapping(method: Callable[..., Any], ext: Any) -> Callable[..., Any]:
    enter, leave = ext.enter_future_callback, ext.exit_future_callback

    @functools.wraps(method)
    def attach(self: Any, callback: Callable[[Any], Any]) -> Any:
        if not callable(callback):
            return method(self, callback)  # torch's own error

        @functools.wraps(callback)
        def marked(fut: Any) -> Any:
            enter()
            try:
                return callback(fut)
            finally:
                leave()

        return method(self, marked)

    return attach
