"""Control-plane sends are never lost in silence: a message ZeroMQ cannot hand on (nobody connected under that
identity yet, or a full queue) is counted, waits in the runtime's outbox with everything sent after it, and goes
out in order once it can; a runtime whose messages stay undelivered is lost and replaced like a dead one."""

from __future__ import annotations

import asyncio
import time

import zmq
from factories import AliveProcess

from amoe import wire
from amoe.config import AmoeConfig
from coordinator.cluster.control_plane import ControlPlane
from coordinator.cluster.runtimes import RuntimeProc
from coordinator.requests.cluster_backend import ClusterBackend


class _Launch:
    def __init__(self) -> None:
        self.spawned: list[tuple[int, str, int]] = []

    def spawn(self, runtime: int, role: str, generation: int = 0) -> AliveProcess:
        self.spawned.append((runtime, role, generation))
        return AliveProcess()

    def tick(self, now: float) -> None:
        pass


def _dealer(plane: ControlPlane, identity: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(plane.endpoint)
    return sock


def test_a_message_to_a_runtime_not_connected_yet_waits_and_goes_out_in_order():
    async def scenario() -> list[wire.Message]:
        plane = ControlPlane("ipc")
        try:
            assert not plane.send(b"rt3", wire.Abort(7))  # nobody is rt3 yet: refused, not dropped
            assert plane.send_failures == 1 and plane.pending(b"rt3") == 1
            assert not plane.send(b"rt3", wire.Abort(8))  # queued behind, not sent ahead of it
            assert plane.pending(b"rt3") == 2
            runtime = _dealer(plane, b"rt3")
            runtime.send(b"hi")  # a ROUTER learns the identity from the peer's first message
            await plane.recv()
            plane.flush()
            assert plane.pending(b"rt3") == 0 and not plane.overdue(0.0)
            got = [wire.decode(runtime.recv()) for _ in range(2)]
            runtime.close()
            return got
        finally:
            plane.close()

    assert asyncio.run(scenario()) == [wire.Abort(7), wire.Abort(8)]


def test_a_node_agents_message_is_counted_and_dropped_not_queued():
    async def scenario() -> ControlPlane:
        plane = ControlPlane("ipc")
        plane.send(b"node1", wire.Shutdown(), retry=False)
        plane.close()
        return plane

    plane = asyncio.run(scenario())
    assert plane.send_failures == 1 and plane.pending(b"node1") == 0


def test_a_runtime_whose_messages_stay_undelivered_is_replaced_and_its_outbox_dropped(tmp_path):
    async def scenario() -> tuple[ClusterBackend, list]:
        be = ClusterBackend(AmoeConfig(), tmp_path)
        cluster = be.cluster
        cluster.runtimes += [
            RuntimeProc(0, "attention", proc=AliveProcess(), num_kv_blocks=10, kv_free=10, ready=True),
            RuntimeProc(1, "expert", proc=AliveProcess(), ready=True),
        ]
        be._status = "ok"
        cluster.plane = cluster.watch.plane = ControlPlane("ipc")
        cluster.watch.launch, cluster.watch.started = _Launch(), True
        try:
            assert not cluster.send(1, wire.Abort(5))  # expert runtime 1 never connected
            now = time.monotonic()
            cluster.watch.check(now)  # not overdue yet: nothing happens
            assert cluster.runtimes[1].lost is None
            for r in cluster.runtimes:  # both still beat and progress: only the undelivered message counts
                r.last_seen = r.progressed = now + 60
            cluster.watch.check(now + cluster.watch.heartbeat_timeout_s + 1)
            return be, cluster.watch.launch.spawned
        finally:
            cluster.plane.close()

    be, spawned = asyncio.run(scenario())
    lost = be.cluster.runtimes[1]
    assert spawned == [(1, "expert", 1)] and "control messages to it went undelivered" in lost.lost
    assert be.cluster.send_failures >= 1 and be.control_send_failures == be.cluster.send_failures
    assert be.cluster.runtimes[0].lost is None
