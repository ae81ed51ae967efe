"""The runtime's side of the control plane: a DEALER socket to the coordinator's ROUTER, the commands it carries
(AddRequest, Abort, Shutdown, Reconnect, the placement's joins and drains) applied to the runtime, heartbeats with the runtime stats, and token reports.

Threads: the worker's main thread owns the control socket (commands in, Hello / Ready / Heartbeat out); the loop
thread owns a second DEALER that only sends TokenOut after each head step. ZeroMQ sockets are not thread-safe, so
each has exactly one user; the coordinator's ROUTER takes both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from amoe import wire
from amoe.errors import AmoeError, EngineDeadError
from amoe.runtime.interface import Runtime
from amoe.runtime.requests import HeadOutput

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
_LINK_POLL_S = 0.01  # how often a runtime not yet Ready looks whether its groups are built
_PLACEMENT_POLL_S = 0.01  # how often a runtime with a join or drain under way looks for its answer
_LINGER_MS = 1000  # a Failed message sent just before exit must still leave


class Channel:
    """One DEALER connected to the coordinator; counts (never raises on) malformed inbound frames."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes, keys: Any = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, _LINGER_MS)
        if keys is not None and endpoint.startswith("tcp://"):  # another host: CURVE (amoe.curve)
            keys.client(self.sock)
        self.sock.connect(endpoint)
        self.num_dropped = 0

    def send(self, msg: wire.Message) -> None:
        self.sock.send(wire.encode(msg))

    def recv(self, timeout_s: float) -> wire.Message | None:
        """The next valid message, or None after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                return None
            frame = self.sock.recv()
            try:
                return wire.decode(frame)
            except wire.WireError as exc:
                self.num_dropped += 1
                logger.warning("dropped a control frame (%d so far): %s", self.num_dropped, exc)
        return None

    def wait_for(self, kind: type, timeout_s: float) -> Any:
        """The next message of type kind; other messages before it are logged and dropped."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            msg = self.recv(left)
            if isinstance(msg, kind):
                return msg
            if isinstance(msg, wire.Shutdown):
                raise EngineDeadError("the coordinator shut down during start-up")
            if msg is not None:
                logger.warning("ignored %s while waiting for %s", type(msg).__name__, kind.__name__)
        raise EngineDeadError(f"no {kind.__name__} from the coordinator within {timeout_s:.0f} s")

    def close(self) -> None:
        self.sock.close()


def token_publisher(channel: Channel, runtime: int) -> Callable[[HeadOutput], None]:
    """The loop's `publish`: one TokenOut per head step (called on the loop thread, which owns channel)."""

    def publish(out: HeadOutput) -> None:
        if not out.tokens:
            return
        rids, tokens, reasons = (list(col) for col in zip(*out.tokens))
        logprobs = [out.logprobs.get(rid) for rid in rids] if out.logprobs else None
        prompts = [out.prompt_logprobs.get(rid) for rid in rids] if out.prompt_logprobs else None
        channel.send(
            wire.TokenOut(
                runtime,
                rids,
                tokens,
                reasons,
                out.kv_free_blocks,
                out.error,
                logprobs=logprobs,
                prompt_logprobs=prompts,
            )  # fmt: skip
        )

    return publish


def serve_commands(channel: Channel, runtime: Runtime, ready: wire.Ready | None = None) -> None:
    """Apply the coordinator's commands and send heartbeats until Shutdown, and send `ready` once the runtime is
    linked to every peer; raises if the loop thread failed."""
    next_beat = 0.0
    while True:
        runtime.check()
        if ready is not None and runtime.linked():
            channel.send(ready)
            ready = None
        now = time.monotonic()
        if now >= next_beat:
            for request_id in runtime.expire_aborts():  # confirmed, so the coordinator stops holding their KV
                _report_end(channel, runtime, request_id, "abort")
            runtime.resend_overdue()
            stats = runtime.stats()
            stats["dropped"] = {**stats.get("dropped", {}), "control": channel.num_dropped}
            channel.send(wire.Heartbeat(runtime.id, wire.flatten_stats(stats)))
            next_beat = now + HEARTBEAT_S
        for reply in runtime.placement_replies():
            channel.send(reply)
        wait = next_beat - time.monotonic()
        if ready is not None:
            wait = min(wait, _LINK_POLL_S)  # not Ready yet: soon look again whether the groups are built
        if runtime.placement_busy:
            wait = min(wait, _PLACEMENT_POLL_S)  # a join or drain's answer should not wait for the heartbeat
        msg = channel.recv(max(0.0, wait))
        if isinstance(msg, wire.Shutdown):
            logger.debug("runtime %d: shutdown requested", runtime.id)
            return
        if msg is not None:
            _apply(channel, runtime, msg)


def _apply(channel: Channel, runtime: Runtime, msg: wire.Message) -> None:
    if isinstance(msg, (wire.Welcome, wire.Shutdown)) or (
        isinstance(msg, (wire.AddRequest, wire.Abort)) and runtime.role != "attention"
    ):
        channel.num_dropped += 1
        logger.warning("runtime %d: %s sent to an expert runtime dropped", runtime.id, type(msg).__name__)
    elif isinstance(msg, wire.AddRequest):
        _add_request(channel, runtime, msg)
    elif isinstance(msg, wire.Abort):
        if not runtime.abort(msg.request_id):
            # Unknown or already finished: confirm at once so the coordinator stops holding its KV.
            _report_end(channel, runtime, msg.request_id, "abort")
    elif isinstance(msg, wire.PLACEMENT_COMMANDS):
        _place(channel, runtime, msg)
    elif isinstance(msg, wire.Reconnect):
        resent = runtime.reconnect(msg.runtime, msg.endpoint, msg.generation)
        logger.info(
            "runtime %d: runtime %d rejoined; %d rows sent to it again", runtime.id, msg.runtime, resent
        )
    else:
        channel.num_dropped += 1
        logger.warning("runtime %d: unexpected %s dropped", runtime.id, type(msg).__name__)


def _place(channel: Channel, runtime: Runtime, msg: wire.Message) -> None:
    """A join or drain command; one that cannot be carried out is answered PlacementFailed (the coordinator keeps
    the old map), never raised into the control loop."""
    try:
        runtime.place(msg)
    except EngineDeadError as exc:  # no live placement here: a command for another kind of runtime
        channel.num_dropped += 1
        logger.warning("runtime %d: %s dropped: %s", runtime.id, type(msg).__name__, exc)
    except Exception as exc:  # noqa: BLE001 - a bad map must not stop the runtime
        logger.exception("runtime %d: %s of epoch %d failed", runtime.id, type(msg).__name__, msg.epoch)
        channel.send(wire.PlacementFailed(runtime.id, msg.epoch, f"{type(exc).__name__}: {exc}"))


def _add_request(channel: Channel, runtime: Runtime, msg: wire.AddRequest) -> None:
    """Admit one request; whatever goes wrong fails that request alone and the runtime serves on."""
    try:
        runtime.add_request(
            msg.request_id, msg.prompt, wire.from_wire_sampling(msg.params), msg.num_generated, msg.seq_ids
        )
    except AmoeError as exc:  # the request itself is bad (the runtime trusts no socket)
        _report_end(channel, runtime, msg.request_id, "rejected", f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - a bug admitting one request must not stop the runtime
        logger.exception("runtime %d: request %d failed on admission", runtime.id, msg.request_id)
        _report_end(channel, runtime, msg.request_id, "error", f"{type(exc).__name__}: {exc}")


def _report_end(
    channel: Channel, runtime: Runtime, request_id: int, reason: str, error: str | None = None
) -> None:
    free = runtime.kv_free_blocks
    channel.send(wire.TokenOut(runtime.id, [request_id], [[]], [reason], kv_free_blocks=free, error=error))
