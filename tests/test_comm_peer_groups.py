"""The gloo plane with a group per peer (amoe.runtime.planes), in one process: sends wait for their pair's group and
then arrive intact; a replaced peer gets new groups while the survivors keep theirs (its old transfers are
cancelled, not failed); an announced payload the receiver has no memory for is received into a discard buffer, so
its sender's send completes and what follows arrives intact (skipping it would leave the send unmatched, and on a
plane that matches by order, NCCL, pair the next receive with it); with not even a discard buffer the pair fails
and nothing more is taken from that peer."""

from __future__ import annotations

import time

import pytest
from test_comm_basic import message, recv_n, same

from amoe import core
from amoe.runtime.faults import Faults
from amoe.runtime.planes import PeerGroups, pair_prefix

TIMEOUT_S = 3.0  # a transfer pending this long fails its peer
WAIT_S = 30.0  # hang guard for everything a test waits on


def make(rank: int, world: int, store, generation: int = 0):
    comm = core.ZmqCommunicator(
        rank, world, plane="gloo", peer_groups=True, generation=generation, timeout_s=TIMEOUT_S
    )
    return comm, PeerGroups(comm, rank, generation, str(store), "gloo", timeout_s=WAIT_S)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.01)


def mesh(tmp_path, world: int):
    """`world` communicators connected to each other, every pair's group built."""
    made = [make(r, world, tmp_path / "store") for r in range(world)]
    for comm, _ in made:
        comm.connect([c.endpoint for c, _ in made])
    for _, groups in made:
        groups.connect([0] * world)
    wait_until(lambda: all(g.linked() for _, g in made), "every pair linked")
    return made


def flows(src: core.ZmqCommunicator, dst: core.ZmqCommunicator, seed: int) -> None:
    """A 4 MB message and a small one from src reach dst bit-identical."""
    sent = [message(1024, 1024, seed=seed, tag=seed), message(3, 16, seed=seed + 1, tag=seed + 1)]
    for m in sent:
        src.send(dst.rank, m)
    got = recv_n(dst, 2, timeout=WAIT_S)
    assert len(got) == 2 and all(same(m, g) for m, g in zip(sent, got)), (src.rank, dst.rank)


def close_all(*comms) -> None:
    for c in comms:
        c.close()


def test_a_pair_prefix_names_both_generations_lower_runtime_first():
    assert pair_prefix(3, 1, {1: 0, 3: 2}) == pair_prefix(1, 3, {3: 2, 1: 0}) == "amoe/pair/1-3/0-2"


def test_the_alloc_fault_switch():
    assert Faults("alloc:3").alloc_failure == 3 and Faults("admit:5").alloc_failure is None
    with pytest.raises(ValueError):
        Faults("alloc:0")


@pytest.mark.timeout(120)
def test_sends_wait_for_their_pairs_group_then_arrive_intact(tmp_path):
    made = [make(r, 3, tmp_path / "store") for r in range(3)]
    comms = [c for c, _ in made]
    for c in comms:
        c.connect([c.endpoint for c in comms])
    sent = {dst: message(64, 256, seed=dst, tag=dst) for dst in (1, 2)}
    for dst, m in sent.items():
        comms[0].send(dst, m)  # no group yet: parked, not failed
    s = comms[0].stats()
    assert s["unlinked_peers"] == [1, 2] and s["backlog"] == 2 and s["failed_peers"] == []
    for _, groups in made:
        groups.connect([0, 0, 0])
    for dst, m in sent.items():
        got = recv_n(comms[dst], 1, timeout=WAIT_S)
        assert len(got) == 1 and same(m, got[0])
    for src in range(3):
        for dst in range(3):
            if src != dst:
                flows(comms[src], comms[dst], seed=10 * src + dst)
    for c in comms:
        s = c.stats()
        assert s["unlinked_peers"] == [] and s["failed_peers"] == [] and s["timeouts"] == 0
    close_all(*comms)


@pytest.mark.timeout(120)
def test_a_runtime_joins_an_empty_slot_and_gets_its_groups(tmp_path):
    """Communicators of three slots, the third held by no runtime: the two link with each other and wait for
    nothing more; a send to the empty slot is dropped and counted, no peer fails; a runtime that joins there gets
    its groups with both (as a Reconnect makes the others build them) and every pair carries data."""
    made = [make(r, 3, tmp_path / "store") for r in range(2)]
    first = [c.endpoint for c, _ in made]
    for comm, groups in made:
        comm.connect(first)  # two endpoints for three slots
        groups.connect({0: 0, 1: 0})
    wait_until(lambda: all(g.linked() for _, g in made), "the two linked")
    comms = [c for c, _ in made]
    flows(comms[0], comms[1], seed=1)
    comms[0].send(2, message(3, 16, seed=2))
    s = comms[0].stats()
    assert s["send_dropped"] == 1 and s["unlinked_peers"] == [] and s["failed_peers"] == [], s
    new, new_groups = make(2, 3, tmp_path / "store")
    new.connect([*first, new.endpoint])
    new_groups.connect({0: 0, 1: 0})
    for rank in (0, 1):
        comms[rank].reconnect(2, new.endpoint, 0)
        made[rank][1].rebuild(2, 0)
    wait_until(lambda: new_groups.linked() and all(g.linked() for _, g in made), "the new pairs linked")
    comms.append(new)
    for src in range(3):
        for dst in range(3):
            if src != dst:
                flows(comms[src], comms[dst], seed=100 + 10 * src + dst)
    assert all(c.stats()["failed_peers"] == [] for c in comms)
    close_all(*comms)


@pytest.mark.timeout(120)
def test_a_replaced_peer_gets_new_groups_and_the_survivors_keep_theirs(tmp_path):
    made = mesh(tmp_path, 3)
    comms = [c for c, _ in made]
    flows(comms[0], comms[1], seed=1)
    old = comms[1]  # kept alive: its groups' connections stay open, as a stopped process's would
    old.close()
    comms[0].send(1, message(1024, 1024, seed=2))  # a send the old process will never receive
    wait_until(lambda: comms[0].stats()["in_flight_send"] == 1, "the send to the old process posted")
    new, new_groups = make(1, 3, tmp_path / "store", generation=1)
    endpoints = [comms[0].endpoint, new.endpoint, comms[2].endpoint]
    new.connect(endpoints)
    for rank in (
        0,
        2,
    ):  # the survivors, as a Reconnect makes them (amoe.runtime.aep_runtime.AepRuntime.reconnect)
        comms[rank].reconnect(1, new.endpoint, 1)
        assert comms[rank].unlinked_peers() == [1]
        made[rank][1].rebuild(1, 1)
    resent = message(7, 64, seed=3, tag=3)
    comms[0].send(1, resent)  # waits for the new group
    new_groups.connect([0, 1, 0])
    wait_until(lambda: new_groups.linked() and all(g.linked() for _, g in made), "the new pairs linked")
    got = recv_n(new, 1, timeout=WAIT_S)
    assert len(got) == 1 and same(resent, got[0])
    comms[1] = new
    for src in range(3):
        for dst in range(3):
            if src != dst:
                flows(comms[src], comms[dst], seed=100 + 10 * src + dst)
    s = comms[0].stats()
    assert s["cancelled"] == 1 and s["timeouts"] == 0 and s["transfer_errors"] == 0, s
    assert s["in_flight_send"] == 0 and s["failed_peers"] == [] and comms[2].stats()["failed_peers"] == []
    with pytest.raises(ValueError, match="same generation"):  # its groups would meet the old rendezvous
        comms[0].reconnect(1, new.endpoint, 1)
    close_all(*comms, old)


@pytest.mark.timeout(120)
def test_an_announced_payload_without_memory_is_received_and_discarded(tmp_path):
    """The third of six transfers finds no receive buffer: the sender's send still completes (no timeout, no
    failed peer on either side), that message is dropped and counted, and the three after it arrive intact."""
    (sender, _), (receiver, _) = mesh(tmp_path, 2)
    receiver.inject_alloc_failure(skip=2)
    sent = [message(n, 1024, seed=i, tag=i) for i, n in enumerate((4, 1024, 1024, 8, 1024, 2))]
    for m in sent:
        sender.send(1, m)
    got = recv_n(receiver, 5, timeout=WAIT_S)
    assert [int(g.meta()["request_id"][0]) // 1_000_000 for g in got] == [0, 1, 3, 4, 5]
    assert all(same(sent[i], g) for i, g in zip((0, 1, 3, 4, 5), got))  # payload contents, not only ids
    # Twice the transfer timeout: a send left unmatched would have timed out and failed its peer by then.
    wait_until(lambda: sender.stats()["in_flight_send"] == 0, "every send completed")
    time.sleep(2 * TIMEOUT_S)
    s, r = sender.stats(), receiver.stats()
    assert r["dropped"]["no_memory"] == 1 and sum(r["dropped"].values()) == 1, r
    assert s["messages_out"] == 6 and s["in_flight_send"] == 0 and r["in_flight_recv"] == 0
    for stats in (s, r):
        assert stats["timeouts"] == 0 and stats["transfer_errors"] == 0 and stats["failed_peers"] == [], stats
    flows(sender, receiver, seed=9)  # and the pair keeps working
    close_all(sender, receiver)


@pytest.mark.timeout(120)
def test_without_even_a_discard_buffer_the_pair_fails_and_nothing_more_is_taken(tmp_path):
    (sender, _), (receiver, _) = mesh(tmp_path, 2)
    receiver.inject_alloc_failure(skip=1, discard=True)
    sent = [message(16, 64, seed=i, tag=i) for i in range(4)]
    for m in sent:
        sender.send(1, m)
    wait_until(lambda: receiver.stats()["dropped"]["no_memory"] == 3, "the failed one and the two after it")
    got = recv_n(receiver, 4, timeout=1.0)
    assert len(got) == 1 and same(sent[0], got[0])  # nothing out of order, nothing after the hole
    r = receiver.stats()
    assert r["failed_peers"] == [0] and "no memory" in r["last_error"] and r["in_flight_recv"] == 0
    close_all(sender, receiver)
