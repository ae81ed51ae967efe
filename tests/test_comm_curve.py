"""CURVE on the data plane (docs/communicator.md "CURVE"): runtimes that hold the cluster secret reach each other's
second, tcp:// endpoint encrypted and authenticated; a peer with another secret, or a raw ZeroMQ client without
keys, fails the handshake before any frame is read (counted in `rejected_handshakes`); and a relay on the path sees
no plaintext — where without CURVE it sees the payload."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
import zmq
from test_comm_basic import recv_n, same

from amoe import core
from amoe.curve import ClusterKeys, load_secret, write_secret
from amoe.errors import ConfigError

KEYS = ClusterKeys.from_secret(b"s" * 64)
MARK = 1234.5678  # a payload value whose bytes are easy to look for on the wire


def marked(n: int = 64) -> core.Message:
    data = torch.full((n, 16), MARK, dtype=torch.float32)
    rows = {"kind": [core.EXPERT] * n, "block": [0] * n, "index": [0] * n, "position": [0] * n}
    return core.make_message(data, request_id=list(range(77_000, 77_000 + n)), **rows)


class Relay:
    """A TCP relay that forwards to `target` and keeps every byte that passes (a tap on the wire)."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self.target = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.seen = bytearray()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        while data := src.recv(65536):
            with self._lock:
                self.seen += data
            dst.sendall(data)

    def close(self) -> None:
        self.server.close()


def pair(keys: ClusterKeys | None, via_relay: bool = False):
    """Runtimes 0 and 1; with keys each also listens on tcp:// with CURVE and 0 reaches 1 there."""
    comms = [core.ZmqCommunicator(r, 2) for r in range(2)]
    if keys is None:
        comms = [core.ZmqCommunicator(r, 2, bind="tcp://127.0.0.1:0") for r in range(2)]
        endpoints = [c.endpoint for c in comms]
    else:
        endpoints = [c.listen_secure("tcp://127.0.0.1:0", **keys.as_dict()) for c in comms]
    relay = Relay(endpoints[1]) if via_relay else None
    if relay is not None:
        comms[0].connect([endpoints[0], relay.endpoint])
        comms[1].connect(endpoints)
    else:
        for c in comms:
            c.connect(endpoints)
    return comms, endpoints, relay


def close(comms, relay=None) -> None:
    for c in comms:
        c.close()
    if relay is not None:
        relay.close()


def test_peers_with_the_secret_talk_encrypted_and_a_tap_sees_no_plaintext():
    comms, _, relay = pair(KEYS, via_relay=True)
    try:
        sent = marked()
        comms[0].send(1, sent)
        assert same(recv_n(comms[1], 1)[0], sent)
        comms[1].send(0, marked(2))  # and back, over 0's own CURVE endpoint
        assert len(recv_n(comms[0], 1)) == 1
        time.sleep(0.2)
        assert len(relay.seen) > sent.data.numel() * 4  # the payload went through the tap...
        pattern = torch.full((4,), MARK).numpy().tobytes()
        assert pattern not in relay.seen  # ...but not in the clear
        assert comms[1].stats()["rejected_handshakes"] == 0
    finally:
        close(comms, relay)


def test_without_curve_the_same_tap_sees_the_payload():
    """The control: the tap finds the marked bytes when the path is not encrypted, so the test above can fail."""
    comms, _, relay = pair(None, via_relay=True)
    try:
        comms[0].send(1, marked())
        assert len(recv_n(comms[1], 1)) == 1
        time.sleep(0.2)
        assert torch.full((4,), MARK).numpy().tobytes() in relay.seen
    finally:
        close(comms, relay)


@pytest.mark.timeout(30)
def test_a_peer_with_another_secret_and_a_raw_client_get_no_frame_in():
    comms, endpoints, _ = pair(KEYS)
    stranger = core.ZmqCommunicator(0, 2)  # poses as runtime 0, with a secret of its own
    stranger.listen_secure("tcp://127.0.0.1:0", **ClusterKeys.from_secret(b"x" * 64).as_dict())
    stranger.connect([stranger.endpoint, endpoints[1]])
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)  # no keys at all
    raw.linger = 0
    raw.connect(endpoints[1])
    try:
        stranger.send(1, marked())
        raw.send_multipart([b"AMTX" + bytes(60), bytes(64)])
        deadline = time.monotonic() + 10
        while comms[1].stats()["rejected_handshakes"] < 2:
            assert time.monotonic() < deadline, comms[1].stats()
            time.sleep(0.05)
        assert recv_n(comms[1], 1, timeout=0.5) == []
        assert sum(comms[1].stats()["dropped"].values()) == 0  # refused before any frame was read
        comms[0].send(1, marked(3))  # the real runtime 0 still gets through
        assert len(recv_n(comms[1], 1)) == 1
    finally:
        raw.close()
        ctx.term()
        close([*comms, stranger])


def test_listen_secure_refuses_misuse():
    c = core.ZmqCommunicator(0, 1)
    try:
        with pytest.raises(ValueError, match="tcp://"):
            c.listen_secure("ipc:///tmp/x", **KEYS.as_dict())
        with pytest.raises(ValueError, match="40 Z85"):
            c.listen_secure("tcp://127.0.0.1:0", "short", "short", "short", "short")
        c.listen_secure("tcp://127.0.0.1:0", **KEYS.as_dict())
        with pytest.raises(ValueError, match="already"):
            c.listen_secure("tcp://127.0.0.1:0", **KEYS.as_dict())
    finally:
        c.close()


def test_the_secret_file(tmp_path):
    secret = write_secret(tmp_path / "secret")
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600
    assert load_secret(tmp_path / "secret") == secret
    assert ClusterKeys.from_secret(secret) == ClusterKeys.from_secret(load_secret(tmp_path / "secret"))
    assert ClusterKeys.from_secret(secret) != ClusterKeys.from_secret(b"y" * 64)
    (tmp_path / "short").write_text("abc")
    with pytest.raises(ConfigError, match="too short"):
        load_secret(tmp_path / "short")
    with pytest.raises(ConfigError, match="cannot read"):
        load_secret(tmp_path / "missing")
