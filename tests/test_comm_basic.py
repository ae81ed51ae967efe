"""ZmqCommunicator basics on the inline plane: messages arrive bit-identical with their metadata, in one process
and between two processes; misuse raises ValueError; close() is idempotent and says goodbye to peers."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from amoe import core

SPAWN = mp.get_context("spawn")


def message(n: int, hidden: int, dtype=torch.float32, seed: int = 0, tag: int = 0) -> core.Message:
    """n rows of random data ([n, hidden], or int64 token ids [n] when hidden == 0) with unique request ids."""
    gen = torch.Generator().manual_seed(seed)
    if hidden:
        data = torch.randn(n, hidden, generator=gen).to(dtype)
    else:
        data = torch.randint(0, 1 << 40, (n,), generator=gen)
    return core.make_message(
        data,
        request_id=[tag * 1_000_000 + i for i in range(n)],
        kind=[core.EXPERT] * n,
        block=torch.randint(0, 4, (n,), generator=gen),
        index=torch.randint(0, 8, (n,), generator=gen),
        position=torch.randint(0, 4096, (n,), generator=gen),
        weight=torch.rand(n, generator=gen),
    )


def same(a: core.Message, b: core.Message) -> bool:
    """Bit-identical rows and data (the header's sender field aside)."""
    return (
        a.to_bytes()[32:] == b.to_bytes()[32:]
        and a.data.dtype == b.data.dtype
        and a.data.shape == b.data.shape
        and torch.equal(a.data.contiguous().view(torch.uint8), b.data.contiguous().view(torch.uint8))
    )


def recv_n(comm: core.ZmqCommunicator, n: int, timeout: float = 10.0) -> list[core.Message]:
    out: list[core.Message] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += comm.recv(0.05)
    return out


@pytest.fixture(params=["ipc", "tcp://127.0.0.1:0"])
def pair(request):
    comms = [core.ZmqCommunicator(r, 2, bind=request.param) for r in range(2)]
    for c in comms:
        c.connect([c.endpoint for c in comms])
    yield comms
    for c in comms:
        c.close()


SHAPES = [(1, 8, torch.float32), (5, 0, torch.int64), (0, 16, torch.float32), (64, 96, torch.bfloat16),
          (300, 512, torch.float16), (1024, 1024, torch.float32)]  # fmt: skip


@pytest.mark.timeout(60)
def test_messages_arrive_bit_identical_in_order(pair):
    a, b = pair
    sent = [message(n, h, dt, seed=i, tag=i) for i, (n, h, dt) in enumerate(SHAPES)]
    for m in sent:
        a.send(1, m)
    got = recv_n(b, len(sent))
    assert len(got) == len(sent)
    for m, g in zip(sent, got):
        assert g.src_runtime == 0 and same(m, g)
    stats_a, stats_b = a.stats(), b.stats()
    assert stats_a["messages_out"] == stats_b["messages_in"] == len(sent)
    assert stats_a["bytes_out"] == stats_b["bytes_in"] == sum(m.data.nbytes for m in sent)
    assert stats_b["plane"] == "inline" and sum(stats_b["dropped"].values()) == 0


@pytest.mark.timeout(60)
def test_send_to_itself_goes_to_its_own_inbox(pair):
    a, _ = pair
    m = message(3, 4)
    a.send(0, m)
    (g,) = recv_n(a, 1)
    assert same(m, g) and a.stats()["messages_local"] == 1


@pytest.mark.timeout(60)
def test_misuse_raises_value_error(pair):
    a, _ = pair
    with pytest.raises(ValueError):
        a.send(2, message(1, 4))
    with pytest.raises(ValueError):
        a.connect([a.endpoint] * 2)  # already connected
    with pytest.raises(ValueError):
        core.ZmqCommunicator(0, 2, plane="carrier-pigeon")
    with pytest.raises(ValueError):
        core.ZmqCommunicator(0, 2, plane="gloo")  # needs a process group
    with pytest.raises(ValueError):
        core.ZmqCommunicator(2, 2)
    with pytest.raises(ValueError):
        core.ZmqCommunicator(0, 2, bind="udp://nowhere")
    c = core.ZmqCommunicator(0, 2)
    with pytest.raises(ValueError):
        c.connect([c.endpoint] * 3)  # more runtimes than slots (fewer: slots no runtime holds yet)
    c.close()
    with pytest.raises(ValueError):
        c.send(0, message(1, 4))


@pytest.mark.timeout(60)
def test_close_is_idempotent_and_peers_see_the_goodbye():
    a, b = (core.ZmqCommunicator(r, 2) for r in range(2))
    with a, b:
        a.connect([a.endpoint, b.endpoint])
        b.connect([a.endpoint, b.endpoint])
        a.close()
        a.close()
        deadline = time.monotonic() + 5
        while b.stats()["departed_peers"] != [0] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # past the grace period in which a dropped connection is judged
        assert b.stats()["departed_peers"] == [0] and b.failed_peers() == []
    assert a.closed and b.closed
    unconnected = core.ZmqCommunicator(0, 1)
    unconnected.close()


def _echo(conn) -> None:
    """Rank 1 of 2: sends every message it receives back to rank 0 until rank 0 says goodbye."""
    comm = core.ZmqCommunicator(1, 2)
    conn.send(comm.endpoint)
    comm.connect(conn.recv())
    with comm:
        while 0 not in comm.stats()["departed_peers"]:
            for m in comm.recv(0.05):
                comm.send(0, m)
        conn.send(comm.stats())


@pytest.mark.timeout(60)
def test_two_processes_echo():
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=_echo, args=(child,), daemon=True)
    proc.start()
    comm = core.ZmqCommunicator(0, 2)
    endpoints = [comm.endpoint, parent.recv()]
    parent.send(endpoints)
    comm.connect(endpoints)
    sent = [message(n, h, dt, seed=i, tag=i) for i, (n, h, dt) in enumerate(SHAPES * 3)]
    for m in sent:
        comm.send(1, m)
    got = recv_n(comm, len(sent), timeout=30)
    comm.close()
    child_stats = parent.recv()
    proc.join(10)
    assert len(got) == len(sent) and all(same(m, g) for m, g in zip(sent, got))
    assert child_stats["messages_in"] == child_stats["messages_out"] == len(sent)
    assert sum(child_stats["dropped"].values()) == 0
