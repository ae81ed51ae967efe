"""Where the nodes of one multi-node cluster find each other: torch.distributed's TCPStore at `--dist-init-addr`.

Node 0 hosts the store in a child process of its own (`python -m amoe.rendezvous`, so the coordinator never loads
torch) and publishes two public values there: its control plane's CURVE endpoint, and a fingerprint of its cluster
secret (amoe.curve.fingerprint: a keyed hash over a random salt, never the secret). A node agent waits for both; one
whose secret gives another fingerprint is refused at once with a line naming its secret file, instead of waiting out
--dist-timeout-s for a CURVE handshake that cannot succeed. Membership, liveness and everything after go over that authenticated control plane, so the store
holds nothing secret (it has no authentication of its own: keep it on the cluster network, docs/multinode.md).
The store listens on the --dist-init-addr address only, never on every interface.
"""

from __future__ import annotations

import argparse
import datetime
import hmac
import logging
import signal
import socket
import sys

from amoe.curve import fingerprint
from amoe.errors import ConfigError
from amoe.hostaddr import STORE_READY, parse_addr

logger = logging.getLogger(__name__)

CONTROL_KEY = "amoe/control"
SECRET_CHECK_KEY = "amoe/secret-check"  # "<salt hex>:<fingerprint>"


class Rendezvous:
    """A client of node 0's store (what a node agent uses)."""

    def __init__(self, addr: str, *, timeout_s: float) -> None:
        from torch.distributed import TCPStore

        host, port = parse_addr(addr)
        self.addr, self.timeout_s = addr, timeout_s
        try:
            self._store = TCPStore(
                host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=True
            )
        except (RuntimeError, OSError) as exc:
            raise ConfigError(
                f"cannot reach node 0's rendezvous store at {addr} within {timeout_s:.0f} s: {_first_line(exc)}"
            ) from None

    def control(self, secret: bytes, secret_file: str) -> str:
        """Node 0's control endpoint, waiting for it up to the timeout; a ConfigError naming `secret_file` if
        node 0's secret is another one."""
        try:
            self._store.wait([CONTROL_KEY, SECRET_CHECK_KEY], datetime.timedelta(seconds=self.timeout_s))
            control = self._store.get(CONTROL_KEY).decode()
            salt, _, expected = self._store.get(SECRET_CHECK_KEY).decode().partition(":")
        except (RuntimeError, OSError) as exc:
            raise ConfigError(
                f"node 0 did not publish its control endpoint at {self.addr} within {self.timeout_s:.0f} s: "
                f"{_first_line(exc)}"
            ) from None
        if not hmac.compare_digest(fingerprint(secret, bytes.fromhex(salt)), expected):
            raise ConfigError(
                f"the cluster secret in {secret_file} is not node 0's (its fingerprint differs): give this node "
                "the --cluster-secret-file node 0 uses"
            )
        return control


def host_store(addr: str, control: str, secret_check: str) -> None:
    """Node 0's store: listen at `addr` (that address only), publish `control` and `secret_check` (salt and
    fingerprint of the cluster secret), say STORE_READY, serve until killed."""
    from torch.distributed import TCPStore

    host, port = parse_addr(addr)
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family[0], socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(family[4])
        listener.listen(256)
    except OSError as exc:
        raise ConfigError(f"cannot host the rendezvous store at {addr}: {exc.strerror or exc}") from None
    # master_listen_fd: torch serves on our socket instead of binding every interface itself.
    store = TCPStore(
        host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True
    )
    store.set(SECRET_CHECK_KEY, secret_check)
    store.set(CONTROL_KEY, control)
    print(STORE_READY, flush=True)
    while True:
        signal.pause()  # until the coordinator dies (PR_SET_PDEATHSIG) or kills us


def main(argv: list[str] | None = None) -> int:
    from amoe.process import die_with_parent, name_process

    ap = argparse.ArgumentParser(prog="python -m amoe.rendezvous", description="node 0's rendezvous store")
    ap.add_argument("--addr", required=True)
    ap.add_argument("--control", required=True)
    ap.add_argument("--secret-check", required=True, help="<salt hex>:<fingerprint> (public)")
    ap.add_argument("--parent-pid", type=int, required=True)
    args = ap.parse_args(argv)
    name_process("amoe: rendezvous store")
    die_with_parent(args.parent_pid)
    try:
        host_store(args.addr, args.control, args.secret_check)
    except ConfigError as exc:
        print(f"amoe: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


if __name__ == "__main__":
    sys.exit(main())
