"""Rank processes forked from one that has already imported torch.

A fresh ``python`` that imports torch spends about 2 CPU-seconds before it runs a line
of the test, and the suite starts hundreds of ranks on 2 cores: that start-up was most
of its time. The zygote (``python rank_child.py --zygote``, one per test process,
started on first use) imports torch and torch.distributed once, then forks each rank on
request. The child becomes what ``spawn_rank`` would have started: a session of its own,
the rank's environment, stdin from /dev/null, stdout and stderr into the rank's log,
``sys.argv`` as the launcher's, then the ordinary rank entry point and an ordinary
interpreter exit (atexit handlers and all).

A rank whose environment differs from the zygote's in a variable that something may
read while importing (anything but the launch variables and FAIRRING_*) is started
fresh instead, as is every rank with FAIRRING_TEST_FORK=off. The zygote reaps its
children and writes each exit status next to the rank's log, from where ``ForkedRank``
reports it as ``subprocess.Popen`` would.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

# Read at run time, not while importing: a forked rank may set them.
_RUNTIME_VARIABLES = frozenset(
    {
        "NCCL_HOSTID",
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "TP_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
    }
)
_RUNTIME_PREFIXES = ("FAIRRING_", "TORCHELASTIC_")


def base_environment() -> dict[str, str]:
    """The zygote's environment: the test process's, with what every rank gets."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def forkable(env: Mapping[str, str]) -> bool:
    base = base_environment()
    if os.environ.get("FAIRRING_TEST_FORK", "on") == "off":
        return False
    for name in set(env) | set(base):
        if env.get(name) == base.get(name):
            continue
        if name in _RUNTIME_VARIABLES or name.startswith(_RUNTIME_PREFIXES):
            continue
        return False
    return True


class ForkedRank:
    """What ``launch`` needs of ``subprocess.Popen`` for a rank the zygote forked."""

    def __init__(self, pid: int, status_path: Path) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._status_path = status_path

    def poll(self) -> int | None:
        if self.returncode is None and self._status_path.exists():
            self.returncode = int(self._status_path.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


class _Client:
    def __init__(self, launcher: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, launcher, "--zygote"],
            env=base_environment(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.lock = threading.Lock()

    def fork(self, job_dir: Path, rank: int, env: Mapping[str, str]) -> int | None:
        request = pickle.dumps((str(job_dir), rank, dict(env)))
        with self.lock:
            if self.proc.poll() is not None:
                return None
            assert self.proc.stdin is not None and self.proc.stdout is not None
            try:
                self.proc.stdin.write(struct.pack("<I", len(request)) + request)
                self.proc.stdin.flush()
                reply = self.proc.stdout.read(8)
            except OSError:
                return None
        return struct.unpack("<q", reply)[0] if len(reply) == 8 else None


_client: _Client | None = None


def fork_rank(launcher: str, job_dir: Path, rank: int, env: Mapping[str, str]) -> ForkedRank | None:
    """The rank forked from the zygote, or None where it must start fresh."""
    global _client
    if not forkable(env):
        return None
    if _client is None:
        _client = _Client(launcher)
    pid = _client.fork(job_dir, rank, env)
    if pid is None or pid <= 0:
        return None
    return ForkedRank(pid, status_path(job_dir, rank))


def status_path(job_dir: Path, rank: int) -> Path:
    return job_dir / f"rank{rank}.exitcode"


# ------------------------------------------------------------------------ the zygote


def serve() -> tuple[Path, int]:
    """The zygote's loop; returns only in a forked child, with its (job_dir, rank)."""
    import torch  # noqa: F401 - what the children inherit
    import torch.distributed  # noqa: F401

    children: dict[int, Path] = {}
    lock = threading.Condition()

    def reap() -> None:
        while True:
            with lock:
                while not children:
                    lock.wait()
            pid, status = os.wait()
            with lock:
                path = children.pop(pid, None)
            if path is not None:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(str(os.waitstatus_to_exitcode(status)))
                os.replace(tmp, path)

    threading.Thread(target=reap, name="zygote-reaper", daemon=True).start()
    requests, replies = sys.stdin.buffer, sys.stdout.fileno()
    while True:
        header = requests.read(4)
        if len(header) < 4:
            os._exit(0)  # the test process is gone
        job, rank, env = pickle.loads(requests.read(struct.unpack("<I", header)[0]))
        job_dir = Path(job)
        with lock:
            pid = os.fork()
            if pid == 0:
                break
            children[pid] = status_path(job_dir, rank)
            lock.notify()
        os.write(replies, struct.pack("<q", pid))
    _become_rank(job_dir, rank, env)
    return job_dir, rank


def _become_rank(job_dir: Path, rank: int, env: Mapping[str, str]) -> None:
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(job_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.argv = [sys.argv[0], str(job_dir), str(rank)]
