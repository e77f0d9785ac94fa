"""A simulated cluster: M hosts as Linux network namespaces on a private bridge.

    fairring-netns-cluster --hosts 4 --rate 1gbit -- \
        sh -c 'echo $NODE_RANK $MASTER_ADDR $TP_SOCKET_IFNAME'
    fairring-netns-cluster --hosts 2 --ranks-per-host 2 -- python bench/x.py
    fairring-netns-cluster --cleanup          # remove leftovers of dead runs

(or `python scripts/netns_cluster.py ...` in a checkout). The benchmarks, the cost
model's calibration and the tests import it (`fairring_pg.tools.netns_cluster`); it
needs only the standard library, so it also runs as a file of its own.

Each host is a namespace with one veth, whose peer sits on a bridge that lives in a
namespace of its own: nothing is created in, or routed to, the host's own network.
Hosts get 10.213.0.<i+1>/24 and no default route, so they reach each other and nothing
else. --rate shapes both directions of every host's link with `tc tbf` (netem is not
available on these kernels), like a full-duplex NIC of that rate.

The command runs once per host (or --ranks-per-host times, as torch ranks) with the
launch environment: MASTER_ADDR/MASTER_PORT (host 0), NODE_RANK, NNODES, HOST_ADDR,
FAIRRING_MACHINE_ID, and TP_SOCKET_IFNAME = GLOO_SOCKET_IFNAME = the host's veth, so
both fairring and Gloo use the namespace link. Each host has a hosts file of its own
(/etc/netns/<name>/hosts, which `ip netns exec` mounts over /etc/hosts) that names
every host's address, since no DNS server is reachable. Everything is torn down on
exit, failure, timeout, SIGINT, SIGTERM or SIGHUP. Needs root and iproute2; without them it
says so and exits with status 77 (the "skipped" convention of automake).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

NAME_ROOT = "fnc"  # every namespace of ours is fnc-<owner pid>-<random>-<role>
SUBNET = "10.213.0"  # exists only inside our namespaces
PREFIX_LEN = 24
MAX_HOSTS = 200
DEFAULT_PORT = 29500  # each run has its own namespaces, so a fixed port never collides
SKIP_EXIT = 77
TIMEOUT_EXIT = 124
GRACE_S = 5.0
# `ip netns exec NAME` bind-mounts /etc/netns/NAME/* over /etc: each host's own hosts file
ETC_NETNS = Path("/etc/netns")


class Unavailable(RuntimeError):
    """This machine cannot host namespaces (no root, no iproute2)."""


def unavailable_reason() -> str | None:
    """Why a cluster cannot be built here, or None if it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _tc(netns: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", netns, "tc", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _tbf_args(rate: str) -> list[str]:
    # A few ms worth of burst lets GSO-sized packets through without splitting every
    # one; the latency bound keeps the queue (and so the RTT) short, as on a real NIC.
    return ["tbf", "rate", rate, "burst", "256kb", "latency", "20ms"]


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    ifname: str
    address: str

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


@dataclass
class Cluster:
    prefix: str
    rate: str | None
    hosts: list[Host] = field(default_factory=list)
    created: list[str] = field(default_factory=list)  # namespaces, in creation order

    @property
    def bridge_netns(self) -> str:
        return f"{self.prefix}-br"

    def host_env(self, host: Host, port: int = DEFAULT_PORT) -> dict[str, str]:
        """The launch environment of one host (what a torchrun agent would need)."""
        return {
            "MASTER_ADDR": self.hosts[0].address,
            "MASTER_PORT": str(port),
            "NODE_RANK": str(host.index),
            "NNODES": str(len(self.hosts)),
            "HOST_ADDR": host.address,
            "FAIRRING_MACHINE_ID": f"{self.prefix}-h{host.index}",
            "TP_SOCKET_IFNAME": host.ifname,
            "GLOO_SOCKET_IFNAME": host.ifname,
        }


def rank_env(host_env: Mapping[str, str], local_rank: int, ranks_per_host: int) -> dict[str, str]:
    """What torchrun gives rank ``local_rank`` of the host: env:// rendezvous variables."""
    node = int(host_env["NODE_RANK"])
    nodes = int(host_env["NNODES"])
    return {
        **host_env,
        "RANK": str(node * ranks_per_host + local_rank),
        "WORLD_SIZE": str(nodes * ranks_per_host),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(ranks_per_host),
        "GROUP_RANK": str(node),
    }


def _new_prefix() -> str:
    # The owner's pid lets --cleanup tell leftovers from a run still in progress.
    return f"{NAME_ROOT}-{os.getpid()}-{secrets.token_hex(2)}"


def create(num_hosts: int, rate: str | None = None) -> Cluster:
    """Build the namespaces; on any failure, remove what was built and raise."""
    if reason := unavailable_reason():
        raise Unavailable(reason)
    if not 1 <= num_hosts <= MAX_HOSTS:
        raise ValueError(f"hosts must be in 1..{MAX_HOSTS}, got {num_hosts}")
    cluster = Cluster(prefix=_new_prefix(), rate=rate)
    tag = cluster.prefix.split("-", 2)[2]  # interface names are limited to 15 chars
    try:
        _add_netns(cluster, cluster.bridge_netns)
        _ip("link", "add", "br0", "type", "bridge", netns=cluster.bridge_netns)
        _ip("link", "set", "br0", "up", netns=cluster.bridge_netns)
        for i in range(num_hosts):
            host = Host(i, f"{cluster.prefix}-h{i}", f"fr{tag}h{i}", f"{SUBNET}.{i + 1}")
            _add_host(cluster, host, peer=f"p{i}")
            cluster.hosts.append(host)
        _write_hosts_files(cluster)
    except BaseException:
        destroy(cluster)
        raise
    return cluster


def _add_netns(cluster: Cluster, name: str) -> None:
    _ip("netns", "add", name)
    cluster.created.append(name)


def _add_host(cluster: Cluster, host: Host, peer: str) -> None:
    _add_netns(cluster, host.netns)
    # Both ends are created directly inside their namespaces: no interface ever
    # appears in the host's own network, even for a moment.
    _ip(
        "link",
        "add",
        host.ifname,
        "netns",
        host.netns,
        "type",
        "veth",
        "peer",
        "name",
        peer,
        "netns",
        cluster.bridge_netns,
    )
    _ip("link", "set", peer, "master", "br0", "up", netns=cluster.bridge_netns)
    _ip("link", "set", "lo", "up", netns=host.netns)  # ranks of one host talk over lo
    _ip("addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", host.ifname, netns=host.netns)
    _ip("link", "set", host.ifname, "up", netns=host.netns)
    if cluster.rate:
        _tc(host.netns, "qdisc", "add", "dev", host.ifname, "root", *_tbf_args(cluster.rate))
        _tc(cluster.bridge_netns, "qdisc", "add", "dev", peer, "root", *_tbf_args(cluster.rate))


def _write_hosts_files(cluster: Cluster) -> None:
    """Every host resolves every host's address by name (its namespace's name) from a
    hosts file of its own: the namespaces reach no DNS server, and without this each
    reverse lookup (torch's store does one per client) fails with a warning."""
    # Both spellings of each address: torch's store looks up its sockets' names in
    # the IPv4-mapped IPv6 form.
    names = "".join(f"{h.address} {h.netns}\n::ffff:{h.address} {h.netns}\n" for h in cluster.hosts)
    for host in cluster.hosts:
        folder = ETC_NETNS / host.netns
        folder.mkdir(parents=True, exist_ok=True)
        # The namespaces share this machine's hostname: inside each it names that host.
        own = f"{host.address} {socket.gethostname()}\n"
        local = "127.0.0.1 localhost\n::1 localhost\n::ffff:127.0.0.1 localhost\n"
        (folder / "hosts").write_text(local + own + names)


def destroy(cluster: Cluster) -> list[str]:
    """Delete every namespace of the cluster (their veths and bridge go with them).

    Returns the errors instead of raising, so one stuck namespace never stops the
    others from being removed.
    """
    errors = []
    for name in reversed(cluster.created):
        try:
            _ip("netns", "del", name)
        except RuntimeError as exc:
            errors.append(str(exc))
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)
    cluster.created.clear()
    return errors


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt meanwhile, as Ctrl-C does.

    Python's default for them is to die without running finally blocks, which would
    leave namespaces and rank processes (each in a session of its own) behind.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; its caller's apply
        return
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def running_cluster(num_hosts: int, rate: str | None = None) -> Iterator[Cluster]:
    """The cluster, torn down on leaving, whatever the way out."""
    with signals_interrupt():
        cluster = create(num_hosts, rate)
        try:
            yield cluster
        finally:
            for error in destroy(cluster):
                print(f"[netns] cleanup: {error}", file=sys.stderr, flush=True)


def our_namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [n for n in names if n.startswith(NAME_ROOT + "-")]


def _owner_alive(name: str) -> bool:
    try:
        os.kill(int(name.split("-")[1]), 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers(force: bool = False) -> list[str]:
    """Remove namespaces of runs whose owner process is gone (all of ours if force)."""
    removed = []
    for name in our_namespaces():
        if force or not _owner_alive(name):
            _ip("netns", "del", name)
            removed.append(name)
    if ETC_NETNS.is_dir():
        for folder in ETC_NETNS.glob(NAME_ROOT + "-*"):
            if force or not _owner_alive(folder.name):
                shutil.rmtree(folder, ignore_errors=True)
    return removed


_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 7001)); server.settimeout(20)
conn, _ = server.accept(); buf = bytearray(1 << 20); got = 0; start = None
while True:
    n = conn.recv_into(buf)
    if not n: break
    start = start or time.perf_counter(); got += n
print(got / (time.perf_counter() - start))
"""
_SENDER = """
import socket, sys, time
for _ in range(200):
    try: conn = socket.create_connection((sys.argv[1], 7001)); break
    except OSError: time.sleep(0.05)
chunk = bytes(1 << 20)
for _ in range(int(sys.argv[2])): conn.sendall(chunk)
conn.close()
"""


def tcp_goodput(cluster: Cluster, mib: int = 200) -> float:
    """Bytes/s of one TCP stream from host 1 to host 0: what the link really carries
    (a shaped 1gbit link moves ~119 MB/s of payload, headers take the rest)."""
    receiver = subprocess.Popen(
        [
            *cluster.hosts[0].exec_prefix(),
            sys.executable,
            "-c",
            _RECEIVER,
            cluster.hosts[0].address,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    subprocess.run(
        [
            *cluster.hosts[1].exec_prefix(),
            sys.executable,
            "-c",
            _SENDER,
            cluster.hosts[0].address,
            str(mib),
        ],
        check=True,
        timeout=120,
    )
    out, _ = receiver.communicate(timeout=30)
    return float(out.strip())


# --- running commands on the hosts -------------------------------------------------


@dataclass
class Proc:
    label: str
    popen: subprocess.Popen[bytes]
    muted: threading.Event = field(default_factory=threading.Event)


def _pump(proc: Proc, lock: threading.Lock, sink: IO[str]) -> None:
    assert proc.popen.stdout is not None
    for raw in iter(proc.popen.stdout.readline, b""):
        if proc.muted.is_set():  # a process we tore down only prints its own death
            continue
        with lock:
            print(f"[{proc.label}] {raw.decode(errors='replace').rstrip()}", file=sink, flush=True)


def _stop(procs: Sequence[Proc]) -> None:
    for proc in procs:
        if proc.popen.poll() is None:
            proc.muted.set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in procs if p.popen.poll() is None]
        for proc in alive:
            try:
                os.killpg(proc.popen.pid, sig)  # each leads its own session
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE_S
        while any(p.popen.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(0.05)


def run_processes(
    specs: Sequence[tuple[str, list[str], Mapping[str, str]]],
    timeout: float,
    sink: IO[str] = sys.stdout,
) -> int:
    """Start (label, argv, env) processes, stream their output; 0 if all succeed.

    The first failure, or the timeout, stops all of them, so that a hung collective
    never hangs the caller.
    """
    procs: list[Proc] = []
    pumps: list[threading.Thread] = []
    lock = threading.Lock()
    with signals_interrupt():
        try:
            for label, argv, env in specs:
                popen = subprocess.Popen(
                    argv,
                    env=dict(env),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                procs.append(Proc(label, popen))
                pumps.append(
                    threading.Thread(target=_pump, args=(procs[-1], lock, sink), daemon=True)
                )
                pumps[-1].start()
            return _wait(procs, timeout)
        finally:
            _stop(procs)
            for t in pumps:
                # A signal can land inside Thread.start(): such a pump never counts as
                # started, and joining it would raise over the KeyboardInterrupt.
                with contextlib.suppress(RuntimeError):
                    t.join(timeout=2.0)


def _wait(procs: Sequence[Proc], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.popen.poll() for p in procs]
        failed = [(p.label, c) for p, c in zip(procs, codes, strict=True) if c not in (None, 0)]
        if failed:
            label, code = failed[0]
            print(
                f"[launch] {label} exited with {code}; stopping the rest",
                file=sys.stderr,
                flush=True,
            )
            return code if code > 0 else 128 - code  # killed by a signal: 128 + its number
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            print(
                f"[launch] timed out after {timeout:.0f} s; stopping all",
                file=sys.stderr,
                flush=True,
            )
            return TIMEOUT_EXIT
        time.sleep(0.05)


def host_specs(
    cluster: Cluster, command: list[str], ranks_per_host: int | None, port: int = DEFAULT_PORT
) -> list[tuple[str, list[str], dict[str, str]]]:
    """One process per host, or ``ranks_per_host`` rank processes per host."""
    specs = []
    for host in cluster.hosts:
        env = {**os.environ, **cluster.host_env(host, port)}
        if ranks_per_host is None:
            specs.append((f"host{host.index}", host.exec_prefix() + command, env))
            continue
        for local in range(ranks_per_host):
            r_env = {**os.environ, **rank_env(env, local, ranks_per_host)}
            specs.append(
                (f"host{host.index}/r{r_env['RANK']}", host.exec_prefix() + command, r_env)
            )
    return specs


# --- command line ------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run a command on every host of a simulated namespace cluster.",
        usage="%(prog)s [options] -- COMMAND [ARGS...]  |  %(prog)s --cleanup",
    )
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--rate", help="per-host link rate for tc tbf, e.g. 1gbit (default: none)")
    p.add_argument(
        "--ranks-per-host",
        type=int,
        default=None,
        help="start the command this many times per host, as torch ranks",
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="MASTER_PORT")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="remove namespaces left by runs whose process is gone, then exit",
    )
    p.add_argument("--force", action="store_true", help="with --cleanup: remove all of ours")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.cleanup and not args.command:
        p.error("missing the command after --")
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        p.error("--ranks-per-host must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if reason := unavailable_reason():
        print(f"[netns] cannot simulate a cluster here: {reason}; nothing done", file=sys.stderr)
        return SKIP_EXIT
    if args.cleanup:
        removed = cleanup_leftovers(args.force)
        print(
            f"[netns] removed {len(removed)} namespace(s){': ' if removed else ''}"
            f"{' '.join(removed)}"
        )
        return 0

    try:
        with running_cluster(args.hosts, args.rate) as cluster:
            shaped = f", {args.rate} per host" if args.rate else ""
            print(
                f"[netns] {cluster.prefix}: {args.hosts} hosts on {SUBNET}.0/{PREFIX_LEN}{shaped}",
                file=sys.stderr,
                flush=True,
            )
            specs = host_specs(cluster, args.command, args.ranks_per_host, args.port)
            return run_processes(specs, args.timeout)
    except KeyboardInterrupt as exc:
        print(f"[netns] interrupted ({exc}); torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
