"""The strangers of tests/test_strangers.py: second backends that forge a peer's hello
(a wrong job token, an impostor rank) and raw TCP connections that send garbage, half a
hello or nothing, with how a rank's answer is read.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time

from reliability_helpers import (
    HELLO_BYTES,
    HELLO_RANK,
    HELLO_TOKEN,
    HELLO_VERSION,
    REPLY,
    REPLY_MAGIC,
    VERDICTS,
    WIRE_VERSION,
    redirect_store,
    second_backend,
)

# The token a second backend presents in place of the job's.
WRONG_TOKEN = "00" * 16

# ---------------------------------------------------------------- second backends


def _capture_hello() -> bytes:
    """The first bytes a real rank sends (here a stranger FairringBackend with a wrong
    token): every peer address it looks up points at a Python socket that records
    them."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    captured: list[bytes] = []

    def record() -> None:
        conn, _ = server.accept()
        conn.settimeout(1.0)
        data = b""
        try:
            while chunk := conn.recv(65536):
                data += chunk
        except TimeoutError:
            pass
        captured.append(data)
        conn.close()

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    store = redirect_store(lambda key: f"tcp://127.0.0.1:{port}".encode())
    second_backend(store, 3, WRONG_TOKEN)
    thread.join(timeout=5)
    server.close()
    assert captured and len(captured[0]) == HELLO_BYTES, f"captured {captured!r}"
    assert captured[0][HELLO_TOKEN] == WRONG_TOKEN.encode(), captured[0]
    return captured[0]


def _forge_hello(hello: bytes, token: str, rank: int) -> bytes:
    """``hello`` (a captured one) with another token and claimed rank."""
    out = bytearray(hello)
    out[HELLO_RANK] = struct.pack("<i", rank)
    out[HELLO_TOKEN] = token.encode()
    return bytes(out)


# ---------------------------------------------------------------- raw TCP strangers


def _connect(address: tuple[str, int]) -> socket.socket:
    return socket.create_connection(address, timeout=2.0)


def _open(address: tuple[str, int]) -> socket.socket | str:
    """A connection to ``address``, or "refused" (ECONNREFUSED), or what else happened."""
    try:
        return _connect(address)
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _refused(address: tuple[str, int]) -> str:
    """Gives "refused" when a connect to ``address`` gets ECONNREFUSED, else what happened."""
    s = _open(address)
    if isinstance(s, str):
        return s
    s.close()
    return "accepted"


def _payload(kind: str, hello: bytes, target: str, token: str) -> bytes:
    """What stranger ``kind`` sends to ``target`` (``"rail/0"``, ``"local/2"``...);
    ``token`` is the job's."""
    reach, rank = target.split("/")[0], int(target.split("/")[1])
    if kind == "other_version_hello":
        # Another fairring build: right token and rank, another wire version.
        forged = bytearray(_forge_hello(hello, token, rank ^ (2 if reach == "rail" else 1)))
        forged[HELLO_VERSION] = struct.pack("<H", WIRE_VERSION + 1)
        return bytes(forged)
    if kind == "random_bytes":
        return os.urandom(4096)
    if kind == "http":
        return b"GET / HTTP/1.1\r\nHost: fairring\r\nConnection: keep-alive\r\n\r\n"
    if kind == "length_2^64":
        return struct.pack("<Q", 2**64 - 1) + os.urandom(64)
    if kind == "wrong_token_hello":
        return hello + os.urandom(1024)
    if kind == "right_token_no_peer":
        return _forge_hello(hello, token, 99)
    if kind == "right_token_wrong_listener":
        # Ranks 0,1 share machine 0 and 2,3 machine 1: rank r's local peer is r^1, its
        # rail peer r^2; each claims to be the other kind on this listener.
        return _forge_hello(hello, token, rank ^ (1 if reach == "rail" else 2))
    if kind == "half_hello":
        return hello[: len(hello) // 2]
    if kind == "silent":
        return b""
    raise ValueError(kind)


# Strangers that say enough to be told apart from a rank: closed at once.
TALKERS = (
    "other_version_hello",  # first: the ranks log only their first five refusals
    "random_bytes",
    "http",
    "length_2^64",
    "wrong_token_hello",
    "right_token_no_peer",
    "right_token_wrong_listener",
)
# Strangers that say too little: held until start-up is over, then closed.
MUTES = ("half_hello", "silent")
STRANGERS = TALKERS + MUTES


def _try_stranger(
    address: tuple[str, int], kind: str, hello: bytes, target: str, token: str
) -> str:
    """One stranger at ``address``: "refused" at connect, or what it got through to."""
    s = _open(address)
    if isinstance(s, str):
        return s
    with s:
        try:
            s.sendall(_payload(kind, hello, target, token))
            s.settimeout(0.5)
            answer = s.recv(4096)
        except OSError as exc:
            answer = type(exc).__name__.encode()
    return f"connected, then got {answer[:80]!r}"


def _describe_answer(data: bytes) -> str:
    if len(data) == REPLY.size:
        magic, verdict, _memory, _version = REPLY.unpack(data)
        if magic == REPLY_MAGIC and verdict == 0:
            return "ACCEPTED"  # a stranger let in: never expected
        if magic == REPLY_MAGIC:
            return f"refused: {VERDICTS.get(verdict, f'verdict {verdict}')}"
    return f"answered {data[:40]!r}"


def _closed_by_peer(sockets: dict[str, socket.socket], timeout_s: float) -> dict[str, str]:
    """Waits up to ``timeout_s`` for the other end to close each socket: "closed" (recv
    gave b''), "reset" (ECONNRESET), "refused: <why>" (a gate's refusal, then the
    close), "answered ..." (other bytes), or "still open"."""
    out: dict[str, str] = {}
    pending = dict(sockets)
    got: dict[str, bytes] = {name: b"" for name in sockets}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        readable, _, _ = select.select(list(pending.values()), [], [], left)
        for name, s in list(pending.items()):
            if s not in readable:
                continue
            try:
                data = s.recv(4096)
            except ConnectionResetError:
                out[name] = _describe_answer(got[name]) if got[name] else "reset"
            except OSError as exc:
                out[name] = f"{type(exc).__name__}: {exc}"
            else:
                if data:
                    got[name] += data
                    continue  # wait for the close itself
                out[name] = _describe_answer(got[name]) if got[name] else "closed"
            del pending[name]
    for name in pending:
        out[name] = f"still open after {timeout_s:.0f} s"
    return out
