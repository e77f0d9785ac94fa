"""MPICH's MPI_Allreduce (through mpi4py) on the sizes and shapes of a CPU benchmark: the
yardstick of a library built for this, beside Gloo.

    python bench/mpi_allreduce.py --shape 1x2 --sizes 4K,64K,1M     # alone
    (bench/allreduce_sizes.py runs it for each loopback shape: its "mpi" column)

The ranks are started by MPICH's own ``mpiexec`` on this host. A shape of several
simulated machines splits them into MPICH's cliques (``MPIR_CVAR_NUM_CLIQUES`` by block:
ranks ``m·L .. m·L+L-1`` are machine m) and its network module to TCP, so that ranks of
one machine share memory and ranks of two machines talk TCP over loopback, as
fairring's and Gloo's do there.
On the namespace cluster (``--netns``, ``--rate``) it is not run: mpiexec cannot place a
rank in a namespace of its own, and an unshaped MPI beside shaped links would flatter it.

Each iteration is a barrier, then a run of back-to-back allreduces of float32 zeros (the
same number as the torch workers' runs), timed together; the figure is the slowest
rank's time per allreduce, its median over iterations, as the other columns'.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# What MPI needs: mpi4py and an mpiexec of an MPI it was built for (pip's `mpich`:
# `pip install -e .[bench]`).
INSTALL = "pip install mpi4py mpich (or: pip install -e .[bench])"


def unavailable() -> str | None:
    """Why MPI cannot be timed here, or None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return f"mpi4py is not installed ({INSTALL})"
    if _mpiexec() is None:
        return f"no mpiexec beside this Python or on PATH ({INSTALL})"
    return None


def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def environment(machines: int) -> dict[str, str]:
    """MPICH's view of `machines` simulated machines on this host (ranks by block). Its
    network module (UCX in pip's MPICH) would itself use shared memory between two
    cliques of one host: told to use TCP only, as two machines would."""
    env = {"OMP_NUM_THREADS": "1"}
    if machines > 1:
        env |= {
            "MPIR_CVAR_NUM_CLIQUES": str(machines),
            "MPIR_CVAR_CLIQUES_BY_BLOCK": "1",
            "UCX_TLS": "tcp,self",
        }
    return env


def run(
    machines: int, ranks: int, sizes: list[int], reps: list[int], iters: int, warmup: int
) -> dict[str, Any]:
    """Seconds per allreduce of each size (each iteration's, the slowest rank's), or
    {"error": why}."""
    why = unavailable()
    if why is not None:
        return {"error": why}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "mpi.json"
        command = [
            str(_mpiexec()),
            "-n",
            str(machines * ranks),
            sys.executable,
            str(Path(__file__).resolve()),
            "--role",
            "worker",
            "--sizes",
            ",".join(map(str, sizes)),
            "--reps",
            ",".join(map(str, reps)),
            "--iters",
            str(iters),
            "--warmup",
            str(warmup),
            "--out",
            str(out),
        ]
        env = {**os.environ, **environment(machines)}
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=600, check=False
            )
        except subprocess.TimeoutExpired:
            return {"error": "mpiexec did not end within 600 s"}
        if done.returncode != 0 or not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"error": f"mpiexec exited with {done.returncode}: {' | '.join(tail)}"}
        return {"sizes": json.loads(out.read_text()), "env": environment(machines)}


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    sizes = [int(s) for s in args.sizes.split(",")]
    reps = [int(r) for r in args.reps.split(",")]
    results: dict[str, list[float]] = {}
    for size, n in zip(sizes, reps, strict=True):
        # Zeros: summed repeatedly they never overflow, and cost what any float does.
        send = np.zeros(max(1, size // 4), dtype=np.float32)
        got = np.empty_like(send)
        mine = []
        for i in range(args.warmup + args.iters):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(n):
                comm.Allreduce(send, got, op=MPI.SUM)
            if i >= args.warmup:
                mine.append((time.perf_counter() - start) / n)
        slowest = np.empty(len(mine))
        comm.Allreduce(np.array(mine), slowest, op=MPI.MAX)
        results[str(size)] = slowest.tolist()
    if comm.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["driver", "worker"], default="driver")
    p.add_argument("--shape", default="1x2", help="machines x ranks")
    p.add_argument("--sizes", default="4K,64K,1M")
    p.add_argument("--reps", default=None, help="allreduces per iteration, per size")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.role == "worker":
        worker(args)
        return 0
    import common

    machines, ranks = common.parse_shape(args.shape)
    sizes = [common.parse_size(s) for s in args.sizes.split(",")]
    reps = [int(r) for r in args.reps.split(",")] if args.reps else [1] * len(sizes)
    result = run(machines, ranks, sizes, reps, args.iters, args.warmup)
    if "error" in result:
        print(f"mpi: {result['error']}", file=sys.stderr)
        return 1
    for size, times in result["sizes"].items():
        print(f"{common.show_size(int(size))}: {common.median(times) * 1e3:.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
