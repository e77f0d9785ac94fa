"""FAIRRING_RAIL_CONGESTION's value: a TCP congestion control this kernel has and lets
this process choose (docs/design.md, "Transport": rail sockets)."""

from __future__ import annotations

import os
from pathlib import Path


def sysctl_words(name: str) -> list[str] | None:
    try:
        return (Path("/proc/sys/net/ipv4") / name).read_text().split()
    except OSError:
        return None


def parse(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if value == "system":
        return value
    available = sysctl_words("tcp_available_congestion_control")
    if available is None:
        raise ValueError(
            f"{name}={raw!r}: this machine does not list its TCP congestion controls "
            "(/proc/sys/net/ipv4/tcp_available_congestion_control): expected 'system'"
        )
    if value not in available:
        raise ValueError(
            f"{name}={raw!r} is not a TCP congestion control of this machine: expected "
            f"'system' or one of {', '.join(available)}"
        )
    allowed = sysctl_words("tcp_allowed_congestion_control") or []
    if value not in allowed and os.geteuid() != 0:
        raise ValueError(
            f"{name}={raw!r} is not allowed to processes without CAP_NET_ADMIN "
            f"(net.ipv4.tcp_allowed_congestion_control): expected 'system' or one of "
            f"{', '.join(allowed)}"
        )
    return value
