"""Run a torchrun job as if it spanned several machines, all on this host.

    python scripts/simulate_machines.py --machines 2 --ranks-per-machine 2 -- \
        bench/train_ddp.py --backend fairring

Starts one torchrun agent per simulated machine (--nnodes M --node-rank i), each with
FAIRRING_MACHINE_ID=machine<i>, so fairring's topology sees M machines of L ranks.
Output is streamed with a "[machine<i>]" prefix. If any agent fails, the others are
killed and the exit status is non-zero; --timeout bounds the whole run, so a hung
collective can never hang the caller.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

GRACE_S = 5.0  # between SIGTERM and SIGKILL when tearing agents down
TIMEOUT_EXIT = 124  # same as coreutils `timeout`


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Launch M torchrun agents on this host, one per simulated machine.",
        usage="%(prog)s [options] -- SCRIPT [SCRIPT_ARGS...]",
    )
    p.add_argument("--machines", type=int, default=2)
    p.add_argument("--ranks-per-machine", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
    p.add_argument("--master-port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--machine-id-prefix", default="machine")
    p.add_argument("command", nargs=argparse.REMAINDER, help="script and its arguments")
    args = p.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("missing the training script after --")
    if args.machines < 1 or args.ranks_per_machine < 1:
        p.error("--machines and --ranks-per-machine must be at least 1")
    return args


def free_port() -> int:
    # The port is released before torchrun binds it; a collision is possible but
    # rare, and shows up as a clear bind error rather than a hang.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_command(args: argparse.Namespace, node_rank: int, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={args.machines}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={args.ranks_per_machine}",
        "--rdzv-backend=static",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--max-restarts=0",
        *args.command,
    ]


def pump(stream: IO[bytes], prefix: str, lock: threading.Lock, muted: threading.Event) -> None:
    for raw in iter(stream.readline, b""):
        # Once we tear an agent down, all it prints is torchrun's own SIGTERM
        # traceback, which would bury the real error from the agent that failed.
        if muted.is_set():
            continue
        line = raw.decode(errors="replace").rstrip("\n")
        with lock:
            print(f"{prefix} {line}", flush=True)
    stream.close()


def kill_all(agents: list[subprocess.Popen[bytes]], mutes: list[threading.Event]) -> None:
    """Stop every agent with its whole process tree (workers included)."""
    for agent, muted in zip(agents, mutes, strict=True):
        if agent.poll() is None:
            muted.set()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [a for a in agents if a.poll() is None]
        for agent in alive:
            try:
                # Each agent leads its own session, so its pid is its group id.
                os.killpg(agent.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + GRACE_S
        while any(a.poll() is None for a in alive) and time.monotonic() < deadline:
            time.sleep(0.05)
    # Workers orphaned after their agent died still sit in the agent's group.
    for agent in agents:
        try:
            os.killpg(agent.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def supervise(agents: list[subprocess.Popen[bytes]], timeout: float) -> int:
    """Wait for all agents; the first failure or the timeout ends the job."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [a.poll() for a in agents]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            print(
                f"[simulate] machine{i} agent exited with {code}; stopping the rest"
                " (their shutdown output is not shown)",
                file=sys.stderr,
                flush=True,
            )
            return code
        if all(c == 0 for c in codes):
            return 0
        if time.monotonic() > deadline:
            print(
                f"[simulate] timed out after {timeout:.0f} s; killing all agents",
                file=sys.stderr,
                flush=True,
            )
            return TIMEOUT_EXIT
        time.sleep(0.1)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    port = args.master_port or free_port()
    lock = threading.Lock()
    agents: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    mutes: list[threading.Event] = []

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # SIGTERM from a CI runner should clean up exactly like Ctrl-C does.
    signal.signal(signal.SIGTERM, on_signal)
    code = 1
    try:
        for i in range(args.machines):
            machine = f"{args.machine_id_prefix}{i}"
            # NCCL_HOSTID: NCCL must see simulated machines sharing a GPU as hosts.
            env = dict(os.environ, FAIRRING_MACHINE_ID=machine, NCCL_HOSTID=machine)
            # torchrun picks 1 anyway when unset, but prints a banner per agent saying so.
            env.setdefault("OMP_NUM_THREADS", "1")
            agent = subprocess.Popen(
                agent_command(args, i, port),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: killable as a tree
            )
            agents.append(agent)
            assert agent.stdout is not None
            mutes.append(threading.Event())
            t = threading.Thread(
                target=pump,
                args=(agent.stdout, f"[machine{i}]", lock, mutes[-1]),
                daemon=True,
            )
            t.start()
            pumps.append(t)
        code = supervise(agents, args.timeout)
    except KeyboardInterrupt:
        print("[simulate] interrupted; killing all agents", file=sys.stderr, flush=True)
        code = 130
    finally:
        kill_all(agents, mutes)
        for t in pumps:
            t.join(timeout=2.0)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
