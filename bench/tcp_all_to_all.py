"""Plain TCP between network-namespace hosts: how fast an all-to-all can be on the link.

    python bench/tcp_all_to_all.py --hosts 4 --rate 1gbit    # root and iproute2

No fairring and no torch: one process per host sends the same bytes as fairring's
collect and diffuse on M x 1 (1.5 x 25 MiB by default) split evenly over the other
hosts, and receives as much. Three patterns, each run --repeats times: one flow per
peer written concurrently; one writer rotating over the peers in 256 KiB pieces with
128 KiB of unsent data per socket (what fairring's rail writer does); two flows per
peer, concurrently (fairring's two lanes, unordered). Prints each host's time until it
had received everything, against the time one TCP stream would take
(netns_cluster.tcp_goodput). A ring sends one stream to one neighbour, so this bounds
what an all-to-all algorithm can reach against it on the same links.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time

import common

PORT = 29911
PIECE = 256 * 1024
UNSENT = 128 * 1024
TCP_NOTSENT_LOWAT = 25  # linux/tcp.h; not exported by Python's socket module
PATTERNS = {"concurrent": 1, "rotate": 1, "concurrent-2": 2}  # name: flows per peer


def host_main(me: int, addresses: list[str], pattern: str, total: int, start_at: float) -> None:
    flows = PATTERNS[pattern]
    peers = [p for p in range(len(addresses)) if p != me]
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((addresses[me], PORT))
    listener.listen(64)
    finished: list[float] = []

    def read_all(conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        while conn.recv_into(buf):
            pass
        finished.append(time.time())

    def accept_all() -> None:
        for _ in range(len(peers) * flows):
            conn, _ = listener.accept()
            threading.Thread(target=read_all, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_all, daemon=True).start()
    time.sleep(1.0)  # every host listens before anyone connects
    conns = []
    for _ in range(flows):
        for k in range(1, len(addresses)):
            s = socket.create_connection((addresses[(me + k) % len(addresses)], PORT))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if pattern == "rotate":
                s.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, UNSENT)
            conns.append(s)
    per_conn = total // len(conns)
    data = memoryview(bytearray(PIECE))
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    if pattern == "rotate":
        left = [per_conn] * len(conns)
        while any(left):
            for i, s in enumerate(conns):
                n = min(PIECE, left[i])
                if n:
                    s.sendall(data[:n])
                    left[i] -= n
        for s in conns:
            s.shutdown(socket.SHUT_WR)
    else:

        def write_all(s: socket.socket) -> None:
            left = per_conn
            while left:
                n = min(PIECE, left)
                s.sendall(data[:n])
                left -= n
            s.shutdown(socket.SHUT_WR)

        writers = [threading.Thread(target=write_all, args=(s,)) for s in conns]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
    while len(finished) < len(conns):
        time.sleep(0.001)
    print(f"{(max(finished) - t0) * 1000:.1f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--bytes", default=str(int(1.5 * 25 * common.MIB)), help="per host, each way")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--host", type=int, help=argparse.SUPPRESS)
    p.add_argument("--addresses", help=argparse.SUPPRESS)
    p.add_argument("--pattern", choices=sorted(PATTERNS), help=argparse.SUPPRESS)
    p.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    total = common.parse_size(args.bytes)
    if args.host is not None:
        host_main(args.host, args.addresses.split(","), args.pattern, total, args.start_at)
        return 0
    if why := common.netns_cluster.unavailable_reason():
        sys.exit(f"tcp_all_to_all.py needs network namespaces, and {why}")
    with common.netns_cluster.running_cluster(args.hosts, args.rate) as cluster:
        goodput = common.netns_cluster.tcp_goodput(cluster)
        ideal_ms = total / goodput * 1000
        print(
            f"{args.hosts} hosts, {args.rate}; {total / 1e6:.1f} MB per host each way; "
            f"one TCP stream moves {goodput / 1e6:.1f} MB/s, so {ideal_ms:.0f} ms at best"
        )
        addresses = ",".join(h.address for h in cluster.hosts)
        for _ in range(args.repeats):
            for pattern in PATTERNS:
                start_at = time.time() + 3
                procs = [
                    subprocess.Popen(
                        [
                            *h.exec_prefix(),
                            sys.executable,
                            __file__,
                            "--bytes",
                            str(total),
                            "--host",
                            str(h.index),
                            "--addresses",
                            addresses,
                            "--pattern",
                            pattern,
                            "--start-at",
                            str(start_at),
                        ],
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    for h in cluster.hosts
                ]
                ms = [float(proc.communicate(timeout=120)[0]) for proc in procs]
                print(
                    f"{pattern:<13} received everything after "
                    f"{', '.join(f'{t:.0f}' for t in ms)} ms "
                    f"({ideal_ms / max(ms):.2f} of one stream's rate)",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
