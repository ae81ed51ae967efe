"""The coordinator's control-plane reader, driven with the frames runtimes send: whatever arrives, it acts only on
valid messages from the runtime they claim to come from, drops and counts the rest, and never stops reading.

(tests/test_hardening.py sends such frames to a live server's socket; here each check is exact.)"""

from __future__ import annotations

import asyncio
import threading

import pytest
from factories import AliveProcess

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import RequestFailed
from coordinator.cluster.manager import ClusterManager
from coordinator.cluster.runtimes import RuntimeProc
from coordinator.requests.backend import TokenDelta
from coordinator.requests.cluster_backend import ClusterBackend, _Stream


class _Launcher:
    def __init__(self) -> None:
        self.spawned: list[tuple[int, str]] = []
        self.generations: list[int] = []

    def spawn(self, runtime: int, role: str, generation: int = 0) -> AliveProcess:
        self.spawned.append((runtime, role))
        self.generations.append(generation)
        return AliveProcess()


def report(runtime: int, role: str, **fields) -> dict:
    return {"runtime": runtime, "role": role, **fields}


@pytest.fixture
def backend(tmp_path):
    """A ClusterBackend whose cluster has attention runtime 0 (rank 0) and expert runtime 1, both ready."""
    be = ClusterBackend(AmoeConfig(), tmp_path)
    be.cluster.runtimes = [
        RuntimeProc(0, "attention", proc=AliveProcess(), num_kv_blocks=10, kv_free=10, ready=True),
        RuntimeProc(1, "expert", proc=AliveProcess(), ready=True),
    ]
    be._status = "ok"
    be.deaths = []
    be.on_death = be.deaths.append
    be.sent = []  # (runtime, message) the coordinator would send
    be.cluster.send = lambda runtime, msg: be.sent.append((runtime, msg))
    return be


def beat(cluster: ClusterManager, runtime: int, identity: bytes, stats: dict) -> None:
    cluster.receive([identity, wire.encode(wire.Heartbeat(runtime, stats))])


def test_a_malformed_heartbeat_from_its_own_runtime_is_dropped_and_the_next_one_is_read(backend):
    cluster = backend.cluster
    bad = [
        report(1, "expert", depth=[["expert", -1, 0, 1]]),  # negative block
        report(1, "expert", depth=[["expert", 0, 0, float("nan")]]),
        report(1, "expert", depth="deep"),
        report(1, "expert", polls=-3),
        report(1, "attention"),  # not its role
        report(2, "expert"),  # another runtime's report
    ]
    for stats in bad:
        beat(cluster, 1, b"rt1", stats)
    assert cluster.num_dropped == len(bad) and cluster.runtimes[1].stats is None
    beat(cluster, 1, b"rt1", report(1, "expert", polls=7, comm=None))  # comm may be null
    assert cluster.num_dropped == len(bad)
    assert cluster.runtimes[1].polls == 7 and not backend.deaths


def test_frames_that_are_no_message_or_come_from_the_wrong_socket_are_dropped(backend):
    cluster = backend.cluster
    frames = [
        [b"rt1"],
        [b"rt1", b"\x02garbage"],
        [
            b"rt0",
            wire.encode(wire.Heartbeat(1, report(1, "expert"))),
        ],  # runtime 1's message on runtime 0's socket
        [b"rt7", wire.encode(wire.Heartbeat(7, report(7, "expert")))],  # no runtime 7
        [b"rt1", wire.encode(wire.Shutdown())],  # a command, not a runtime's message
        [
            b"rt1",
            wire.encode(wire.Hello(1, "attention", 7, "ipc://x", 0, 8, 8)),
        ],  # says hello in another role
    ]
    for f in frames:
        cluster.receive(f)
    assert cluster.num_dropped == len(frames) and not backend.deaths


def test_a_failed_data_link_reported_in_a_heartbeat_gets_that_peer_replaced(backend):
    cluster = backend.cluster
    cluster.watch.launch, cluster.watch.started = _Launcher(), True
    old = cluster.runtimes[1].proc
    beat(cluster, 0, b"rt0", report(0, "attention", comm={"failed_peers": [1]}))
    assert old.returncode == -9 and cluster.watch.launch.spawned == [(1, "expert")]
    assert cluster.runtimes[1].lost == "attention runtime 0 lost its data link to expert runtime 1"
    health = backend.health()
    assert health["status"] == "degraded" and "lost its data link" in health["reason"] and not backend.deaths


def test_a_failed_data_link_fails_a_cluster_that_cannot_heal(backend):
    """ep / pingpong cannot take a replacement: the loss is the cluster's end."""
    cluster = backend.cluster
    cluster.watch.launch, cluster.watch.started, cluster.watch.heals = _Launcher(), True, False
    beat(cluster, 0, b"rt0", report(0, "attention", comm={"failed_peers": [1]}))
    assert backend.deaths == ["attention runtime 0 lost its data link to expert runtime 1"]
    assert backend.health()["error"].endswith("lost its data link to expert runtime 1")
    assert not cluster.watch.launch.spawned


def test_only_a_requests_own_rank_reports_its_tokens(backend):
    """Tokens or an end from another runtime are dropped; an expert runtime may only fail the request."""
    stream = _Stream(0, 2, asyncio.Queue())
    backend._streams[5] = stream
    cluster = backend.cluster

    def tokens(runtime: int, token_ids, reason, error=None):
        msg = wire.TokenOut(runtime, [5], [token_ids], [reason], 3, error)
        cluster.receive([f"rt{runtime}.out".encode(), wire.encode(msg)])

    tokens(1, [9], None)
    tokens(1, [9], "stop")
    assert cluster.num_dropped == 2 and stream.queue.empty() and 5 in backend._streams
    tokens(0, [4], None)
    assert stream.queue.get_nowait() == TokenDelta([4], None)
    tokens(1, [], "error", "boom")  # an expert layer failed: the request ends, its rank is told to free it
    assert isinstance(stream.queue.get_nowait(), RequestFailed)
    assert 5 not in backend._streams and 5 in backend._aborting and backend.sent == [(0, wire.Abort(5))]
    tokens(1, [], "abort")  # not the rank: its blocks stay held back
    assert 5 in backend._aborting
    tokens(0, [], "abort")  # the rank confirms
    assert 5 not in backend._aborting and cluster.num_dropped == 3


def test_a_runtime_drops_and_reports_commands_it_cannot_use(tmp_path):
    """The runtime's side: garbage and commands not meant for its role are dropped, counted in its heartbeat's
    `dropped["control"]`, and it serves on until Shutdown."""
    import zmq

    from amoe.runtime.control import Channel, serve_commands

    class ExpertRuntime:
        id, role, kv_free_blocks = 1, "expert", 0

        def check(self):
            pass

        def expire_aborts(self):
            return []

        def resend_overdue(self):
            pass

        def placement_replies(self):
            return []

        placement_busy = False

        def stats(self):
            return report(1, "expert", dropped={"bad_row": 2})

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    endpoint = f"ipc://{tmp_path}/control"
    router.bind(endpoint)
    channel = Channel(ctx, endpoint, b"rt1")
    channel.send(wire.Ready(1))  # so the router knows the identity
    assert router.recv_multipart()[0] == b"rt1"
    for frame in (b"\x02garbage", wire.encode(wire.Abort(3)), wire.encode(wire.Ready(0))):
        router.send_multipart([b"rt1", frame])
    # Shutdown after the next heartbeat (every 0.5 s); the router has no other user meanwhile.
    later = threading.Timer(0.8, lambda: router.send_multipart([b"rt1", wire.encode(wire.Shutdown())]))
    later.start()
    serve_commands(channel, ExpertRuntime())
    later.join()
    beats = []
    while router.poll(100):
        msg = wire.decode(router.recv_multipart()[1])
        beats += [msg] if isinstance(msg, wire.Heartbeat) else []
    channel.close()
    router.close()
    ctx.term()
    assert len(beats) >= 2 and beats[-1].stats["dropped"] == {"bad_row": 2, "control": 3}
