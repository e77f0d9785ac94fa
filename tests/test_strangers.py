"""Strangers: what listens, and what happens when something that is not a rank of
the job connects.

One 2x2 job. Every rank checks its own listening sockets (/proc/net/tcp against the
socket descriptors it holds): on a loopback job none may be on 0.0.0.0 or a
non-loopback address. Then, while all ranks run allreduces checked exactly, rank 0
attacks every listener of a fairring group (addresses from the group's store,
``addr/{rail,local}/<rank>``):

* (a small job each) random bytes, an HTTP request, a header claiming 2^64 bytes, a
  real handshake followed by garbage: each sent to a rank, which must survive it;
* a connect/close storm; half-open connections: one that sends nothing, one that
  sends half of a real TensorPipe handshake (captured from a TensorPipe client that
  fairring's own extension starts against a Python socket);
* a real TensorPipe peer with a wrong job token (a second ``FairringBackend`` built
  from the extension, reading the real addresses from the store), and an impostor
  with the right token claiming a rank that is already connected.

Every allreduce must stay exact, the impostors must fail to join, connections must
not accumulate in the ranks, and a connection that never says who it is must not be
held open forever (it is closed within the group's timeout).
"""

from __future__ import annotations

import functools
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
from multiprocess import SHAPES, RankOutcome, fairring_env, launch
from reliability_helpers import (
    count_resources,
    group_store,
    is_loopback,
    listener_addresses,
    listening_sockets,
    parse_uv,
    settle,
)

SHAPE = SHAPES["2x2"]
WORLD = len(SHAPE)
GROUP_TIMEOUT_S = 8.0
ENV = fairring_env(slice_size=16 * 1024, total_memory=128 * 1024)
STRANGER_TIMEOUT_S = 3.0


# ---------------------------------------------------------------- TensorPipe strangers


class _RedirectStore(dist.Store):
    """A store for a stranger FairringBackend: reads come from ``lookup``, writes stay
    here (they must not overwrite the real ranks' addresses)."""

    def __init__(self, lookup: Any) -> None:
        super().__init__()
        self._lookup = lookup
        self.written: dict[str, bytes] = {}

    def set(self, key: str, value: Any) -> None:
        self.written[key] = bytes(value)

    def get(self, key: str) -> bytes:
        return self._lookup(key)


def _stranger_backend(store: Any, claimed_rank: int, token: str) -> str:
    """Start a FairringBackend that claims ``claimed_rank`` of this 2x2 job with
    ``token``; returns how it ended (it should not be admitted)."""
    from fairring_pg._build import load_extension

    ext = load_extension()
    opts = ext.Options()
    opts.slice_size = 16 * 1024
    opts.total_memory = 128 * 1024
    opts.machine_of = [0, 0, 1, 1]
    opts.hostnames = [socket.gethostname()] * WORLD
    opts.listen_address = "127.0.0.1"
    opts.job_token = token
    opts.timeout = timedelta(seconds=STRANGER_TIMEOUT_S)
    delegate = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    try:
        backend = ext.FairringBackend(store, claimed_rank, WORLD, opts, delegate)
    except Exception as exc:  # noqa: BLE001 - the expected outcome
        return f"refused: {exc}"
    backend.shutdown()
    return "admitted"


def _capture_handshake() -> bytes:
    """The first bytes a TensorPipe client (a stranger FairringBackend) sends: every
    peer address it looks up points at a Python socket that records them."""
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
    store = _RedirectStore(lambda key: f"uv://127.0.0.1:{port}".encode())
    _stranger_backend(store, 3, "00" * 16)
    thread.join(timeout=5)
    server.close()
    assert captured and len(captured[0]) > 16, f"captured {captured!r}"
    return captured[0]


# ---------------------------------------------------------------- raw TCP strangers


def _connect(address: tuple[str, int]) -> socket.socket:
    return socket.create_connection(address, timeout=2.0)


def _send_and_close(address: tuple[str, int], payload: bytes) -> None:
    with _connect(address) as s:
        try:
            s.sendall(payload)
        except OSError:
            pass  # the listener may close first; that is a refusal too


def _http(address: tuple[str, int]) -> bytes | str:
    with _connect(address) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: fairring\r\nConnection: keep-alive\r\n\r\n")
        s.settimeout(1.0)
        try:
            return s.recv(4096)
        except TimeoutError:
            return "no answer within 1 s"
        except OSError as exc:
            return f"{type(exc).__name__}"


def _closed_by_peer(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def _attack(group: Any, results: dict[str, Any]) -> None:
    """Rank 0's protocol-level strangers against the group's listeners (on a thread)."""
    addrs = listener_addresses(WORLD, group)
    targets = {name: parse_uv(url) for name, url in addrs.items()}
    results["targets"] = addrs
    real = group_store(group)
    core = dist.PrefixStore("fairring/core/", real)
    token = real.get("fairring/job_token").decode()
    outcomes: dict[str, str] = {}
    # TensorPipe strangers, in parallel (each waits STRANGER_TIMEOUT_S to be admitted).
    threads = [
        threading.Thread(
            target=lambda: outcomes.__setitem__(
                "wrong_token", _stranger_backend(_RedirectStore(core.get), 3, "ff" * 16)
            )
        ),
        threading.Thread(
            target=lambda: outcomes.__setitem__(
                "impostor_rank3", _stranger_backend(_RedirectStore(core.get), 3, token)
            )
        ),
    ]
    for t in threads:
        t.start()
    handshake = _capture_handshake()
    held: dict[str, socket.socket] = {}
    t0 = time.monotonic()
    for name, addr in targets.items():
        held[f"silent {name}"] = _connect(addr)
        half = _connect(addr)
        half.sendall(handshake[: len(handshake) // 2])
        held[f"half handshake {name}"] = half
    refused = 0
    for i in range(200):  # connect/close storm
        addr = list(targets.values())[i % len(targets)]
        try:
            _connect(addr).close()
        except OSError:
            refused += 1
    results["storm_refused"] = refused
    for t in threads:
        t.join(timeout=STRANGER_TIMEOUT_S + 30)
    results["tensorpipe_strangers"] = dict(outcomes)
    # A connection that never identifies itself must not be held open for ever.
    time.sleep(max(0.0, t0 + GROUP_TIMEOUT_S + 3.0 - time.monotonic()))
    results["held_closed_by_rank"] = {name: _closed_by_peer(s) for name, s in held.items()}
    for s in held.values():
        s.close()
    # After all that, every listener still takes connections (a rank whose listener
    # died could never be reached by a peer that reconnects, or joins late).
    accepting = {}
    for name, addr in targets.items():
        try:
            _connect(addr).close()
            accepting[name] = True
        except OSError:
            accepting[name] = False
    results["still_accepting"] = accepting
    time.sleep(0.5)  # let the ranks see the closes


def _sizes(round_: int) -> list[int]:
    return [0, 1, 7, 1000, 5000, 40_000, 100_003][round_ % 7 :] + [3 * round_ + 1]


GARBAGE = ("http", "random_bytes", "length_2^64", "handshake_then_garbage")


def _payload(kind: str) -> bytes:
    if kind == "random_bytes":
        return os.urandom(4096)
    if kind == "length_2^64":
        return struct.pack("<Q", 2**64 - 1) + os.urandom(64)
    if kind == "handshake_then_garbage":
        return _capture_handshake() + os.urandom(1024)
    raise ValueError(kind)


def _garbage_job(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Two machines of one rank: rank 0 sends ``kind`` to rank 1's listener, then both
    run exact allreduces. One small job per payload, so that each payload meets a
    healthy rank (a crash would take the whole group down)."""
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    group_store(group).set(f"strangers/pid/{rank}", str(os.getpid()))
    dist.all_reduce(torch.ones(10), group=group)  # every pipe is up
    result: dict[str, Any] = {}
    if rank == 0:
        pid = int(group_store(group).get("strangers/pid/1"))
        addr = parse_uv(listener_addresses(world, group)["rail/1"])
        if kind == "http":
            result["http_answer"] = repr(_http(addr))
        else:
            _send_and_close(addr, _payload(kind))
        time.sleep(1.0)
        result["target_alive"] = _is_alive(pid)
    exact = True
    try:
        for i in range(50):
            t = torch.arange(1000 + i, dtype=torch.float32) * (rank + 1) + i
            dist.all_reduce(t, group=group)
            want = torch.arange(1000 + i, dtype=torch.float32) * 3 + world * i
            exact &= torch.equal(t, want)
        result["allreduces"] = "exact" if exact else "wrong"
    except Exception as exc:  # noqa: BLE001 - the result
        result["allreduces"] = f"raised: {exc}"
    return result


def _is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _next_group_core_store() -> Any:
    """The store the core of the *next* new_group will use (torch names groups by a
    counter and prefixes the default store with the name, then with the device)."""
    c10d = dist.distributed_c10d
    default_store = c10d._world.pg_map[c10d._get_default_group()][1]
    name = str(c10d._world.group_count)
    return dist.PrefixStore(
        "fairring/core/", dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", default_store))
    )


def _scan_at_startup(rank: int, world: int) -> dict[str, Any]:
    """A port scanner touches the listeners of a group that is still starting: ranks
    0-2 have published their addresses, rank 3 connects only after the scan. The
    group must still form."""
    core = _next_group_core_store()
    scan: dict[str, Any] = {}
    scanner = None
    if rank == 0:

        def run_scan() -> None:
            keys = [f"addr/{reach}/{r}" for r in range(3) for reach in ("rail", "local")]
            # Poll: Store.wait holds the GIL, and this rank's main thread needs it.
            deadline = time.monotonic() + 60
            while not core.check(keys) and time.monotonic() < deadline:
                time.sleep(0.01)
            for key in keys:
                addr = parse_uv(core.get(key).decode())
                for _ in range(3):
                    try:
                        _connect(addr).close()
                    except OSError as exc:
                        scan[key] = f"refused: {exc}"
            core.set("scan/done", "1")

        scanner = threading.Thread(target=run_scan, daemon=True)
        scanner.start()
    ext = None
    if rank == 3:
        # Rank 3 is slow to start its core: it publishes its address and connects only
        # after the scan (everything before, the config and topology exchange and the
        # Gloo delegate, needs all ranks, so the delay has to sit right here).
        from fairring_pg._build import load_extension

        ext = load_extension()
        real_backend = ext.FairringBackend

        def after_the_scan(*args: Any, **kwargs: Any) -> Any:
            core.wait(["scan/done"], timedelta(seconds=60))
            return real_backend(*args, **kwargs)

        ext.FairringBackend = after_the_scan
    t0 = time.monotonic()
    try:
        group = dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    except Exception as exc:  # noqa: BLE001 - the result
        return {"error": f"new_group failed after {time.monotonic() - t0:.1f} s: {exc}"}
    finally:
        if ext is not None:
            ext.FairringBackend = real_backend
    exact = True
    try:
        for i in range(20):
            t = torch.arange(1000 + i, dtype=torch.float32) * (rank + 1)
            dist.all_reduce(t, group=group)
            exact &= torch.equal(t, torch.arange(1000 + i, dtype=torch.float32) * 10)
    except Exception as exc:  # noqa: BLE001 - the result
        return {"error": f"allreduce after new_group failed: {exc}"}
    if scanner is not None:
        scanner.join()
    return {"error": None, "exact": exact, "scan": scan}


def _run_attack(group: Any, results: dict[str, Any]) -> None:
    try:
        _attack(group, results)
    except BaseException as exc:  # noqa: BLE001 - reported by the tests
        import traceback

        results["attack_error"] = traceback.format_exc()
        raise exc


def _attack_results(outcomes: tuple[RankOutcome, ...]) -> dict[str, Any]:
    value = outcomes[0].value
    assert value is not None, outcomes[0].describe()
    assert "attack_error" not in value, value["attack_error"]
    return value


def _strangers_job(rank: int, world: int) -> dict[str, Any]:
    group = dist.new_group(backend="fairring", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    group_store(group).set(f"strangers/pid/{rank}", str(os.getpid()))
    dist.all_reduce(torch.ones(10), group=group)  # every pipe of the group is up
    listening = listening_sockets()
    before = count_resources()
    results: dict[str, Any] = {"listening": listening}
    attacker = None
    if rank == 0:
        attacker = threading.Thread(target=_run_attack, args=(group, results), daemon=True)
        attacker.start()
    errors = []
    checked = 0
    try:
        for round_ in range(10_000):
            for n in _sizes(round_):
                t = torch.arange(n, dtype=torch.float32) * (rank + 1) + round_
                dist.all_reduce(t, group=group)
                expected = torch.arange(n, dtype=torch.float32) * 10 + world * round_
                checked += 1
                if not torch.equal(t, expected):
                    errors.append(f"round {round_}: allreduce of {n} elements was wrong")
            # Stop together: rank 0 says when its attacks are over.
            done = torch.tensor([1 if attacker is not None and not attacker.is_alive() else 0])
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=group)
            if done.item():
                break
    except Exception as exc:  # noqa: BLE001 - reported; rank 0 still reports its attacks
        errors.append(f"allreduce raised: {exc}")
        if attacker is not None:
            attacker.join(timeout=60)
    results["checked"] = checked
    results["errors"] = errors
    after = settle(count_resources, before)
    results["socket_growth"] = after.socket_fds - before.socket_fds
    return results


def test_a_port_scan_during_startup_does_not_break_the_group() -> None:
    outcomes = launch(_scan_at_startup, WORLD, SHAPE, env=ENV, timeout_s=120, abort_grace_s=60)
    _ok(tuple(outcomes))
    problems = [f"rank {o.rank}: {o.value}" for o in outcomes if o.value["error"] is not None]
    problems += [f"rank {o.rank}: not exact" for o in outcomes if not o.value.get("exact", True)]
    assert not problems, "\n".join(problems)


@functools.cache
def _job() -> tuple[RankOutcome, ...]:
    return tuple(launch(_strangers_job, WORLD, SHAPE, env=ENV, timeout_s=180, abort_grace_s=60))


def _ok(outcomes: tuple[RankOutcome, ...]) -> None:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(o.describe() for o in bad)


def test_listeners_bind_only_loopback_on_a_loopback_job() -> None:
    outcomes = _job()
    _ok(outcomes)
    problems = []
    for o in outcomes:
        listening = o.value["listening"]
        if not listening:
            problems.append(f"rank {o.rank}: no listening socket found")
        wild = [a for a in listening if not is_loopback(a[0])]
        if wild:
            problems.append(f"rank {o.rank}: listening beyond loopback: {wild}")
    # The group's advertised listeners are among them, on 127.0.0.1 exactly.
    targets = outcomes[0].value["targets"]
    for name, url in targets.items():
        host, port = parse_uv(url)
        rank = int(name.split("/")[1])
        if host != "127.0.0.1" or ("127.0.0.1", port) not in outcomes[rank].value["listening"]:
            problems.append(f"{name} advertised as {url}, listening: {outcomes[rank].value}")
    assert len(targets) == 2 * WORLD, targets
    assert not problems, "\n".join(problems)


def test_allreduces_stay_exact_while_strangers_connect() -> None:
    outcomes = _job()
    _ok(outcomes)
    for o in outcomes:
        assert not o.value["errors"], o.value["errors"][:10]
        assert o.value["checked"] > 100, o.value["checked"]


@pytest.mark.parametrize("who", ["wrong_token", "impostor_rank3"])
def test_tensorpipe_strangers_are_refused(who: str) -> None:
    outcomes = _job()
    _ok(outcomes)
    ending = _attack_results(outcomes)["tensorpipe_strangers"][who]
    assert ending.startswith("refused") and "to connect" in ending, ending
    if who == "wrong_token":
        # The ranks it reached (the rail and local peers of rank 3) said so.
        logs = "\n".join(o.log_tail for o in outcomes)
        assert "refused a connection that is not from a peer of this job" in logs, logs


def test_listeners_keep_accepting_after_strangers() -> None:
    outcomes = _job()
    _ok(outcomes)
    results = _attack_results(outcomes)
    dead = sorted(name for name, ok in results["still_accepting"].items() if not ok)
    logs = "\n".join(
        line for o in outcomes for line in o.log_tail.splitlines() if "stopped accepting" in line
    )
    assert not dead and results["storm_refused"] == 0, (
        f"listeners no longer accepting: {dead}; {results['storm_refused']} of 200 storm "
        f"connections refused\n{logs}"
    )


def test_stranger_connections_leave_nothing_behind() -> None:
    outcomes = _job()
    _ok(outcomes)
    growth = {o.rank: o.value["socket_growth"] for o in outcomes}
    assert all(g <= 0 for g in growth.values()), f"socket descriptors grew: {growth}"


@pytest.mark.parametrize("kind", GARBAGE)
def test_garbage_bytes_do_not_crash_a_rank(kind: str) -> None:
    outcomes = launch(
        _garbage_job, 2, ["m0", "m1"], env=ENV, timeout_s=120, abort_grace_s=30, kind=kind
    )
    sender, target = outcomes
    assert sender.value is not None, sender.describe()
    assert sender.value["target_alive"] and target.status != "crashed", (
        f"{kind} sent to rank 1's listener killed rank 1:\n{target.describe()}"
    )
    _ok(tuple(outcomes))
    for o in outcomes:
        assert o.value["allreduces"] == "exact", f"rank {o.rank}: {o.value['allreduces']}"
    if kind == "http":
        answer = sender.value["http_answer"]
        assert answer in ("b''", "'no answer within 1 s'"), f"the listener answered: {answer}"


def test_silent_and_half_open_connections_are_closed_within_the_timeout() -> None:
    outcomes = _job()
    _ok(outcomes)
    held = _attack_results(outcomes)["held_closed_by_rank"]
    still_open = sorted(name for name, closed in held.items() if not closed)
    assert not still_open, (
        f"connections still held open by the ranks {GROUP_TIMEOUT_S + 3:.0f} s after they "
        f"were made (group timeout {GROUP_TIMEOUT_S:.0f} s): {still_open}"
    )
