"""Host addresses of a multi-node cluster: `--dist-init-addr` parsed, and this host's address on the route to it
(the default `--node-ip`)."""

from __future__ import annotations

import socket

from amoe.errors import ConfigError


def parse_addr(addr: str) -> tuple[str, int]:
    """HOST:PORT of --dist-init-addr (IPv6 in brackets)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--dist-init-addr must be HOST:PORT; got {addr!r}")
    return host.strip("[]"), int(port)


def route_ip(addr: str) -> str:
    """This host's address on the route to `addr`: what the other nodes can reach it at."""
    host, port = parse_addr(addr)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    except OSError as exc:
        raise ConfigError(f"cannot resolve --dist-init-addr host {host!r}: {exc}") from None
    with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
        probe.connect(family[4])  # UDP: picks the route and the source address, sends nothing
        return probe.getsockname()[0]


# What node 0's rendezvous store process (amoe.rendezvous) prints on stdout once it serves.
STORE_READY = "ready"
