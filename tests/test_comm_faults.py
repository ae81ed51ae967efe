"""Malformed input and dead peers never stop a live receiver: garbage, truncated, wrong-version and inconsistent
frames are dropped and counted by kind while good traffic keeps flowing; a killed sender is reported."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import struct
import time

import pytest
import torch
import zmq
from test_comm_basic import message, recv_n, same

from amoe import core

SPAWN = mp.get_context("spawn")
TRANSFER = struct.Struct("<IHBBiIQQ")  # magic, version, kind, generation, src, tag, seq, nbytes (cpp/meta.h)
MAGIC, INLINE, TWO_PHASE, HELLO, BYE = 0x58544D41, 0, 1, 2, 3


def frames(msg: core.Message, src: int, *, kind=INLINE, version=1, nbytes=None, seq=0) -> list[bytes]:
    """The wire frames of an inline transfer, built independently of the C++ sender (docs/communicator.md)."""
    meta = bytearray(msg.to_bytes())
    struct.pack_into("<i", meta, 8, src)  # MessageHeader.src_runtime
    data = msg.data.contiguous().view(torch.uint8).numpy().tobytes()
    size = len(data) if nbytes is None else nbytes
    return [TRANSFER.pack(MAGIC, version, kind, 0, src, seq, seq, size) + bytes(meta), data]


def patched(frame: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(frame)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.fixture
def live():
    """A connected receiver (rank 0), a real peer (rank 1), and a raw PUSH socket posing as rank 2."""
    comms = [core.ZmqCommunicator(r, 3) for r in range(2)]
    endpoints = [c.endpoint for c in comms] + ["ipc:///nonexistent/amoe-test-rank-2"]
    for c in comms:
        c.connect(endpoints)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.linger = 0
    raw.connect(comms[0].endpoint)
    yield comms[0], comms[1], raw
    raw.close()
    ctx.term()
    for c in comms:
        c.close()


def good_traffic_flows(receiver, peer, raw, seed: int) -> None:
    """A message from the real peer and a hand-built one from the raw socket both arrive intact."""
    m1, m2 = message(7, 32, seed=seed, tag=seed), message(3, 0, seed=seed + 1, tag=seed + 1)
    peer.send(0, m1)
    raw.send_multipart(frames(m2, src=2))
    got = sorted(recv_n(receiver, 2, timeout=10), key=lambda g: g.src_runtime)
    assert len(got) == 2 and same(m1, got[0]) and same(m2, got[1])


def bad_frames() -> dict[str, list[list[bytes]]]:
    m = message(4, 16, seed=3)
    f0, data = frames(m, src=2)
    return {
        "garbage": [
            [b""],
            [b"hello"],
            [os.urandom(200)],
            [b"\0" * 32 + f0[32:], data],  # bad transfer magic
            [patched(f0, 32, "<I", 0xDEADBEEF), data],  # bad message magic
        ],
        "truncated": [
            [f0[:10]],
            [f0[:40]],
            [f0[:-1], data],
            [f0],  # inline without its payload frame
            [f0, data[:-4]],
        ],
        "version": [
            [patched(f0, 4, "<H", 2), data],
            [patched(f0, 36, "<H", 9), data],  # message layout version
            [patched(f0, 38, "<H", 40), data],  # row size
        ],
        "inconsistent": [
            [f0, data + b"x"],
            [f0, data, b"extra"],
            [f0 + b"\0" * 56, data],  # a row record more than num_rows
            [patched(f0, 24, "<Q", len(data) + 4), data],  # byte length vs shape
            [patched(f0, 44, "<i", 99), data],  # dtype
            [patched(f0, 44, "<i", 0), data],  # uint8: the byte count no longer matches
            [patched(f0, 8, "<i", 7), data],  # sender not a runtime
            [patched(f0, 8, "<i", 0), data],  # the receiver itself
            [patched(f0, 40, "<i", 1), data],  # header sender disagrees with the envelope
            [patched(f0, 6, "<B", TWO_PHASE)],  # a two-phase transfer on an inline communicator
            [patched(f0, 6, "<B", 9), data],  # unknown transfer kind
            [TRANSFER.pack(MAGIC, 1, HELLO, 0, 2, 0, 0, 0) + b"body"],
            [patched(f0, 48, "<q", -1), data],  # negative row count
        ],
    }


@pytest.mark.timeout(60)
def test_malformed_frames_are_dropped_counted_by_kind_and_traffic_still_flows(live):
    receiver, peer, raw = live
    good_traffic_flows(receiver, peer, raw, seed=10)
    expected = {}
    for kind, cases in bad_frames().items():
        for parts in cases:
            raw.send_multipart(parts)
        expected[kind] = len(cases)
        good_traffic_flows(receiver, peer, raw, seed=20 + len(expected) * 2)
    stats = receiver.stats()
    assert stats["dropped"] == expected | {
        "no_memory": 0
    }  # no_memory: a two-phase plane's (test_comm_peer_groups)
    assert stats["messages_in"] == 2 * (1 + len(expected))
    assert receiver.failed_peers() == []


@pytest.mark.timeout(120)
def test_random_corruption_never_breaks_the_receiver(live):
    """Every mutated message is either delivered intact-in-shape or dropped; none is lost, nothing crashes."""
    receiver, peer, raw = live
    rng = random.Random(0)
    base = [frames(message(n, h, seed=n, tag=n), src=2) for n, h in [(1, 8), (5, 0), (9, 24)]]
    num = 400
    for _ in range(num):
        f0, data = rng.choice(base)
        f0 = bytearray(f0)
        op = rng.randrange(4)
        if op == 0:  # flip bytes in the metadata
            for _ in range(rng.randint(1, 4)):
                f0[rng.randrange(len(f0))] ^= 1 << rng.randrange(8)
        elif op == 1:  # cut the metadata
            f0 = f0[: rng.randrange(len(f0))]
        elif op == 2:  # cut or grow the payload
            data = data[: rng.randrange(len(data) + 1)] + os.urandom(rng.choice([0, 0, 3]))
        else:  # drop or add frames
            parts = [bytes(f0)] if rng.random() < 0.5 else [bytes(f0), data, data]
            raw.send_multipart(parts)
            continue
        raw.send_multipart([bytes(f0), data])
    delivered, deadline = [], time.monotonic() + 20
    while time.monotonic() < deadline:
        delivered += receiver.recv(0.05)
        stats = receiver.stats()
        if len(delivered) + sum(stats["dropped"].values()) >= num:
            break
    for m in delivered:  # whatever got through is self-consistent
        assert m.num_rows == m.data.shape[0]
    assert len(delivered) + sum(receiver.stats()["dropped"].values()) == num
    good_traffic_flows(receiver, peer, raw, seed=99)


def _stream_then_die(conn) -> None:
    """Rank 1 of 3: streams messages to rank 0 forever (the test kills it)."""
    comm = core.ZmqCommunicator(1, 3)
    conn.send(comm.endpoint)
    comm.connect(conn.recv())
    i = 0
    while True:
        comm.send(0, message(64, 256, seed=i, tag=i))
        i += 1
        if i % 16 == 0:
            time.sleep(0.005)


# Slow: how soon the receiver reports the dead peer is wall time (seconds at most; the margin is wide).
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_killed_inline_sender_is_reported_and_the_receiver_keeps_serving():
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_stream_then_die, args=(child,), daemon=True)
    proc.start()
    receiver, other = core.ZmqCommunicator(0, 3), core.ZmqCommunicator(2, 3)
    endpoints = [receiver.endpoint, parent.recv(), other.endpoint]
    parent.send(endpoints)
    with receiver, other:
        receiver.connect(endpoints)
        other.connect(endpoints)
        assert len(recv_n(receiver, 20, timeout=30)) >= 20  # the stream is flowing
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        t0 = time.monotonic()
        while 1 not in receiver.failed_peers() and time.monotonic() - t0 < 30:
            receiver.recv(0.05)
        assert receiver.failed_peers() == [1]
        assert time.monotonic() - t0 < 10.0
        receiver.recv(0.5)  # whatever was already queued
        m = message(5, 8, seed=1)
        other.send(0, m)
        got = recv_n(receiver, 1)
        assert len(got) == 1 and same(m, got[0])
        assert "without a goodbye" in receiver.stats()["last_error"]
