"""The test-only native module (tests/native/, ``fairring_pg_testing``), built from this
checkout's sources whether fairring_pg is installed from it (editable) or not (the
compatibility check installs it regularly)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

NATIVE = Path(__file__).resolve().parent / "native"


def load() -> ModuleType:
    from fairring_pg._build import load_test_extension

    return load_test_extension(NATIVE)
