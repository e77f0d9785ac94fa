"""Registration of the ``fairring`` backend, safe to run while torch is initialising.

torch calls :func:`register` from ``torch/__init__.py`` (``_import_device_backends``)
for every program in the environment, after ``torch.distributed`` has been imported
but before ``import torch`` has finished. So this module imports nothing heavy at top
level, registers a creator that imports the real backend only when a process group is
made, and swallows every error: an exception here would make ``import torch`` fail.
"""

from __future__ import annotations

import warnings
from typing import Any

BACKEND_NAME = "fairring"


def _create(dist_backend_opts: Any, backend_options: Any) -> Any:
    from fairring_pg.backend import create_backend

    return create_backend(dist_backend_opts, backend_options)


def register() -> None:
    """Register ``fairring`` with torch.distributed; idempotent, never raises."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return
        backend = dist.Backend
        if BACKEND_NAME.upper() in getattr(backend, "_plugins", {}):
            return
        backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    except Exception as exc:  # noqa: BLE001 - must not break `import torch`
        warnings.warn(
            f"fairring_pg: could not register the '{BACKEND_NAME}' torch.distributed backend "
            f"({type(exc).__name__}: {exc}); `import fairring_pg` retries",
            RuntimeWarning,
            stacklevel=2,
        )
