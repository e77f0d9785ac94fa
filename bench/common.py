"""What every microbenchmark shares: the launch, both process groups, timing, the stamp.

A benchmark script runs twice over: as the *driver* (what the user starts), which
launches the ranks on simulated machines (loopback, or the namespace cluster of
fairring_pg/tools/netns_cluster.py), and as a *worker* (one per rank, `--role worker`), which
measures fairring and Gloo side by side in the same processes and leaves its raw
figures in a JSON file for the driver.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from fairring_pg.tools import netns_cluster

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"  # the committed results, which the README quotes
TMP = RESULTS / "tmp"  # ignored by git
# A run writes here unless told otherwise (--out): a benchmark run to try something
# must not replace the committed figures. `--out bench/results` does that, on purpose.
DEFAULT_OUT = TMP
RAW = TMP / "raw"  # what rank 0 of a launch leaves for the driver
KIB = 1024
MIB = 1024 * KIB

# --- sizes and bandwidths ----------------------------------------------------------


def parse_size(text: str) -> int:
    units = {"K": KIB, "M": MIB, "G": 1024 * MIB}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def show_size(n: int) -> str:
    for unit, scale in (("GiB", 1024 * MIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def parse_shape(text: str) -> tuple[int, int]:
    """'2x2' -> (machines, ranks per machine)."""
    machines, ranks = text.lower().split("x")
    return int(machines), int(ranks)


def algbw(size: int, seconds: float) -> float:
    """Bytes/s of the tensor itself: S/t."""
    return size / seconds


def busbw(size: int, seconds: float, world: int) -> float:
    """Bytes/s each rank moves in a bandwidth-optimal allreduce: 2(N-1)/N * S/t."""
    return 2 * (world - 1) / world * size / seconds if world > 1 else 0.0


# --- the stamp ---------------------------------------------------------------------

_CONFIG_PREFIXES = ("FAIRRING_", "TP_", "GLOO_", "OMP_")
# Taken when a driver imports this module, i.e. as its run starts: other jobs on a small
# shared host are the main source of noise, so the stamp shows the load before and after.
LOAD_AT_START = os.getloadavg()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def stamp(config: Mapping[str, Any]) -> dict[str, Any]:
    """Where and how a result was measured, so that figures are never compared blind."""
    import torch

    # Results written earlier in the same suite run are not sources.
    sources = ("src", "fairring_pg", "bench", "scripts", ":(exclude)bench/results")
    dirty = bool(_git("status", "--porcelain", "--", *sources))
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": _git("rev-parse", "--short=12", "HEAD"),
        "git_dirty": dirty,  # the commit alone does not describe uncommitted sources
        "load_avg_start": list(LOAD_AT_START),
        "load_avg": list(os.getloadavg()),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_CONFIG_PREFIXES)},
        "config": dict(config),
    }


# --- launching ---------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where a benchmark's ranks run and the stem its results are saved under."""

    netns: bool
    where: str  # "loopback", "netns" or "netns_<rate>"
    name: str


def placement(args: Any, benchmark: str) -> Placement:
    """From the --rate, --netns and --name every driver takes."""
    netns = bool(args.rate or args.netns)
    where = f"netns_{args.rate}" if args.rate else ("netns" if netns else "loopback")
    name = args.name or (benchmark if where == "loopback" else f"{benchmark}_{where}")
    return Placement(netns, where, name)


def add_output_args(p: argparse.ArgumentParser) -> None:
    """--out for the driver; --raw-out, which the driver gives its workers."""
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"folder for <name>.json, .md and .png (default:"
        f" {DEFAULT_OUT.relative_to(REPO)}/, which git ignores; --out bench/results"
        " replaces the committed results)",
    )
    p.add_argument("--raw-out", type=Path, help="(worker) file for rank 0's raw figures")


def run_workers(
    script: Path,
    args: Any,
    place: Placement,
    label: str,
    forwarded: Sequence[str],
    machines: int,
    ranks_per_machine: int,
    stem: str,
) -> tuple[int, dict[str, Any] | None]:
    """One launch of ``script``'s workers as machines x ranks; (0, what rank 0 wrote to
    RAW/<stem>.json), or (exit status, None) after saying so."""
    out = RAW / f"{stem}.json"
    out.unlink(missing_ok=True)
    print(f"== {place.name}: {label} ({place.where})", flush=True)
    code = launch(
        script,
        [*forwarded, "--raw-out", str(out)],
        machines,
        ranks_per_machine,
        rate=args.rate,
        netns=place.netns,
        timeout=args.timeout,
    )
    if code != 0:
        print(
            f"!! {place.name} {label} failed with exit status {code}", file=sys.stderr, flush=True
        )
        return code, None
    return 0, json.loads(out.read_text())


def stamp_and_save(
    benchmark: str,
    name: str,
    config: Mapping[str, Any],
    render: Callable[[dict[str, Any]], tuple[str, Callable[[Path], None]]],
    results: Mapping[str, Any],
    out: Path,
) -> None:
    data = {"benchmark": benchmark, "stamp": stamp(config), **results}
    markdown, plot = render(data)
    save(out, name, data, markdown, plot)


def role_main(
    argv: list[str],
    parse_args: Callable[[list[str]], Any],
    worker: Callable[[Any], None],
    driver: Callable[[Any], int],
) -> int:
    """Every benchmark script is both the driver (launches ranks, then reports) and,
    with --role worker, one of those ranks."""
    args = parse_args(argv)
    if args.role == "worker":
        worker(args)
        return 0
    return driver(args)


def worker_command(script: Path, args: Sequence[str]) -> list[str]:
    return [sys.executable, str(script), "--role", "worker", *args]


def launch(
    script: Path,
    args: Sequence[str],
    machines: int,
    ranks_per_machine: int,
    rate: str | None = None,
    netns: bool = False,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``script --role worker ARGS`` as M x L ranks; 0 when every rank succeeded.

    Loopback (default): every simulated machine is this host, told apart by
    FAIRRING_MACHINE_ID. netns=True (or a rate): each machine is a namespace host with
    its own link, shaped to ``rate`` when given.
    """
    command = worker_command(script, args)
    extra = dict(env or {})
    if netns or rate:
        with netns_cluster.running_cluster(machines, rate) as cluster:
            specs = netns_cluster.host_specs(cluster, command, ranks_per_machine)
            specs = [(label, argv, {**e, **extra}) for label, argv, e in specs]
            return netns_cluster.run_processes(specs, timeout)
    port = _free_port()
    specs = []
    for m in range(machines):
        host_env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NODE_RANK": str(m),
            "NNODES": str(machines),
            "FAIRRING_MACHINE_ID": f"machine{m}",
            # NCCL tells hosts apart by this: machines simulated on one GPU need their own.
            "NCCL_HOSTID": f"machine{m}",
            "GLOO_SOCKET_IFNAME": "lo",
        }
        for local in range(ranks_per_machine):
            rank_env = netns_cluster.rank_env(host_env, local, ranks_per_machine)
            specs.append(
                (f"m{m}/r{rank_env['RANK']}", command, {**os.environ, **rank_env, **extra})
            )
    return netns_cluster.run_processes(specs, timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- inside a worker ---------------------------------------------------------------


def init_worker(timeout_s: float = 300.0) -> None:
    import torch
    import torch.distributed as dist

    # Several ranks share two cores: extra intra-op threads only oversubscribe them.
    torch.set_num_threads(1)
    # The default group is Gloo: the reference, and what barriers and result gathering
    # use, so that fairring groups carry nothing but the timed allreduces.
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


@contextmanager
def env_overrides(values: Mapping[str, str]) -> Iterator[None]:
    """fairring reads its configuration from the environment when a group is created."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def fairring_group(ranks: Sequence[int] | None = None, **env: str) -> Any:
    """A fairring group over the same processes, configured by FAIRRING_* ``env``."""
    import torch.distributed as dist

    with env_overrides(env):
        return dist.new_group(ranks=ranks, backend="fairring")


def time_iterations(
    variants: Mapping[str, Callable[[], None]],
    iters: int,
    warmup: int,
    barrier: Callable[[], None],
) -> dict[str, list[float]]:
    """Seconds per iteration of each variant, interleaved, the slowest rank's time.

    Variants alternate iteration by iteration, so a slow spell on this shared host
    hits all of them alike. Each timed iteration starts right after a barrier.
    """
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        for fn in variants.values():
            barrier()
            fn()
    mine: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(iters):
        for name, fn in variants.items():
            barrier()
            start = time.perf_counter()
            fn()
            mine[name].append(time.perf_counter() - start)
    # The collective took as long as its slowest rank; done on the default (Gloo) group.
    flat = torch.tensor([t for name in variants for t in mine[name]], dtype=torch.float64)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    values = flat.tolist()
    return {name: values[i * iters : (i + 1) * iters] for i, name in enumerate(variants)}


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def write_worker_result(path: Path, data: Mapping[str, Any]) -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))


# --- results -----------------------------------------------------------------------


def save(
    out: Path, name: str, data: Mapping[str, Any], markdown: str, plot: Callable[[Path], None]
) -> None:
    """<out>/<name>.json, .md and .png."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown)
    plot(out / f"{name}.png")
    print(markdown)
    print(f"wrote {out / name}.{{json,md,png}}", flush=True)
