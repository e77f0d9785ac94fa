"""This machine's primitives, measured by the model itself and cached.

Only primitives: how fast one core copies and adds memory, what one small message and
one byte of TCP cost on loopback, and what share of a ``tc``-shaped link one TCP stream
gets. Never an allreduce: the model is judged on allreduces (bench/model_validation.py),
so it must not learn from them.

The cache is one JSON file per machine and software (``~/.cache/fairring_pg/model/``,
``$XDG_CACHE_HOME`` honoured), keyed by the host, CPU, cores, kernel, Python and torch.
Measurements are timing runs: on a shared host, take them while nothing else runs
(the project's benchmarks hold ``flock -x /tmp/fairring-cpu.lock``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CACHE_VERSION = 1
MIB = 1024 * 1024
_COPY_BYTES = 64 * MIB  # well past the caches: what a slice's bytes cost
_REPEATS = 7
_PINGS = 2000
_STREAM_BYTES = 256 * MIB
_LINK_SECONDS = 2.0  # how long the shaped-link stream runs (at least 16 MiB)


@dataclass(frozen=True)
class Primitives:
    """What the CPU model needs to know about this machine."""

    copy_bytes_per_s: float  # one core, memcpy-like (torch copy_ of float32)
    reduce_bytes_per_s: float  # one core, dst += src of float32, bytes of dst
    message_s: float  # one small TCP message on loopback, one way, wake-up included
    tcp_cpu_s_per_byte: float  # CPU seconds (sender + receiver) per byte over TCP
    cores: int
    link_efficiency: dict[str, float] = field(default_factory=dict)  # tc rate -> share
    measured: dict[str, str] = field(default_factory=dict)  # what was measured, when

    def efficiency(self, rate: str) -> float:
        try:
            return self.link_efficiency[rate]
        except KeyError:
            raise KeyError(
                f"no measured TCP efficiency for a {rate} link: calibrate it first "
                "(fairring_pg.model.calibration.calibrate(links=[...]))"
            ) from None


def machine_key() -> dict[str, Any]:
    import torch

    return {
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count() or 1,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "version": CACHE_VERSION,
    }


def cache_path(key: dict[str, Any] | None = None) -> Path:
    key = key or machine_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "fairring_pg" / "model" / f"primitives-{digest}.json"


def load(path: Path | None = None) -> Primitives | None:
    """The cached primitives of this machine, or None."""
    path = path or cache_path()
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return Primitives(**data["primitives"])


def calibrate(
    links: tuple[str, ...] = (),
    force: bool = False,
    path: Path | None = None,
    log: Any = None,
) -> Primitives:
    """The primitives, from the cache or measured now; ``links`` (tc rates) are measured
    if not yet cached. Saves what it measured."""
    key = machine_key()
    path = path or cache_path(key)
    known = None if force else load(path)
    if known is None:
        _say(log, "measuring memory copy, reduction and loopback TCP (a few seconds)")
        copy_bw, reduce_bw = measure_memory()
        message_s, tcp_cpu = measure_loopback()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S %z")
        known = Primitives(
            copy_bytes_per_s=copy_bw,
            reduce_bytes_per_s=reduce_bw,
            message_s=message_s,
            tcp_cpu_s_per_byte=tcp_cpu,
            cores=key["cores"],
            measured={"memory": stamp, "loopback": stamp, "load_avg": _load()},
        )
    missing = [rate for rate in links if rate not in known.link_efficiency]
    if missing:
        efficiency = dict(known.link_efficiency)
        measured = dict(known.measured)
        for rate in missing:
            _say(log, f"measuring one TCP stream over a {rate} link (netns, tc tbf)")
            efficiency[rate] = measure_link_efficiency(rate)
            measured[f"link {rate}"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
        known = Primitives(**{**asdict(known), "link_efficiency": efficiency, "measured": measured})
    if missing or not path.exists() or force:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "primitives": asdict(known)}, indent=1) + "\n")
        tmp.replace(path)
    return known


# --- the measurements ---------------------------------------------------------------


def measure_memory(nbytes: int = _COPY_BYTES) -> tuple[float, float]:
    """Bytes/s of one core copying, and adding into, float32 memory (median of runs)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs (bench/common.py), one core each
    try:
        src = torch.ones(nbytes // 4)
        dst = torch.zeros(nbytes // 4)
        dst.copy_(src)  # first touch
        copies, adds = [], []
        for _ in range(_REPEATS):
            start = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - start)
            start = time.perf_counter()
            dst.add_(src)
            adds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return nbytes / statistics.median(copies), nbytes / statistics.median(adds)


_ECHO = """
import os, resource, socket, sys
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
pings = int(sys.argv[1])
for _ in range(pings):
    data = conn.recv(64)
    conn.sendall(data)
before = resource.getrusage(resource.RUSAGE_SELF)
buf = bytearray(4 << 20)
view = memoryview(buf)
total = int(sys.argv[2])
got = 0
while got < total:
    n = conn.recv_into(view)
    if not n:
        break
    got += n
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
conn.sendall(repr(cpu).encode())
conn.close()
"""


def measure_loopback(pings: int = _PINGS, nbytes: int = _STREAM_BYTES) -> tuple[float, float]:
    """(one-way seconds of a 64-byte message, CPU seconds per byte of a TCP stream),
    between this process and a child over 127.0.0.1."""
    child = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(pings), str(nbytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        message = bytes(64)
        trips = []
        for _ in range(pings):
            start = time.perf_counter()
            conn.sendall(message)
            got = 0
            while got < len(message):
                got += len(conn.recv(64 - got))
            trips.append(time.perf_counter() - start)
        chunk = bytes(4 * MIB)
        before = resource.getrusage(resource.RUSAGE_SELF)
        sent = 0
        while sent < nbytes:
            conn.sendall(chunk)
            sent += len(chunk)
        conn.shutdown(socket.SHUT_WR)
        after = resource.getrusage(resource.RUSAGE_SELF)
        reply = b""
        while part := conn.recv(64):
            reply += part
        conn.close()
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    sender = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    receiver = float(reply.decode())
    return statistics.median(trips) / 2, (sender + receiver) / sent


def measure_link_efficiency(rate: str) -> float:
    """Payload bytes/s of one TCP stream between two namespace hosts whose links are
    shaped to ``rate`` (tc tbf), divided by the rate."""
    from fairring_pg.model.units import parse_rate
    from fairring_pg.tools import netns_cluster as netns

    if reason := netns.unavailable_reason():
        raise RuntimeError(f"cannot measure a {rate} link: {reason}")
    nominal = parse_rate("--link", rate)
    mib = max(16, int(nominal * _LINK_SECONDS / MIB))
    with netns.running_cluster(2, rate) as cluster:
        goodput = netns.tcp_goodput(cluster, mib)
    return goodput / nominal


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _say(log: Any, text: str) -> None:
    if log is not None:
        print(f"fairring-plan: {text}", file=log, flush=True)
