"""Emulated links: ZmqCommunicator holds a peer's message for latency + rows × seconds per row, one message after
another per source; runtimes are placed on nodes; emulated runtimes get NVLink or network delays per peer.

Delays are tens of ms. Only the early side is asserted against the clock, and strictly (a held message must never
come early): how late one comes depends on the machine's load, so the late side is asserted by order and spacing
within a run, and by `recv` returning well before its timeout (it waits for the hold, not for the timeout). The holds
are the communicator's own wall time (steady_clock in C++, no clock to inject), so those tests are marked slow."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from amoe import core
from amoe.config import AmoeConfig
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.links import runtime_nodes
from amoe.perf.model.models import model_profile
from amoe.runtime import build
from amoe.runtime import comm as runtime_comm

EARLY = 0.002  # clock slack between time.monotonic and the communicator's steady_clock


def message(n: int, tag: int = 0, hidden: int = 4) -> core.Message:
    """n rows whose request ids start at tag * 1000, so the receiver can tell messages apart."""
    return core.make_message(
        torch.zeros(n, hidden),
        request_id=[tag * 1000 + i for i in range(n)],
        kind=[core.EXPERT] * n,
        block=[0] * n,
        index=[0] * n,
        position=[0] * n,
    )


def tag_of(msg: core.Message) -> int:
    return int(msg.meta()["request_id"][0]) // 1000


@pytest.fixture
def trio():
    """Runtimes 0 and 1 send to runtime 2; trio(latency, per_row) sets 2's links from 0 (1 has none)."""
    made = []

    def make(latency: float, per_row: float):
        comms = [core.ZmqCommunicator(r, 3) for r in range(3)]
        made.extend(comms)
        comms[2].set_link_delays([latency, 0.0, 0.0], [per_row, 0.0, 0.0])
        for c in comms:
            c.connect([c.endpoint for c in comms])
        return comms

    yield make
    for c in made:
        c.close()


def arrivals(comm: core.ZmqCommunicator, n: int, t0: float, timeout: float = 3.0) -> list[tuple[int, float]]:
    """(tag, seconds after t0) of the next n messages, in the order recv returned them."""
    out: list[tuple[int, float]] = []
    while len(out) < n and time.monotonic() - t0 < timeout:
        for m in comm.recv(0.5):
            out.append((tag_of(m), time.monotonic() - t0))
    return out


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_message_held_for_latency_plus_rows(trio):
    a, _, rx = trio(0.03, 0.001)
    t0 = time.monotonic()
    a.send(2, message(20))
    assert rx.recv(0.01) == []  # arrived by now, most likely, but held
    got = rx.recv(10.0)
    elapsed = time.monotonic() - t0
    assert len(got) == 1 and got[0].num_rows == 20
    assert elapsed >= 0.05 - EARLY
    assert elapsed < 5.0  # woke at the hold's end (0.05 s), not at recv's 10 s timeout


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_back_to_back_messages_serialise_in_order(trio):
    a, _, rx = trio(0.02, 0.002)
    t0 = time.monotonic()
    for k in range(4):
        a.send(2, message(10, tag=k))
    got = arrivals(rx, 4, t0)
    assert [tag for tag, _ in got] == [0, 1, 2, 3]
    for k, (_, at) in enumerate(got, start=1):
        expected = k * 10 * 0.002 + 0.02  # the k-th waits for the k - 1 before it on the link
        assert at >= expected - EARLY, (k, at)


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_undelayed_peer_not_held_behind_delayed_one(trio):
    a, b, rx = trio(0.3, 0.0)
    t0 = time.monotonic()
    a.send(2, message(1, tag=0))
    time.sleep(0.01)  # so 0's message is in the inbox first
    b.send(2, message(1, tag=1))
    got = arrivals(rx, 2, t0)
    assert [tag for tag, _ in got] == [1, 0]  # 1's message overtook the held one
    assert got[1][1] >= 0.3 - EARLY


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_interrupt_wakes_recv_waiting_for_a_held_message(trio):
    a, _, rx = trio(5.0, 0.0)
    a.send(2, message(1))
    result = {}

    def wait():
        t = time.monotonic()
        result["got"] = rx.recv(10.0)
        result["waited"] = time.monotonic() - t

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.1)
    rx.interrupt()
    thread.join(2.0)
    assert not thread.is_alive()
    assert result["got"] == [] and result["waited"] < 2.0  # woken, and the message is still held


@pytest.mark.slow
@pytest.mark.timeout(30)
def test_stats_count_delayed_messages_not_local_or_undelayed_ones(trio):
    a, b, rx = trio(0.02, 0.001)
    t0 = time.monotonic()
    a.send(2, message(10, tag=0))
    a.send(2, message(10, tag=1))
    b.send(2, message(10, tag=2))  # no link delay from runtime 1
    rx.send(2, message(10, tag=3))  # to itself: never held
    assert len(arrivals(rx, 4, t0)) == 4
    s = rx.stats()
    assert s["delayed_messages"] == 2
    # Held 0.01 + 0.02, then 0.02 + 0.02 less the moment between the two arrivals (at most 0.01 counts).
    assert 0.06 - 0.001 <= s["delay_s"] <= 0.07 + 0.001
    assert a.stats()["delayed_messages"] == 0 and a.stats()["delay_s"] == 0.0


def test_set_link_delays_validates_and_comes_before_connect():
    with core.ZmqCommunicator(0, 2) as c:
        with pytest.raises(ValueError, match="2 latencies"):
            c.set_link_delays([0.0], [0.0])
        with pytest.raises(ValueError, match=">= 0"):
            c.set_link_delays([0.0, -1.0], [0.0, 0.0])
        c.set_link_delays([0.0, 0.01], [0.0, 0.001])
        c.connect([c.endpoint, c.endpoint])
        with pytest.raises(ValueError, match="before connect"):
            c.set_link_delays([0.0, 0.0], [0.0, 0.0])


# ---- node layout ----


@pytest.mark.parametrize(
    ("mode", "attn", "experts", "per_node", "nodes"),
    [
        ("ep", 4, 0, 2, [0, 0, 1, 1]),
        ("ep", 5, 0, 2, [0, 0, 1, 1, 2]),
        ("ep", 4, 0, 0, [0, 0, 0, 0]),
        ("aep", 2, 2, 2, [0, 1, 0, 1]),  # each node: one attention and one expert runtime
        ("aep", 4, 4, 4, [0, 0, 1, 1, 0, 0, 1, 1]),
        ("pingpong", 2, 6, 4, [0, 1, 0, 0, 0, 1, 1, 1]),
        ("aep", 1, 3, 2, [0, 0, 0, 1]),  # uneven: node 0 holds three
        ("aep", 2, 2, 8, [0, 0, 0, 0]),
        ("aep", 2, 2, 0, [0, 0, 0, 0]),
    ],
)
def test_runtime_nodes(mode, attn, experts, per_node, nodes):
    assert runtime_nodes(mode, attn, experts, per_node) == nodes


# ---- per-peer delays of an emulated deployment ----


def emulated(mode: str, attn: int, experts: int, per_node: int, time_scale: float = 10.0) -> AmoeConfig:
    return AmoeConfig.from_dict(
        {
            "parallel": {"mode": mode, "attn_ranks": attn, "expert_ranks": experts},
            "executor": {"kind": "emulated"},
            "emulation": {
                "gpu": "a100-40g", "profile": "mixtral-8x7b-mqa", "routing": "uniform",
                "time_scale": time_scale, "gpus_per_node": per_node,
            },
        }
    )  # fmt: skip


def expected(link, time_scale: float) -> tuple[float, float]:
    row_bytes = 4096 * 2  # Mixtral's hidden size in BF16, not the 16-float placeholder rows on the wire
    return link.latency * time_scale, row_bytes / link.usable_bandwidth * time_scale


def test_emulated_aep_delays_per_peer():
    config = emulated("aep", 2, 2, 2)  # nodes [0, 1, 0, 1]
    em = build.emulation(config, None)
    gpu = gpu_profile("a100-40g")
    nv, net = expected(gpu.nvlink, 10.0), expected(gpu.network, 10.0)
    latency, per_row = build.link_delays(config, em, rank=0)
    assert latency == pytest.approx([0.0, net[0], nv[0], net[0]])
    assert per_row == pytest.approx([0.0, net[1], nv[1], net[1]])
    assert per_row[1] == pytest.approx(8192 / 5e9 * 10)  # p4d EFA: 6.25 GB/s per GPU at 80 %
    latency, per_row = build.link_delays(config, em, rank=3)  # an expert runtime on node 1
    assert per_row == pytest.approx([net[1], nv[1], net[1], 0.0])
    assert model_profile("mixtral-8x7b-mqa").hidden_size == 4096


def test_emulated_ep_one_node_is_all_nvlink():
    config = emulated("ep", 4, 1, 0, time_scale=1.0)
    em = build.emulation(config, None)
    nv = expected(gpu_profile("a100-40g").nvlink, 1.0)
    latency, per_row = build.link_delays(config, em, rank=2)
    assert latency == pytest.approx([nv[0], nv[0], 0.0, nv[0]])
    assert per_row == pytest.approx([nv[1], nv[1], 0.0, nv[1]])


class _RecordingComm:
    def __init__(self, rank, num_runtimes, **kwargs):
        self.rank, self.delays = rank, None

    def set_link_delays(self, latency, per_row):
        self.delays = (latency, per_row)


@pytest.mark.parametrize("kind", ["emulated", "torch"])
def test_runtime_communicator_sets_delays_only_when_emulated(monkeypatch, kind):
    monkeypatch.setattr(core, "ZmqCommunicator", _RecordingComm, raising=False)
    config = emulated("aep", 2, 2, 2)
    if kind == "torch":
        config = config.replace(executor={"kind": "torch"}, emulation={"routing": "model"})
    em = build.emulation(config, None)  # None for torch
    spec = SimpleNamespace(runtime=1, data_bind="ipc", secure_bind=None, generation=0)
    comm, groups = runtime_comm.communicator(spec, 4, config, em)
    assert groups is None  # the inline plane: no tensor-plane groups
    assert comm.delays == (build.link_delays(config, em, 1) if em is not None else None)
