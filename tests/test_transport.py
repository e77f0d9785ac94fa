"""The transport between ranks of one machine when the kernel refuses memory reads.

Ranks of a machine copy message bodies straight out of each other's memory
(process_vm_readv), after a probe at start-up shows the kernel allows it; where it
does not (a container without CAP_SYS_PTRACE under Docker's default seccomp profile, a
Yama ptrace policy, non-dumpable processes), bodies must go through the socket, and
the results must be the same.

Here both ranks of a 1x2 job drop CAP_SYS_PTRACE and make themselves non-dumpable,
which makes the kernel refuse the read (checked independently with process_vm_readv
through ctypes: EPERM). Then a new fairring group starts, and allreduces on both sides
of the 64 KiB size where bodies switch to memory reads must be exact.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import launch

CAP_SYS_PTRACE = 19
PR_SET_DUMPABLE = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SIZES = (0, 1, 1000, 16_383, 16_384, 16_385, 100_003, 1_000_000)  # float32: 64 KiB = 16384


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _forbid_memory_reads() -> None:
    """Drop CAP_SYS_PTRACE and become non-dumpable: a peer of the same user may no
    longer read this process's memory, nor this process a peer's."""
    libc = _libc()
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    mask = ~(1 << CAP_SYS_PTRACE) & 0xFFFFFFFF
    data[0].effective &= mask
    data[0].permitted &= mask
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")


def _memory_read_errno(pid: int) -> int:
    """errno of reading 8 bytes at a bogus address of ``pid``: EPERM if the kernel
    refuses, EFAULT if it would have allowed a read of a real address."""
    libc = _libc()
    buf = ctypes.create_string_buffer(8)
    local = _IoVec(ctypes.cast(buf, ctypes.c_void_p), 8)
    remote = _IoVec(ctypes.c_void_p(0x1000), 8)
    n = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return 0 if n >= 0 else ctypes.get_errno()


def _refused_memory_job(rank: int, world: int) -> dict[str, Any]:
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    before = _memory_read_errno(pids[1 - rank])
    _forbid_memory_reads()
    dist.barrier()  # both have dropped it
    after = _memory_read_errno(pids[1 - rank])
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=30))
    wrong = []
    for n in SIZES:
        for round_ in range(3):
            t = torch.arange(n, dtype=torch.float32) * (rank + 1) + round_
            dist.all_reduce(t, group=group)
            expected = torch.arange(n, dtype=torch.float32) * 3 + 2 * round_
            if not torch.equal(t, expected):
                wrong.append(f"{n} elements, round {round_}")
    return {"before": before, "after": after, "wrong": wrong}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to show the refusal (CI runs as root)")
def test_same_machine_bodies_go_through_the_socket_when_memory_reads_are_refused() -> None:
    outcomes = launch(_refused_memory_job, 2, ["m0", "m0"], timeout_s=120)
    bad = [o.describe() for o in outcomes if not o.ok]
    assert not bad, "\n".join(bad)
    for o in outcomes:
        v = o.value
        # The kernel allowed it before and refuses it now: the fallback is what ran.
        assert v["before"] == errno.EFAULT, f"rank {o.rank}: before: {os.strerror(v['before'])}"
        assert v["after"] == errno.EPERM, f"rank {o.rank}: after: {os.strerror(v['after'])}"
        assert not v["wrong"], f"rank {o.rank}: wrong results: {v['wrong']}"
