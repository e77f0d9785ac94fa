"""FAIRRING_RAIL_CONGESTION: the congestion control of the rail sockets a rank sends to
several machines on in turn (3 machines and more).

Under BBR (this host's default) the writer's rotation over those sockets left a 300 Mbit/s
link half idle at 4 x 1 (bench/results/details.md, "Rail sockets and BBR"), so they use
Reno unless told otherwise. Each rank reads the algorithm of every TCP socket it holds
(getsockopt TCP_CONGESTION on a duplicate of each descriptor), so the check is the
kernel's, not the engine's own account: with 3 machines, the 2 tracks to each of the 2
other machines are Reno and nothing else is; with 2 machines (one rail peer, no
rotation) or `system`, none is changed.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import SHAPES, fairring_env, run_ranks

from fairring_pg import congestion
from fairring_pg.config import Config

LANES = 2  # src/transport/wire.h kNumLanes


def _system_default() -> str:
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


def _tcp_algorithms() -> list[str]:
    """The congestion control of each connected TCP socket this process holds."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            dup = os.dup(int(fd))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor)
        s = socket.socket(fileno=dup)
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                s.getpeername()
            except OSError:
                continue  # a listener
            raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
            found.append(raw.split(b"\0", 1)[0].decode())
        finally:
            s.close()  # the duplicate only
    return found


def _job(rank: int, world_size: int) -> dict[str, Any]:
    # Rank r's values are 2**r * (1 + i / 1024): the sum is exact in float64.
    numel = 40_000
    x = torch.arange(numel, dtype=torch.float64) / 1024 + 1
    t = x * 2.0**rank
    dist.all_reduce(t)
    expected = x * float(2**world_size - 1)
    return {"exact": bool(torch.equal(t, expected)), "algorithms": _tcp_algorithms()}


def _run(shape: str, **env: str) -> list[dict[str, Any]]:
    machines = SHAPES[shape]
    results = run_ranks(
        _job,
        len(machines),
        machines,
        env=fairring_env(FAIRRING_CPU_ALLREDUCE="engine", **env),
    )
    assert all(r["exact"] for r in results)
    return results


@pytest.fixture(scope="module")
def other_than_system() -> str:
    if _system_default() == "reno":
        pytest.skip("the system's congestion control is Reno: nothing to tell them apart by")
    return "reno"


def test_three_machines_send_on_reno(other_than_system: str) -> None:
    for result in _run("3x1"):
        assert result["algorithms"].count(other_than_system) == LANES * 2, result


def test_two_machines_and_system_keep_the_system_s(other_than_system: str) -> None:
    for result in _run("2x2") + _run("3x1", FAIRRING_RAIL_CONGESTION="system"):
        assert other_than_system not in result["algorithms"], result
        assert result["algorithms"], "no TCP socket found: the check would see nothing"


def test_a_name_the_kernel_does_not_have_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    words = {
        "tcp_available_congestion_control": ["reno", "cubic", "bbr"],
        "tcp_allowed_congestion_control": ["reno", "bbr"],
    }
    monkeypatch.setattr(congestion, "sysctl_words", words.get)
    with pytest.raises(ValueError, match=r"FAIRRING_RAIL_CONGESTION='vegas'.*reno, cubic, bbr"):
        Config.from_env({"FAIRRING_RAIL_CONGESTION": "vegas"})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match=r"'cubic' is not allowed.*CAP_NET_ADMIN.*reno, bbr"):
        Config.from_env({"FAIRRING_RAIL_CONGESTION": "cubic"})
    assert Config.from_env({"FAIRRING_RAIL_CONGESTION": " BBR "}).rail_congestion == "bbr"
    assert Config.from_env({"FAIRRING_RAIL_CONGESTION": "system"}).rail_congestion == "system"
    assert Config.from_env({}).rail_congestion == "reno"
