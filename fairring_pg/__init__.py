"""fairring_pg: the ``fairring`` torch.distributed backend.

``import fairring_pg`` registers the backend; so does ``import torch`` alone, through the
``torch.backends`` entry point (see ``_autoload``). Registration is lazy: the C++
extension is compiled and loaded only when a process group is created.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

from fairring_pg._autoload import register

register()

__all__ = ["__version__", "create_backend", "register"]


def __getattr__(name: str) -> Any:
    # Deferred so that importing the package (which torch does while it initialises)
    # never pulls in the backend module or the extension builder.
    if name == "create_backend":
        from fairring_pg.backend import create_backend

        return create_backend
    raise AttributeError(f"module 'fairring_pg' has no attribute {name!r}")
