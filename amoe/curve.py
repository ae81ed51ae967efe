"""The cluster secret and the CURVE keys a cross-host ZeroMQ socket uses (docs/communicator.md "CURVE").

One secret file (32+ random bytes) is all a host needs: both key pairs are derived from it, so no key ever crosses
the network and the rendezvous store carries nothing secret. Servers (the coordinator's control socket, each
runtime's data socket) use the server pair; clients use the client pair and must know the server's public key.
That public key is derived from the secret too and never published: CurveZMQ never sends it on the wire (a client
encrypts its HELLO to it), so a peer without the secret fails the handshake before any frame is read, and the
server counts it (`amoe_*_rejected_handshakes_total`). With no ZAP handler the server does not check the client's
key pair: holding the server's public key, i.e. the secret, is the admission ticket.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from amoe.errors import ConfigError

logger = logging.getLogger(__name__)

SECRET_BYTES = 32


@dataclass(frozen=True)
class ClusterKeys:
    """Z85 text, 40 characters each."""

    server_public: str
    server_secret: str
    client_public: str
    client_secret: str

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterKeys:
        server_secret = _derive(secret, b"amoe-curve-server")
        client_secret = _derive(secret, b"amoe-curve-client")
        return cls(
            server_public=zmq.curve_public(server_secret).decode(),
            server_secret=server_secret.decode(),
            client_public=zmq.curve_public(client_secret).decode(),
            client_secret=client_secret.decode(),
        )

    def as_dict(self) -> dict[str, str]:
        return {
            "server_public": self.server_public,
            "server_secret": self.server_secret,
            "client_public": self.client_public,
            "client_secret": self.client_secret,
        }

    def serve(self, sock: zmq.Socket) -> None:
        """The next endpoint `sock` binds requires CURVE with these keys (ZeroMQ copies options at bind)."""
        sock.curve_secretkey = self.server_secret.encode()
        sock.curve_server = True

    def client(self, sock: zmq.Socket) -> None:
        """The next connection of `sock` speaks CURVE to a server holding the same secret."""
        sock.curve_serverkey = self.server_public.encode()
        sock.curve_publickey = self.client_public.encode()
        sock.curve_secretkey = self.client_secret.encode()


def fingerprint(secret: bytes, salt: bytes) -> str:
    """A public check that two hosts hold the same secret: BLAKE2b keyed by it (as the keys are derived) over a
    random per-cluster salt. It reveals nothing of the secret short of a brute force of its 32+ random bytes."""
    return hashlib.blake2b(b"amoe-secret-fingerprint" + salt, key=secret[:64], digest_size=16).hexdigest()


def _derive(secret: bytes, purpose: bytes) -> bytes:
    """A CURVE secret key (Z85) from the cluster secret: BLAKE2b keyed by the secret, one purpose per pair."""
    raw = hashlib.blake2b(purpose, key=secret[:64], digest_size=32).digest()
    return z85.encode(raw)


def load_secret(path: str | Path) -> bytes:
    """The secret in `path`; a clear ConfigError if it is missing, short, or readable by others."""
    path = Path(path)
    try:
        data = path.read_bytes().strip()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read the cluster secret {path}: {exc.strerror}") from None
    if len(data) < SECRET_BYTES:
        raise ConfigError(f"the cluster secret {path} is too short ({len(data)} bytes; need {SECRET_BYTES}+)")
    if mode & 0o077:
        logger.warning("the cluster secret %s is readable by other users (chmod 600 it)", path)
    return data


def write_secret(path: str | Path) -> bytes:
    """A new random secret written to `path` (0600); what node 0 does when no secret file is given."""
    secret = secrets.token_hex(SECRET_BYTES).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return secret
