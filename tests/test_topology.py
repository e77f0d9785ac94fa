"""Machines, local ranks and the irregular fallback, from machine ids alone."""

from __future__ import annotations

import socket
import threading
import warnings
from datetime import timedelta

import pytest
import torch.distributed as dist

from fairring_pg.topology import Topology, build_topology, discover


def _all(ids: list[str]) -> list[Topology]:
    hostnames = [f"host-{i}" for i in ids]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [build_topology(r, ids, hostnames) for r in range(len(ids))]


def test_single_rank() -> None:
    (t,) = _all(["a"])
    assert (t.num_machines, t.local_size, t.machine, t.local_rank, t.regular) == (1, 1, 0, 0, True)
    assert t.machine_of == [0] and t.rail_peers() == [0]


def test_single_machine() -> None:
    tops = _all(["a"] * 4)
    for r, t in enumerate(tops):
        assert (t.num_machines, t.local_size, t.machine, t.local_rank) == (1, 4, 0, r)
        assert t.machine_of == [0, 0, 0, 0] and t.regular


def test_one_rank_per_machine() -> None:
    tops = _all(["a", "b", "c"])
    for r, t in enumerate(tops):
        assert (t.num_machines, t.local_size, t.machine, t.local_rank) == (3, 1, r, 0)
        assert t.rail_peers() == [0, 1, 2]


def test_contiguous_blocks() -> None:
    tops = _all(["a", "a", "b", "b"])
    assert tops[0].machine_of == [0, 0, 1, 1]
    assert [(t.machine, t.local_rank) for t in tops] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert tops[1].rail_peers() == [1, 3]
    assert tops[2].ranks_on_machine(1) == [2, 3]


def test_interleaved_ranks() -> None:
    tops = _all(["a", "b", "a", "b"])
    assert tops[0].machine_of == [0, 1, 0, 1]
    assert [(t.machine, t.local_rank) for t in tops] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert tops[0].rail_peers() == [0, 1]
    assert tops[3].rail_peers() == [2, 3]
    assert all(t.num_machines == 2 and t.local_size == 2 and t.regular for t in tops)


def test_machines_numbered_by_smallest_rank() -> None:
    # Names do not matter, only where each machine first appears.
    tops = _all(["z", "y", "x", "z", "y", "x"])
    assert tops[0].machine_of == [0, 1, 2, 0, 1, 2]
    assert [t.local_rank for t in tops] == [0, 0, 0, 1, 1, 1]


def test_irregular_fallback_warns() -> None:
    ids = ["a", "a", "a", "b"]
    hostnames = ["h0", "h0", "h0", "h1"]
    with pytest.warns(RuntimeWarning, match=r"different numbers of ranks \('a': 3, 'b': 1\)"):
        t = build_topology(1, ids, hostnames)
    assert t.machine_of == [0, 1, 2, 3]
    assert (t.num_machines, t.local_size, t.machine, t.local_rank) == (4, 1, 1, 0)
    assert t.regular is False
    assert t.hostnames == hostnames


def test_regular_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_topology(0, ["a", "b"], ["a", "b"])


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        build_topology(2, ["a", "b"], ["a", "b"])
    with pytest.raises(ValueError):
        build_topology(0, ["a", "b"], ["a"])


def _discover_all(machine_ids: list[str | None]) -> list[Topology | BaseException]:
    store = dist.HashStore()
    size = len(machine_ids)
    out: list[Topology | BaseException] = [RuntimeError("not run")] * size

    def rank_main(rank: int) -> None:
        try:
            out[rank] = discover(store, rank, size, machine_ids[rank], timedelta(seconds=10))
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_discover_by_hostname() -> None:
    tops = _discover_all([None, None, None])
    host = socket.gethostname()
    for r, t in enumerate(tops):
        assert isinstance(t, Topology)
        assert t.hostnames == [host] * 3
        assert (t.num_machines, t.local_size, t.local_rank) == (1, 3, r)


def test_discover_machine_id_overrides_hostname() -> None:
    tops = _discover_all(["m0", "m1", "m0", "m1"])
    for r, t in enumerate(tops):
        assert isinstance(t, Topology)
        assert t.machine_of == [0, 1, 0, 1]
        assert (t.machine, t.local_rank) == (r % 2, r // 2)
        assert t.hostnames == [socket.gethostname()] * 4


def test_discover_times_out_clearly() -> None:
    store = dist.HashStore()
    # The rank that never came is named as every failure message names a rank.
    with pytest.raises(RuntimeError, match=r"machine id: rank 1 never wrote it"):
        discover(store, 0, 2, "m0", timedelta(milliseconds=200))
