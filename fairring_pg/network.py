"""Which local IPv4 address the rail listener binds to (the name of the variable,
``TP_SOCKET_IFNAME``, is the one Fairring and TensorPipe users already set)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from fairring_pg.config import Config, interface_ipv4

_LOCAL_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "::1"}


def listen_address(
    config: Config, environ: Mapping[str, str] = os.environ, single_host: bool = True
) -> str:
    """The address peers reach this rank on.

    Order: the IPv4 of ``TP_SOCKET_IFNAME``; else the source address the kernel would
    use to reach ``MASTER_ADDR`` (the rendezvous host is reachable, so the same route
    reaches us back); else loopback when ``MASTER_ADDR`` is unset or local and the job
    runs on one host; else the address the hostname resolves to.
    """
    if config.socket_ifname is not None:
        address = interface_ipv4(config.socket_ifname)
        if address is None:
            raise ValueError(
                f"TP_SOCKET_IFNAME={config.socket_ifname!r} has no IPv4 address: expected an "
                "interface with one"
            )
        return address
    master = environ.get("MASTER_ADDR", "").strip()
    if master and master.lower() not in _LOCAL_NAMES:
        return route_source_address(master, int(environ.get("MASTER_PORT", "0") or 0))
    if single_host:
        return "127.0.0.1"
    return _hostname_address()


def route_source_address(host: str, port: int = 0) -> str:
    """Local IPv4 address of the route to ``host``; connecting a UDP socket sends nothing."""
    try:
        infos = socket.getaddrinfo(host, port or 9, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError as exc:
        raise ValueError(
            f"MASTER_ADDR={host!r} does not resolve to an IPv4 address ({exc}); set "
            "TP_SOCKET_IFNAME to the interface fairring should listen on"
        ) from exc
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(infos[0][4])
        except OSError as exc:
            raise ValueError(
                f"MASTER_ADDR={host!r} ({infos[0][4][0]}) has no route from this machine "
                f"({exc}); set TP_SOCKET_IFNAME to the interface fairring should listen on"
            ) from exc
        return sock.getsockname()[0]


def _hostname_address() -> str:
    hostname = socket.gethostname()
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET)
    except OSError:
        infos = []
    for info in infos:
        address = info[4][0]
        if not address.startswith("127."):
            return address
    raise ValueError(
        "fairring cannot tell which address to listen on: the job spans several hosts, "
        f"MASTER_ADDR is unset and the hostname {hostname!r} resolves to no non-loopback "
        "IPv4 address; set TP_SOCKET_IFNAME to the interface fairring should listen on"
    )
