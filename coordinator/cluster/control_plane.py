"""The coordinator's end of the control plane: one ROUTER socket (zmq.asyncio, on the API's event loop) that every
runtime and node agent connects to by identity ("rt<id>", "rt<id>.out", "node<n>"), and the private run directory
(0700) its ipc endpoint and the runtimes' data sockets live in.

Sends never block and are never lost in silence. The socket is ROUTER_MANDATORY, so a message ZeroMQ cannot hand on
(no connection under that identity, or its queue is full) raises instead of vanishing; zmq.asyncio puts that error on
the send's future, which is checked at once. A runtime's undelivered message waits in that runtime's outbox, with
everything sent to it after (order matters: an Abort must not overtake its AddRequest), and is retried every watchdog
tick; `overdue()` names runtimes whose outbox has not moved for a while, and the cluster manager then treats the
runtime as lost. Every message that could not go at once is counted (`send_failures`).
"""

from __future__ import annotations

import collections
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from amoe import wire

logger = logging.getLogger(__name__)


@dataclass
class _Waiting:
    frames: list[bytes]
    since: float  # when its first attempt failed


class ControlPlane:
    """The ROUTER socket and run directory of one cluster; every method runs on the event loop."""

    def __init__(self, bind: str = "ipc") -> None:
        """`bind`: "ipc" (one host: a socket in the run directory) or "tcp://host" (a random port there)."""
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a replacement takes over its runtime's identity
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an undeliverable message raises (see the docstring)
        self.run_dir: str | None = tempfile.mkdtemp(
            prefix="amoe-"
        )  # private (0700): this user's processes only
        if bind == "ipc":
            self.endpoint, self.tcp_host = f"ipc://{self.run_dir}/control", None
            self.sock.bind(self.endpoint)
        else:
            host = bind.removeprefix("tcp://").rsplit(":", 1)[0]
            port = self.sock.bind_to_random_port(f"tcp://{host}")
            self.endpoint, self.tcp_host = f"tcp://{host}:{port}", f"tcp://{host}"
        self.send_failures = 0  # messages ZeroMQ could not take at once
        self.rejected_handshakes = 0  # connections to the CURVE endpoint refused (multi-node)
        self._outbox: dict[bytes, collections.deque[_Waiting]] = {}
        logger.debug("control plane on %s", self.endpoint)

    @property
    def closed(self) -> bool:
        return self.sock is None

    # ---- sending

    def send(self, identity: bytes, msg: wire.Message, *, retry: bool = True) -> bool:
        """Hand `msg` to ZeroMQ for `identity`; False if it could not be yet. With `retry` (runtime messages) it
        then waits in the identity's outbox, behind which later messages queue; without (node agents, whose own
        keep-alives notice a lost agent) it is counted and dropped."""
        if self.sock is None:  # shut down already
            return False
        frames = [identity, wire.encode(msg)]
        waiting = self._outbox.get(identity)
        if waiting:  # keep the order: behind what already waits
            waiting.append(_Waiting(frames, time.monotonic()))
            return False
        if self._try(frames):
            return True
        self.send_failures += 1
        if self.send_failures == 1:
            logger.warning(
                "a control message to %r could not be sent at once (counted from now on)", identity
            )
        if retry:
            self._outbox.setdefault(identity, collections.deque()).append(_Waiting(frames, time.monotonic()))
        return False

    def _try(self, frames: list[bytes]) -> bool:
        future = self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        # With NOBLOCK and no blocking send ever queued on this socket, zmq.asyncio resolves the future before it
        # returns; its exception is the send's error.
        error = future.exception() if future.done() else None
        if error is not None and not isinstance(error, zmq.ZMQError):
            logger.warning("a control message to %r could not be sent: %r", frames[0], error)
        return error is None

    def flush(self) -> None:
        """Retry every outbox, oldest message first; stop at an identity's first message that still fails."""
        for identity, waiting in list(self._outbox.items()):
            while waiting and self._try(waiting[0].frames):
                waiting.popleft()
            if not waiting:
                del self._outbox[identity]

    def overdue(self, older_than_s: float, now: float | None = None) -> list[bytes]:
        """Identities whose oldest undelivered message has waited longer than `older_than_s` at `now`."""
        now = time.monotonic() if now is None else now
        return [
            identity for identity, waiting in self._outbox.items() if now - waiting[0].since > older_than_s
        ]

    def forget(self, identity: bytes) -> int:
        """Drop what waits for `identity` (its process was replaced: those messages were for the old one)."""
        return len(self._outbox.pop(identity, ()))

    def pending(self, identity: bytes) -> int:
        return len(self._outbox.get(identity, ()))

    # ---- receiving

    async def recv(self) -> list[bytes]:
        return await self.sock.recv_multipart()

    async def watch_handshakes(self) -> None:
        """Count (and log once) connections to the CURVE control endpoint that fail the handshake: a host
        without the cluster secret, or a plain ZeroMQ client."""
        events = (
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )  # fmt: skip
        monitor = self.sock.get_monitor_socket(events)
        try:
            while True:
                await monitor.recv_multipart()  # one event: [event id + value, endpoint]
                self.rejected_handshakes += 1
                if self.rejected_handshakes == 1:
                    logger.warning("refused a connection without the cluster's keys (counted from now on)")
        finally:
            monitor.close()

    def close(self) -> None:
        """Close the socket and remove the run directory; idempotent."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self.run_dir = None
