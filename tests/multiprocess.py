"""Multi-process test harness: one OS process per rank, simulated machines on one host.

A job is a function ``fn(rank, world_size, **kwargs)`` run on every rank after
``dist.init_process_group(backend, ...)`` (or, with ``init_group=False``, before any: fn
or the framework it drives creates the group from the launch environment, as under
torchrun; or, with ``bare=True``, ``fn(rank, world_size, store, **kwargs)`` with a client
of the job's store and no group, after which the interpreter simply exits, so that
whatever fn left alive is torn down by interpreter exit: reliability_helpers.run_bare).
Each rank is a fresh ``python`` process (``subprocess`` with its own session,
so a whole job can be SIGKILLed), given its own ``FAIRRING_MACHINE_ID`` so that ranks
with equal ids form one simulated machine.

The rendezvous store is a ``TCPStore`` hosted by the parent (the test process), so it
outlives any rank: a rank that dies never takes the store down with it, and there is
no free-port race (the server binds port 0 and reports the port it got).

Nothing here can hang a test: every job has a deadline after which all ranks still
alive get SIGUSR1 (``faulthandler`` dumps their Python stacks into their logs) and then
SIGKILL, and the failure names the ranks that did not finish. Once one rank has failed,
the others get ``abort_grace_s`` to finish before they are killed the same way.

``fn`` and ``kwargs`` travel by pickle, so ``fn`` must be a module-level function of an
importable module (a test module is fine: the parent's ``sys.path`` is handed over).

Set FAIRRING_TEST_KEEP_JOBS=DIR to keep every job's folder (rank logs, results) there.
A rank's side is rank_child.py; many checks in one job, case_job.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import rank_child
import rank_zygote
from native_stacks import native_stacks

# A rank's process: started fresh, or forked from the zygote (tests/rank_zygote.py).
RankProcess = subprocess.Popen[bytes] | rank_zygote.ForkedRank

# Simulated cluster shapes: machine id of each rank.
SHAPES: dict[str, list[str]] = {
    "2x2": ["m0", "m0", "m1", "m1"],
    "3x1": ["m0", "m1", "m2"],
    "1x3": ["m0", "m0", "m0"],
    # L = 3 local ranks on M = 2 machines: L != M, both above one.
    "2x3": ["m0", "m0", "m0", "m1", "m1", "m1"],
    # Ranks of a machine are not contiguous: rank r is on machine r % 2.
    "interleaved": ["m0", "m1", "m0", "m1"],
}

# The backend the suite tests; FAIRRING_TEST_BACKEND=gloo runs the same tests on Gloo
# (useful to validate expectations: Gloo fails the cases only fairring supports).
DEFAULT_BACKEND: str = os.environ.get("FAIRRING_TEST_BACKEND", "fairring")

_LOG_TAIL_LINES = 80
_POLL_S = 0.02
# Compiling the C++ core from scratch takes minutes on 2 cores; it happens once, before
# the first fairring job, and does not count against any job's deadline.
_BUILD_TIMEOUT_S = 1200
_built = False
_T = TypeVar("_T")


def fairring_env(
    *,
    total_memory: int | None = None,
    slice_size: int | None = None,
    **extra: str | int | None,
) -> dict[str, str | None]:
    """Extra environment for a job: ``FAIRRING_TOTAL_MEMORY``, ``FAIRRING_SLICE_SIZE``
    (bytes) and any other ``NAME=value`` given as keyword arguments. A value of None
    removes the variable from the ranks' environment."""
    env: dict[str, str | None] = {}
    if total_memory is not None:
        env["FAIRRING_TOTAL_MEMORY"] = str(total_memory)
    if slice_size is not None:
        env["FAIRRING_SLICE_SIZE"] = str(slice_size)
    for name, value in extra.items():
        env[name] = None if value is None else str(value)
    return env


def local_ranks(machine_ids: Sequence[str]) -> list[int]:
    """Local rank of every rank: its index among the ranks of its machine."""
    seen: dict[str, int] = {}
    out = []
    for mid in machine_ids:
        out.append(seen.get(mid, 0))
        seen[mid] = out[-1] + 1
    return out


def torchrun_agent_environment(rank: int, machine_ids: Sequence[str]) -> dict[str, str]:
    """What torchrun adds to the launch variables: with these, ``init_process_group``
    from the environment (``env://``, as frameworks call it) joins the parent's store as
    a client (torchrun's agent store) instead of starting one on rank 0, and frameworks
    that look for torchrun (Lightning) find it."""
    machines = list(dict.fromkeys(machine_ids))
    return {
        "TORCHELASTIC_RUN_ID": "fairring-test",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "GROUP_RANK": str(machines.index(machine_ids[rank])),
        "GROUP_WORLD_SIZE": str(len(machines)),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(len(machine_ids)),
    }


def rank_environment(
    rank: int,
    machine_ids: Sequence[str],
    store_port: int,
    *extras: Mapping[str, str | int | None] | None,
) -> dict[str, str]:
    """The environment of one rank process: this one's, plus the launch variables
    (simulated machine, store address, torchrun-style ranks), then each of ``extras``
    in order (a value of None removes the variable)."""
    child_env = dict(os.environ)
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(
        FAIRRING_MACHINE_ID=machine_ids[rank],
        # NCCL tells hosts apart by this: simulated machines sharing one GPU need
        # their own (CPU-only runs ignore it).
        NCCL_HOSTID=machine_ids[rank],
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        RANK=str(rank),
        WORLD_SIZE=str(len(machine_ids)),
        LOCAL_RANK=str(local_ranks(machine_ids)[rank]),
        LOCAL_WORLD_SIZE=str(list(machine_ids).count(machine_ids[rank])),
        PYTHONUNBUFFERED="1",
    )
    for extra in extras:
        for name, value in (extra or {}).items():
            if value is None:
                child_env.pop(name, None)
            else:
                child_env[name] = str(value)
    return child_env


@dataclasses.dataclass
class RankOutcome:
    """What became of one rank.

    status: "ok" (fn returned and the process exited 0), "error" (fn or init raised),
    "crashed" (the process died without reporting, e.g. a signal or os._exit),
    "killed" (still running at the deadline or after another rank failed),
    "hung_at_exit" (fn returned but the process did not exit: a hang in
    destroy_process_group or at interpreter exit).
    """

    rank: int
    status: str
    value: Any = None
    error_type: str | None = None
    error_message: str | None = None
    remote_traceback: str | None = None
    exception: BaseException | None = None
    exitcode: int | None = None
    log_tail: str = ""
    # Last phase the rank reached (import / init / fn / destroy / exit), read after any
    # kill: the stacks in the log were dumped just before it, so they may be older.
    phase: str | None = None
    failed_at: float | None = None  # time.time() when the rank reported its error
    # time.monotonic() (the parent's) when fn's result appeared and the process exited.
    returned_at: float | None = None
    exited_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def exit_latency_s(self) -> float | None:
        """Seconds from fn's return to the process's exit."""
        if self.returned_at is None or self.exited_at is None:
            return None
        return self.exited_at - self.returned_at

    def describe(self) -> str:
        head = f"rank {self.rank}: {self.status}"
        if self.exitcode is not None:
            head += f" (exit code {self.exitcode})"
        if self.phase is not None and self.status != "ok":
            head += f", last phase: {self.phase}"
        parts = [head]
        if self.error_type is not None:
            parts.append(f"  {self.error_type}: {self.error_message}")
        if self.remote_traceback:
            parts.append("  remote traceback:\n" + _indent(self.remote_traceback, 4))
        if self.log_tail and self.status != "ok":
            parts.append("  log tail:\n" + _indent(self.log_tail, 4))
        return "\n".join(parts)


class RankFailure(AssertionError):
    """One or more ranks of a job failed, crashed or did not finish in time."""

    def __init__(self, message: str, outcomes: list[RankOutcome]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


def launch(
    fn: Callable[..., Any],
    world_size: int,
    machine_ids: Sequence[str],
    backend: str | None = None,
    env: Mapping[str, str | int | None] | None = None,
    timeout_s: float = 120,
    *,
    rank_env: Mapping[int, Mapping[str, str | int | None]] | None = None,
    abort_grace_s: float | None = 15.0,
    pg_timeout_s: float | None = None,
    init_group: bool = True,
    bare: bool = False,
    store_in_process: bool = False,
    **kwargs: Any,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, **kwargs)`` on ``world_size`` fresh processes and
    return every rank's outcome; never raises for a rank's failure.

    env: extra environment for every rank (None removes a variable); rank_env: extra
    environment for single ranks, applied after env. abort_grace_s: once a rank has
    failed, how long the others may still run (None: until the deadline).
    pg_timeout_s: the process group's own timeout (default: timeout_s).
    init_group=False: the ranks start without a process group, with torchrun's
    variables (``torchrun_agent_environment``), so that fn, or the framework it runs,
    creates it (``backend`` then only says whether to build fairring first); a group
    left at the end is destroyed. bare=True: ``fn(rank, world_size, store, **kwargs)``
    with no group and nothing done after it (see the module's docstring).
    store_in_process=True: the store's host is a process (FAIRRING_TEST_STORE_PID).
    """
    import torch.distributed as dist  # the parent only hosts the store

    _check_job(fn, world_size, machine_ids)
    backend = DEFAULT_BACKEND if backend is None else backend
    pg_timeout_s = timeout_s if pg_timeout_s is None else pg_timeout_s
    if backend == "fairring":
        ensure_fairring_built()
    store_host = _StoreProcess() if store_in_process else None
    store = store_host or dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=pg_timeout_s),
    )
    if store_host:
        env = {**(env or {}), "FAIRRING_TEST_STORE_PID": str(store_host.pid)}
    with _job_folder() as tmp:
        job_dir = Path(tmp)
        # Plain types only: the rank unpickles this before it has the parent's path.
        spec = {
            "fn": pickle.dumps(fn),
            "kwargs": pickle.dumps(kwargs),
            "backend": backend,
            "world_size": world_size,
            "store_port": store.port,
            "pg_timeout_s": pg_timeout_s,
            "init_group": init_group,
            "bare": bare,
            "sys_path": list(sys.path),
        }
        (job_dir / "spec.pkl").write_bytes(pickle.dumps(spec))
        procs: list[RankProcess] = []
        try:
            for rank in range(world_size):
                agent = {} if init_group or bare else torchrun_agent_environment(rank, machine_ids)
                child_env = rank_environment(
                    rank, machine_ids, store.port, agent, env, (rank_env or {}).get(rank, {})
                )
                procs.append(spawn_rank(rank_child.__file__, job_dir, rank, child_env))
            times = _Times()
            killed = _supervise(procs, job_dir, timeout_s, abort_grace_s, times)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    kill_rank(proc, dump_stacks=False)
            if store_host is not None:
                store_host.stop()
            del store
        return _outcomes(procs, job_dir, killed, times)


def _outcomes(
    procs: list[RankProcess], job_dir: Path, killed: set[int], times: _Times
) -> list[RankOutcome]:
    outcomes = [_collect(rank, proc, job_dir, rank in killed) for rank, proc in enumerate(procs)]
    for o in outcomes:
        o.returned_at = times.returned.get(o.rank)
        o.exited_at = times.exited.get(o.rank)
    return outcomes


class _StoreProcess:
    """A TCPStore hosted by a process of its own (launch's store_in_process)."""

    _SERVE = (
        "import sys, time, torch.distributed as d; "
        "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
        "print(s.port, flush=True); time.sleep(1e9)"
    )

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", self._SERVE],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self._proc.stdout is not None
        self.port = int(self._proc.stdout.readline())
        self.pid = self._proc.pid

    def stop(self) -> None:
        self._proc.kill()
        self._proc.wait()


def _check_job(fn: Callable[..., Any], world_size: int, machine_ids: Sequence[str]) -> None:
    if len(machine_ids) != world_size:
        raise ValueError(f"machine_ids has {len(machine_ids)} entries for world_size {world_size}")
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(
            f"{fn.__name__} is defined in __main__, which the ranks cannot import: "
            "define it in an importable module"
        )


def _job_folder() -> contextlib.AbstractContextManager[str]:
    """A temporary folder for the job's spec, logs and results; kept under
    FAIRRING_TEST_KEEP_JOBS where that is set (debugging)."""
    keep_under = os.environ.get("FAIRRING_TEST_KEEP_JOBS")
    if not keep_under:
        return tempfile.TemporaryDirectory(prefix="fairring_job_")
    Path(keep_under).mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(tempfile.mkdtemp(prefix="job_", dir=keep_under))


def spawn_rank(launcher: str, job_dir: Path, rank: int, env: Mapping[str, str]) -> RankProcess:
    """Start ``python launcher JOB_DIR RANK`` (the launcher's child side) in a session of
    its own (so that killing it kills what it started), logging to rankN.log; forked
    from the zygote where the environment allows (tests/rank_zygote.py)."""
    forked = rank_zygote.fork_rank(launcher, job_dir, rank, env)
    if forked is not None:
        return forked
    with open(job_dir / f"rank{rank}.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, launcher, str(job_dir), str(rank)],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    machine_ids: Sequence[str],
    backend: str | None = None,
    env: Mapping[str, str | int | None] | None = None,
    timeout_s: float = 120,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, **kwargs)`` on every rank (see ``launch``) and return
    the list of per-rank results. Raises ``RankFailure`` naming every rank that failed
    (with its exception and remote traceback) or did not finish within ``timeout_s``."""
    outcomes = launch(fn, world_size, machine_ids, backend, env, timeout_s, **kwargs)
    bad = [o for o in outcomes if not o.ok]
    if bad:
        # The first rank to fail is usually the cause, the others its victims.
        bad.sort(key=lambda o: (o.failed_at is None, o.failed_at or 0.0, o.rank))
        backend = DEFAULT_BACKEND if backend is None else backend
        summary = ", ".join(f"rank {o.rank} {o.status}" for o in bad)
        unfinished = [o.rank for o in bad if o.status in ("killed", "hung_at_exit")]
        msg = f"{getattr(fn, '__name__', fn)} on {backend} {list(machine_ids)}: {summary}"
        if unfinished:
            msg += f"; ranks that did not finish: {unfinished}"
        if bad[0].failed_at is not None:
            msg += f"; first to fail: rank {bad[0].rank}"
        msg += "\n" + "\n".join(o.describe() for o in bad)
        raise RankFailure(msg, outcomes)
    return [o.value for o in outcomes]


def memoised(job: Callable[..., _T]) -> Callable[..., _T]:
    """A job runner (arguments hashable) that runs once per arguments for the whole
    test session: what it returned, or what it raised (a RankFailure), is handed to
    every later caller, so that the tests sharing a failed job fail at once with its
    error instead of each running it again."""
    outcomes: dict[tuple[Any, ...], tuple[bool, Any]] = {}

    @functools.wraps(job)
    def run(*args: Any) -> _T:
        if args not in outcomes:
            try:
                outcomes[args] = (True, job(*args))
            except Exception as exc:  # noqa: BLE001 - kept, raised again below
                outcomes[args] = (False, exc)
        ok, value = outcomes[args]
        if not ok:
            raise value
        return value

    return run


# ---------------------------------------------------------------------------- parent


def ensure_fairring_built() -> None:
    """Compile (or find cached) fairring's C++ extension, in a child process so that
    the test process never loads it. Once per test process."""
    global _built
    if _built:
        return
    code = "from fairring_pg._build import load_extension; load_extension()"
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT_S,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"building fairring's extension took over {_BUILD_TIMEOUT_S} s") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-_LOG_TAIL_LINES:])
        raise RuntimeError(f"building fairring's extension failed:\n{tail}")
    _built = True


@dataclasses.dataclass
class _Times:
    """time.monotonic() at which each rank's result appeared, and it exited."""

    returned: dict[int, float] = dataclasses.field(default_factory=dict)
    exited: dict[int, float] = dataclasses.field(default_factory=dict)

    def note(self, procs: list[RankProcess], job_dir: Path, now: float) -> None:
        for rank, proc in enumerate(procs):
            has_result = (job_dir / f"rank{rank}.result").exists()
            if rank not in self.returned and has_result:
                self.returned[rank] = now
            if rank not in self.exited and proc.poll() is not None:
                self.exited[rank] = now


def _supervise(
    procs: list[RankProcess],
    job_dir: Path,
    timeout_s: float,
    abort_grace_s: float | None,
    times: _Times,
) -> set[int]:
    """Wait for the ranks; kill stragglers. Returns the ranks that were killed."""
    deadline = time.monotonic() + timeout_s
    killed: set[int] = set()
    while True:
        running = [r for r, p in enumerate(procs) if p.poll() is None]
        # After the poll, so that a rank found gone has its exit noted before the
        # return below (a CI run lost one that exited between the two).
        now = time.monotonic()
        times.note(procs, job_dir, now)
        if not running:
            return killed
        failed = any(
            p.returncode not in (None, 0) or _read_result(job_dir, r)[0] == "error"
            for r, p in enumerate(procs)
        )
        if failed and abort_grace_s is not None:
            deadline = min(deadline, now + abort_grace_s)
            abort_grace_s = None  # start the grace period only once
        if now >= deadline:
            for r in running:
                kill_rank(procs[r], dump_stacks=True, log=job_dir / f"rank{r}.log")
                killed.add(r)
                times.exited[r] = time.monotonic()
            return killed
        time.sleep(_POLL_S)


def kill_rank(proc: RankProcess, dump_stacks: bool, log: Path | None = None) -> None:
    """SIGKILL the rank's whole session (it may have spawned helpers of its own);
    first, if asked, its native stacks (gdb, where installed) and then SIGUSR1, so that
    faulthandler writes its Python stacks into the log: a hang in C++ shows where."""
    try:
        if dump_stacks:
            if log is not None:
                with open(log, "a") as out:
                    out.write(native_stacks(proc.pid))
            os.kill(proc.pid, signal.SIGUSR1)
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read_result(job_dir: Path, rank: int) -> tuple[str | None, Any]:
    path = job_dir / f"rank{rank}.result"
    if not path.exists():
        return None, None
    try:
        return pickle.loads(path.read_bytes())
    except Exception:  # noqa: BLE001 - half-written files cannot exist (rename), be safe
        return None, None


def _read_phase(job_dir: Path, rank: int) -> str | None:
    path = job_dir / f"rank{rank}.phase"
    return path.read_text() if path.exists() else None


def _log_tail(job_dir: Path, rank: int) -> str:
    path = job_dir / f"rank{rank}.log"
    if not path.exists():
        return ""
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _collect(rank: int, proc: RankProcess, job_dir: Path, killed: bool) -> RankOutcome:
    kind, payload = _read_result(job_dir, rank)
    out = RankOutcome(
        rank=rank,
        status="ok",
        exitcode=proc.returncode,
        log_tail=_log_tail(job_dir, rank),
        phase=_read_phase(job_dir, rank),
    )
    if kind == "error":
        out.status = "error"
        (
            out.error_type,
            out.error_message,
            out.remote_traceback,
            exc_bytes,
            out.failed_at,
        ) = payload
        if exc_bytes is not None:
            try:
                out.exception = pickle.loads(exc_bytes)
            except Exception:  # noqa: BLE001 - the exception class may not unpickle
                out.exception = None
    elif kind == "ok":
        out.value = payload
        if killed:
            out.status = "hung_at_exit"
        elif proc.returncode != 0:
            out.status = "crashed"
    elif killed:
        out.status = "killed"
    else:
        out.status = "crashed"
    return out


def _indent(text: str, n: int) -> str:
    pad = " " * n
    return "\n".join(pad + line for line in text.splitlines())
