"""fairring_pg/tools/netns_cluster.py: two namespace hosts, their launch environment, isolation,
and nothing left behind. Needs root and iproute2; skips cleanly without them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fairring_pg.tools import netns_cluster

SCRIPT = Path(netns_cluster.__file__)  # runs as a file of its own too (stdlib only)

pytestmark = pytest.mark.skipif(
    netns_cluster.unavailable_reason() is not None,
    reason=f"no namespace cluster here: {netns_cluster.unavailable_reason()}",
)

# Runs on every host. Host 1 serves one connection; host 0 connects to it, then tries
# addresses outside the cluster, which must fail at once (no route), sending nothing.
HOST_PROGRAM = r"""
import json, os, socket, sys, time
node = int(os.environ["NODE_RANK"])
report = {k: os.environ.get(k) for k in (
    "NODE_RANK", "NNODES", "MASTER_ADDR", "MASTER_PORT", "HOST_ADDR",
    "FAIRRING_MACHINE_ID", "TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
report["ifnames"] = [name for _, name in socket.if_nameindex()]
if node == 1:
    server = socket.create_server((os.environ["HOST_ADDR"], 7777))
    server.settimeout(30)
    conn, _ = server.accept()
    conn.sendall(b"hello from host 1")
    conn.close()
else:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection(("10.213.0.2", 7777), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    report["reply"] = conn.recv(100).decode()
    report["peer_name"] = socket.gethostbyaddr("10.213.0.2")[0]
    mapped = ("::ffff:10.213.0.2", 0, 0, 0)
    report["mapped_name"] = socket.getnameinfo(mapped, socket.NI_NAMEREQD)[0]
    report["outside"] = {}
    for address in sys.argv[1:]:
        try:
            socket.create_connection((address, 9), timeout=2).close()
            report["outside"][address] = "connected"
        except OSError as exc:
            report["outside"][address] = type(exc).__name__
print("REPORT " + json.dumps(report), flush=True)
"""


def _outside_addresses() -> list[str]:
    """Addresses a leaky namespace could reach: this machine's own and a public one."""
    addresses = ["1.1.1.1", "127.0.0.53"]
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # picks the route's source address; sends nothing
            addresses.append(s.getsockname()[0])
    except OSError:
        pass
    return addresses


def _root_links() -> set[str]:
    return set(
        re.findall(
            r"^\d+: ([^:@]+)",
            subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout,
            re.M,
        )
    )


def test_two_hosts_env_reachability_and_teardown() -> None:
    links_before = _root_links()
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--hosts",
            "2",
            "--timeout",
            "45",
            "--",
            sys.executable,
            "-c",
            HOST_PROGRAM,
            *_outside_addresses(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    prefix = re.search(r"\[netns\] (fnc-\S+):", done.stderr)
    assert prefix, done.stderr
    prefix_name = prefix.group(1)

    reports = {}
    for line in done.stdout.splitlines():
        if "REPORT " in line:
            r = json.loads(line.split("REPORT ", 1)[1])
            reports[int(r["NODE_RANK"])] = r
    assert set(reports) == {0, 1}
    for node, r in reports.items():
        assert r["NNODES"] == "2"
        assert r["MASTER_ADDR"] == "10.213.0.1"
        assert r["HOST_ADDR"] == f"10.213.0.{node + 1}"
        assert r["FAIRRING_MACHINE_ID"] == f"{prefix_name}-h{node}"
        assert r["TP_SOCKET_IFNAME"] == r["GLOO_SOCKET_IFNAME"]
        # The host sees its own veth and loopback, nothing of this machine's network.
        assert sorted(r["ifnames"]) == sorted(["lo", r["TP_SOCKET_IFNAME"]])
    assert reports[0]["reply"] == "hello from host 1"
    # Names resolve inside the cluster (no DNS there): torch's store warns otherwise.
    assert reports[0]["peer_name"] == f"{prefix_name}-h1"
    assert reports[0]["mapped_name"] == f"{prefix_name}-h1"
    assert reports[0]["outside"], "no outside address was tried"
    assert "connected" not in reports[0]["outside"].values(), reports[0]["outside"]

    left = [n for n in netns_cluster.our_namespaces() if n.startswith(prefix_name)]
    assert left == []
    assert list(netns_cluster.ETC_NETNS.glob(prefix_name + "*")) == []
    assert _root_links() - links_before == set()


def test_failure_still_tears_down() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--hosts",
            "2",
            "--rate",
            "1gbit",
            "--timeout",
            "30",
            "--",
            "sh",
            "-c",
            'test "$NODE_RANK" = 0 || exit 3; sleep 20',
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    prefix = re.search(r"\[netns\] (fnc-\S+):", done.stderr)
    assert prefix, done.stderr
    assert not [n for n in netns_cluster.our_namespaces() if n.startswith(prefix.group(1))]


def test_sigterm_tears_down() -> None:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--hosts", "2", "--", "sleep", "30"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()  # printed once the cluster is up
    prefix = re.search(r"\[netns\] (fnc-\S+):", first)
    assert prefix, first
    assert [n for n in netns_cluster.our_namespaces() if n.startswith(prefix.group(1))]
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=20)
    assert code == 130, f"exit {code}; stderr:\n{first}{proc.stderr.read()}"
    assert not [n for n in netns_cluster.our_namespaces() if n.startswith(prefix.group(1))]


def test_cleanup_removes_leftovers_of_dead_runs_only() -> None:
    dead = f"{netns_cluster.NAME_ROOT}-{2**22 + 7}-dead-h0"  # above pid_max's default
    alive = f"{netns_cluster.NAME_ROOT}-{os.getpid()}-live-h0"
    for name in (dead, alive):
        subprocess.run(["ip", "netns", "add", name], check=True)
        (netns_cluster.ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPT), "--cleanup"], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        names = netns_cluster.our_namespaces()
        assert dead not in names
        assert alive in names
        assert not (netns_cluster.ETC_NETNS / dead).exists()
        assert (netns_cluster.ETC_NETNS / alive).exists()
    finally:
        for name in (dead, alive):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(netns_cluster.ETC_NETNS / name, ignore_errors=True)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop root")
def test_without_root_says_so_and_exits_cleanly() -> None:
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    env = {**os.environ, "HOME": "/tmp"}
    # The script needs only the standard library: any Python that user can run will
    # do. The test's own may not be one (a venv of a Python under /root, mode 0700, as
    # pyenv installs it and .ci/run's venv uses); the system's usually is.
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    refusals = []
    for python in dict.fromkeys(p for p in (sys.executable, system) if p):
        probe = subprocess.run(
            [*as_nobody, python, "-c", "pass"], capture_output=True, text=True, timeout=60, env=env
        )
        if probe.returncode == 0:
            break
        refusals.append(f"{python}: {probe.stderr.strip()}")
    else:
        pytest.skip(f"an unprivileged user can run no Python here: {'; '.join(refusals)}")
    # The checkout may sit where that user cannot read it (a clone under /root, a
    # directory of mode 0700; pytest's tmp_path too): run a copy of the script from a
    # directory of its own under the system's temporary directory.
    with tempfile.TemporaryDirectory() as tmp:
        readable = Path(tmp)
        readable.chmod(0o755)
        script = readable / SCRIPT.name
        shutil.copyfile(SCRIPT, script)
        script.chmod(0o644)
        done = subprocess.run(
            [*as_nobody, python, str(script), "--hosts", "2", "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=readable,
        )
    assert done.returncode == netns_cluster.SKIP_EXIT, done.stdout + done.stderr
    assert "need root" in done.stderr


def test_a_signal_inside_a_pump_start_still_tears_down(monkeypatch: pytest.MonkeyPatch) -> None:
    # SIGTERM raises KeyboardInterrupt wherever the main thread is; right after the
    # cluster is up that is often inside Thread.start() of an output pump, before the
    # thread counts as started. Tear-down must still stop the ranks and let the
    # KeyboardInterrupt through (main turns it into exit 130), not fail on joining.
    import threading

    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        started.append(real_popen(*args, **kwargs))  # type: ignore[arg-type]
        return started[-1]

    def interrupted_start(self: threading.Thread) -> None:
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    monkeypatch.setattr(threading.Thread, "start", interrupted_start)
    with pytest.raises(KeyboardInterrupt):
        netns_cluster.run_processes([("host0", ["sleep", "30"], dict(os.environ))], timeout=30)
    assert len(started) == 1
    assert started[0].poll() is not None, "the rank process was left running"


# One rank of a fairring job on a namespace host (env:// from the launcher): exact
# allreduces, and the addresses its core published for its peers.
RANK_PROGRAM = r"""
import json, os
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("fairring", timeout=timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()
exact = True
for n in (0, 1, 1000, 100_003, 2_000_000):
    t = torch.arange(n, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    exact &= torch.equal(t, torch.arange(n, dtype=torch.float32) * (world * (world + 1) // 2))
c10d = dist.distributed_c10d
store = dist.PrefixStore(
    "fairring/core/", dist.PrefixStore("cpu/", c10d._world.pg_map[c10d._get_default_group()][1]))
published = {k: store.get(f"addr/{k}/{rank}").decode() for k in ("rail", "local")}
report = {"rank": rank, "host_addr": os.environ["HOST_ADDR"], "exact": exact, **published}
dist.destroy_process_group()
print("REPORT " + json.dumps(report), flush=True)
"""


def test_fairring_across_namespace_hosts_uses_each_hosts_own_address() -> None:
    # Namespaces have loopbacks of their own: ranks of different hosts can only meet
    # over the veth addresses, so this is the rail path as between real machines.
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--hosts",
            "2",
            "--ranks-per-host",
            "2",
            "--timeout",
            "120",
            "--",
            sys.executable,
            "-c",
            RANK_PROGRAM,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    reports = [
        json.loads(line.split("REPORT ", 1)[1])
        for line in done.stdout.splitlines()
        if "REPORT " in line
    ]
    assert done.returncode == 0 and len(reports) == 4, done.stdout[-3000:] + done.stderr[-3000:]
    for r in sorted(reports, key=lambda r: r["rank"]):
        assert r["exact"], f"rank {r['rank']}: wrong results"
        assert r["rail"].startswith(f"tcp://{r['host_addr']}:"), r
        assert r["local"].startswith("tcp://127.0.0.1:"), r
