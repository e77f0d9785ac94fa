"""The transport: how a rank gets past a peer's gate, and what ranks of one machine do
when the kernel refuses memory reads.

A gate closes a connection without an answer only when it had no room (a storm of
strangers at start-up), so a rank must try again; a refusal comes with a verdict, and
the rank must fail at once saying why. Both are checked against a fake gate in this
process that a second FairringBackend (claiming rank 3 of a 2x2 job) connects to.

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
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from multiprocess import launch
from reliability_helpers import (
    HELLO_BYTES,
    HELLO_MAGIC,
    HELLO_RANK,
    HELLO_TOKEN,
    HELLO_TRACK,
    HELLO_VERSION,
    REPLY,
    REPLY_MAGIC,
    WIRE_VERSION,
    make_second_backend,
    redirect_store,
    second_backend,
)

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


# ---------------------------------------------------------------- getting past a gate

TOKEN = "ab" * 16


class _FakeGate:
    """Listens on 127.0.0.1, reads each connection's hello and answers it with
    ``answer(index)``: reply bytes, or None to close without a word."""

    def __init__(self, answer: Any) -> None:
        self.hellos: list[bytes] = []
        self._answer = answer
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self._kept: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self._server.getsockname()[1]}"

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            conn.settimeout(5)
            hello = b""
            while len(hello) < HELLO_BYTES and (chunk := conn.recv(HELLO_BYTES - len(hello))):
                hello += chunk
            reply = self._answer(len(self.hellos))
            self.hellos.append(hello)
            if reply is None:
                conn.close()
            else:
                conn.sendall(reply)
                self._kept.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for conn in self._kept:
            conn.close()
        self._server.close()


def _join_fake(answer: Any) -> tuple[str, float, list[bytes]]:
    gate = _FakeGate(answer)
    try:
        t0 = time.monotonic()
        ending = second_backend(redirect_store(lambda key: gate.url.encode()), 3, TOKEN, 3.0)
        return ending, time.monotonic() - t0, gate.hellos
    finally:
        gate.close()


def test_a_connection_closed_without_an_answer_is_tried_again() -> None:
    accepted = REPLY.pack(REPLY_MAGIC, 0, 0, 1)
    ending, _, hellos = _join_fake(lambda i: None if i == 0 else accepted)
    # Rank 3's peers are rank 2 (local) and rank 1 (rail), two tracks each: four
    # connections, the first one twice.
    assert len(hellos) == 5, f"{len(hellos)} hellos: {ending}"
    assert hellos[0] == hellos[1], "the second attempt did not repeat the first hello"
    # Past every gate, it waits for its peers to connect back, which a fake never does.
    assert "waiting for" in ending and "to connect" in ending, ending


def test_a_refusal_fails_at_once_naming_why() -> None:
    wrong_version = REPLY.pack(REPLY_MAGIC, 1, 0, 7)
    ending, seconds, hellos = _join_fake(lambda i: wrong_version)
    assert len(hellos) == 1, f"{len(hellos)} hellos: a refusal must not be retried"
    assert f"fairring wire version 7, this rank version {WIRE_VERSION}" in ending, ending
    assert seconds < 2.0, f"took {seconds:.1f} s (its timeout is 3 s)"


# ---------------------------------------------------------------- a peer that breaks the protocol


def _hello(rank: int, track: int, token: str) -> bytes:
    out = bytearray(HELLO_BYTES)
    out[0:4] = struct.pack("<I", HELLO_MAGIC)
    out[HELLO_VERSION] = struct.pack("<H", WIRE_VERSION)
    out[HELLO_TRACK] = track
    out[HELLO_RANK] = struct.pack("<i", rank)
    out[HELLO_TOKEN] = token.encode()
    return bytes(out)


def test_a_malformed_frame_from_a_peer_fails_the_group_naming_it() -> None:
    # Rank 3 of a 2x2 job (peers: rank 2 on its machine, rank 1 on the other) starts
    # against fakes that speak the protocol: a gate that accepts its connections, and
    # connections into its own gate as ranks 2 and 1. Then "rank 2" sends garbage where
    # a frame belongs: the next allreduce must raise naming rank 2, and nothing crash.
    accepted = REPLY.pack(REPLY_MAGIC, 0, 0, 1)
    gate = _FakeGate(lambda i: accepted)
    store = redirect_store(lambda key: gate.url.encode())
    built: dict[str, Any] = {}

    def build() -> None:
        try:
            built["backend"] = make_second_backend(store, 3, TOKEN, timeout_s=20.0)
        except Exception as exc:  # noqa: BLE001 - reported below
            built["error"] = exc

    builder = threading.Thread(target=build)
    builder.start()
    into: dict[tuple[int, int], socket.socket] = {}
    try:
        deadline = time.monotonic() + 10
        while len(store.written) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        urls = {key: value.decode() for key, value in store.written.items()}
        for peer, key in ((2, "addr/local/3"), (1, "addr/rail/3")):
            host, port = urls[key][len("tcp://") :].rsplit(":", 1)
            for track in (0, 1):
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(_hello(peer, track, TOKEN))
                reply = REPLY.unpack(s.recv(REPLY.size))
                assert reply[:2] == (REPLY_MAGIC, 0), f"rank {peer} track {track}: {reply}"
                into[(peer, track)] = s
        builder.join(timeout=30)
        assert "backend" in built, built.get("error")
        backend = built["backend"]
        into[(2, 1)].sendall(os.urandom(24))  # where a frame belongs, on the gather track
        t0 = time.monotonic()
        with pytest.raises(Exception, match=r"malformed message from rank 2 ") as raised:
            backend.allreduce([torch.ones(10)]).wait()
        assert time.monotonic() - t0 < 5.0, f"took {time.monotonic() - t0:.1f} s: {raised.value}"
        backend.shutdown()
    finally:
        builder.join(timeout=30)
        for s in into.values():
            s.close()
        gate.close()
