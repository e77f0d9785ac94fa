"""Helpers for the reliability tests (faults, shutdown, bad input, strangers, soak).

Two things the shared harness (``multiprocess.py``) deliberately does not do live here:

* ``run_bare`` starts ranks *without* initialising a process group, so a test can
  count a process's threads and sockets before ``init_process_group``, initialise
  several groups in turn (each with its own environment), or let the interpreter exit
  with a group still alive. The parent hosts the store, as in the harness.
* Introspection of one rank from the inside: the job's listener addresses from the
  store, this process's listening sockets, and counts of what could leak.

This file is also the entry point of a bare rank: ``python reliability_helpers.py
JOB_DIR RANK``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from multiprocess import RankOutcome, launch

_POLL_S = 0.02
_LOG_TAIL_LINES = 60

# ---------------------------------------------------------------------- introspection


def group_store(group: Any = None) -> Any:
    """The store torch handed to ``group``'s CPU backend (``None``: the default group).

    torch wraps the rendezvous store as ``<group name>/`` then ``cpu/`` before calling
    a backend creator; fairring adds ``fairring/core/`` for the C++ core."""
    import torch.distributed as dist

    c10d = dist.distributed_c10d
    pg = c10d._get_default_group() if group is None else group
    return dist.PrefixStore("cpu/", c10d._world.pg_map[pg][1])


def core_store(group: Any = None) -> Any:
    import torch.distributed as dist

    return dist.PrefixStore("fairring/core/", group_store(group))


def listener_addresses(world_size: int, group: Any = None) -> dict[str, str]:
    """``{"rail/0": "tcp://127.0.0.1:PORT", "local/0": ..., ...}``: every listener the
    ranks of ``group`` published (a rank has no local listener when it is alone on its
    machine, and no rail listener when there is one machine)."""
    store = core_store(group)
    out: dict[str, str] = {}
    for rank in range(world_size):
        for reach in ("rail", "local"):
            key = f"addr/{reach}/{rank}"
            if store.check([key]):
                out[f"{reach}/{rank}"] = store.get(key).decode()
    return out


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://127.0.0.1:1234`` -> ``("127.0.0.1", 1234)``; ``tcp://[::1]:1234`` too."""
    if not url.startswith("tcp://"):
        raise ValueError(f"not a tcp:// address: {url!r}")
    host, _, port = url[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)


def _socket_inodes(pid: int | str = "self") -> set[int]:
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _hex_ipv4(field: str) -> tuple[str, int]:
    addr, port = field.split(":")
    raw = bytes.fromhex(addr)[::-1]  # /proc/net/tcp prints the address in host order
    return socket.inet_ntoa(raw), int(port, 16)


def _hex_ipv6(field: str) -> tuple[str, int]:
    addr, port = field.split(":")
    raw = bytes.fromhex(addr)
    # Four 32-bit words, each in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds."""
    mine = _socket_inodes(pid)
    out = []
    for table, decode in (("/proc/net/tcp", _hex_ipv4), ("/proc/net/tcp6", _hex_ipv6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            listen = fields[3] == "0A"  # TCP_LISTEN
            if listen and int(fields[9]) in mine:
                out.append(decode(fields[1]))
    return sorted(out)


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


@dataclasses.dataclass(frozen=True)
class Resources:
    """What a process group could leak, counted in the calling process."""

    py_threads: int  # threading.active_count()
    tasks: int  # native threads: /proc/self/task
    fds: int
    socket_fds: int
    shm_fds: int  # descriptors open on /dev/shm
    shm_maps: int  # mappings of /dev/shm files
    rss_kib: int

    def minus(self, other: Resources) -> dict[str, int]:
        return {
            f.name: getattr(self, f.name) - getattr(other, f.name) for f in dataclasses.fields(self)
        }


def count_resources() -> Resources:
    import threading

    fds = socket_fds = shm_fds = 0
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        fds += 1
        socket_fds += target.startswith("socket:")
        shm_fds += target.startswith("/dev/shm/")
    shm_maps = sum(
        " /dev/shm/" in line for line in Path("/proc/self/maps").read_text().splitlines()
    )
    rss_kib = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return Resources(
        py_threads=threading.active_count(),
        tasks=len(os.listdir("/proc/self/task")),
        fds=fds,
        socket_fds=socket_fds,
        shm_fds=shm_fds,
        shm_maps=shm_maps,
        rss_kib=rss_kib,
    )


def settle(
    measure: Callable[[], Resources], baseline: Resources, timeout_s: float = 3.0
) -> Resources:
    """Re-count until no count exceeds ``baseline`` or ``timeout_s`` passes: threads
    torch or the core are joining may take a moment to disappear from /proc."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = measure()
        grown = any(v > 0 for k, v in now.minus(baseline).items() if k != "rss_kib")
        if not grown or time.monotonic() >= deadline:
            return now
        time.sleep(0.05)


def fd_targets() -> dict[int, str]:
    """What each open descriptor of this process refers to."""
    out = {}
    for fd in Path("/proc/self/fd").iterdir():
        try:
            out[int(fd.name)] = os.readlink(fd)
        except OSError:
            continue
    return out


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def default_store() -> Any:
    """The job-wide store (the harness's TCPStore under torch's default-group prefix);
    every rank sees the same keys, so ranks can signal one another through it."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def wait_key(store: Any, key: str, timeout_s: float) -> bytes:
    store.wait([key], timedelta(seconds=timeout_s))
    return store.get(key)


# ---------------------------------------------------------------------- bare jobs

BareOutcome = RankOutcome  # what run_bare returns: the launcher's outcome


def run_bare(
    fn: Callable[..., Any],
    machine_ids: Sequence[str],
    env: Mapping[str, str | int | None] | None = None,
    rank_env: Mapping[int, Mapping[str, str | int | None]] | None = None,
    timeout_s: float = 120,
    **kwargs: Any,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, store, **kwargs)`` on fresh processes, one per entry
    of ``machine_ids``, with no process group: ``store`` is a client of a TCPStore the
    parent hosts. After fn returns the interpreter simply exits, so whatever fn left
    alive is torn down by interpreter exit (``exit_latency_s`` says how long that
    took). Ranks still running at the deadline are killed (after a faulthandler stack
    dump into their logs). The launcher is multiprocess.launch (``bare=True``)."""
    return launch(
        fn,
        len(machine_ids),
        machine_ids,
        "fairring",
        env,
        timeout_s,
        rank_env=rank_env,
        abort_grace_s=None,
        pg_timeout_s=60,
        bare=True,
        **kwargs,
    )


def store_barrier(store: Any, key: str, world: int, timeout_s: float) -> None:
    """Every rank adds itself under ``key`` and waits for all ``world``: a barrier that
    needs no process group (for ranks whose group is failing or being torn down)."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"store barrier {key}")
        time.sleep(0.005)


# ---------------------------------------------------------------- the wire, as tests see it

# The hello a rank opens every connection with (src/transport/handshake.cpp): 64 bytes,
# magic "FRH2", the wire version, the track, the sender's rank and the job token at
# these offsets (then pid and memory probe, zero when unused).
HELLO_BYTES = 64
HELLO_MAGIC = 0x46524832
WIRE_VERSION = 3  # kVersion in src/transport/handshake.cpp
HELLO_VERSION = slice(4, 6)
HELLO_TRACK = 6
HELLO_RANK = slice(8, 12)
HELLO_TOKEN = slice(16, 48)
# The gate's answer to a hello with its magic: "FRR1", a verdict, whether bodies are
# read from memory, the gate's wire version.
REPLY = struct.Struct("<IBBH")
REPLY_MAGIC = 0x46525231
VERDICTS = {
    0: "accepted",
    1: "wrong version",
    2: "wrong token",
    3: "not a peer",
    4: "wrong listener",
}


# ---------------------------------------------------------------- second backends


@functools.cache
def _redirect_store_class() -> Any:
    import torch.distributed as dist  # lazily, like every helper here

    class RedirectStore(dist.Store):
        """A store for a second FairringBackend: the ranks' addresses (``addr/...``)
        come from ``lookup``, no other key exists (a published failure to start would
        stop it), and writes stay here (they must not overwrite the real ranks')."""

        def __init__(self, lookup: Any) -> None:
            super().__init__()
            self._lookup = lookup
            self.written: dict[str, bytes] = {}

        def set(self, key: str, value: Any) -> None:
            self.written[key] = bytes(value)

        def get(self, key: str) -> bytes:
            return self._lookup(key)

        def check(self, keys: list[str]) -> bool:
            return all(key.startswith("addr/") for key in keys)

    return RedirectStore


def redirect_store(lookup: Any) -> Any:
    """A ``dist.Store`` whose address reads come from ``lookup`` and whose writes stay
    in it."""
    return _redirect_store_class()(lookup)


def make_second_backend(store: Any, claimed_rank: int, token: str, timeout_s: float = 3.0) -> Any:
    """A FairringBackend claiming ``claimed_rank`` of a 2x2 job (machines 0,0,1,1, all on
    127.0.0.1) with job ``token``; raises what its start raises."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from fairring_pg._build import load_extension
    from fairring_pg.backend import core_options
    from fairring_pg.config import Config
    from fairring_pg.topology import build_topology

    ext = load_extension()
    opts = ext.Options()
    config = Config(slice_size=16 * 1024, total_memory=128 * 1024, slice_scaling=False)
    topology = build_topology(claimed_rank, ["a", "a", "b", "b"], [socket.gethostname()] * 4)
    core_options(opts, config, topology, "127.0.0.1", token, timedelta(seconds=timeout_s))
    delegate = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    return ext.FairringBackend(store, claimed_rank, 4, opts, delegate)


def second_backend(store: Any, claimed_rank: int, token: str, timeout_s: float = 3.0) -> str:
    """How a second backend (see make_second_backend) ends: "admitted", or
    "refused: <the error>"."""
    try:
        backend = make_second_backend(store, claimed_rank, token, timeout_s)
    except Exception as exc:  # noqa: BLE001 - the expected outcome
        return f"refused: {exc}"
    backend.shutdown()
    return "admitted"


def timed_init(
    rank: int, world: int, store: Any, timeout_s: float, since: dict[str, float] | None = None
) -> dict[str, Any]:
    """init_process_group("fairring"): its error (None if it started) and its time, from
    the call or, where the test recorded it, from ``since["at"]`` (time.monotonic())."""
    import torch.distributed as dist

    t0 = time.monotonic()
    error = None
    try:
        dist.init_process_group(
            "fairring",
            store=store,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
    except Exception as exc:  # noqa: BLE001 - the message is the result
        error = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - (since or {}).get("at", t0)
    if error is None:
        dist.destroy_process_group()
    return {"error": error, "took": took}
