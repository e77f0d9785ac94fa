"""The core's test-only fault points (src/faults/fault_points.h), armed from a rank
process: a named place in the transport or the engine waits, throws or closes, so that
an interleaving load produces now and then happens every time."""

from __future__ import annotations

from typing import Any


def _controls() -> Any:
    import native_module

    return native_module.load().faults


def arm(
    point: str, action: str = "delay", delay_ms: int = 0, times: int = 1, key: int = -1
) -> None:
    """Arm ``point`` for its next ``times`` uses matching ``key`` (a peer's rank, an
    operation's turn; -1: any): ``action`` is "delay" (``delay_ms``), "throw" or
    "close". A name that is not one of ``points()`` raises ValueError."""
    _controls().arm(point, action, delay_ms, times, key)


def disarm() -> None:
    _controls().disarm()


def uses(point: str) -> int:
    """How many times ``point`` fired in this process."""
    return int(_controls().uses(point))


def last_use(point: str) -> float:
    """When ``point`` last fired in this process (as time.time()); 0.0 where it never did."""
    return float(_controls().last_use(point))


def points() -> list[str]:
    """Every fault point the core has (src/faults/fault_points.h, kPoints)."""
    return list(_controls().points())
