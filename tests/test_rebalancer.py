"""The coordinator's Rebalancer (coordinator/cluster/rebalance.py) driven by hand: the order of a move (joins, then
the switch, then drains, then frees), what a failure before and after the switch leaves, runtimes lost or replaced
on the way, answers that answer nothing, the periodic trigger, and the load window it plans from."""

from __future__ import annotations

import asyncio

import pytest
from factories import AliveProcess

from amoe import wire
from amoe.config import AmoeConfig
from amoe.errors import ConfigError
from amoe.expert_map import ExpertMap
from coordinator.cluster.expert_load import ExpertLoad
from coordinator.cluster.rebalance import RebalanceBusy, Rebalancer
from coordinator.cluster.runtimes import RuntimeProc

NB, E = 2, 4
HOMES = {2: [(b, e) for b in range(NB) for e in (0, 2)], 3: [(b, e) for b in range(NB) for e in (1, 3)]}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(**eplb):
    """Attention runtimes 0, 1 and expert runtimes 2, 3 (experts 0, 2 and 1, 3), welcomed and serving."""
    config = AmoeConfig().replace(parallel={"attn_ranks": 2, "expert_ranks": 2}, eplb=eplb)
    runtimes = [
        RuntimeProc(i, "attention" if i < 2 else "expert", AliveProcess(), ready=True) for i in range(4)
    ]
    sent: list[tuple[int, wire.Message]] = []
    clock = Clock()
    r = Rebalancer(config, runtimes, lambda rt, msg: sent.append((rt, msg)) is None, [0] * 4, clock=clock)
    for rt in runtimes:
        hosted = [list(x) for x in HOMES.get(rt.id, [])]
        r.on_hello(rt, wire.Hello(rt.id, rt.role, 1, "ipc://x", 0, 16, 16, num_blocks=NB, num_expert_ids=E,
                                  hosted=hosted))  # fmt: skip
    for rt in runtimes:
        assert r.welcome(rt).epoch == 0
    return r, runtimes, sent, clock


def kinds(sent) -> list[tuple[int, str]]:
    out = [(rt, type(msg).__name__) for rt, msg in sent]
    sent.clear()
    return out


def with_entries(m: ExpertMap, **changes) -> ExpertMap:
    table = m.table()
    for key, where in changes.items():
        b, e = (int(x) for x in key[1:].split("_"))
        table[b][e] = where
    return ExpertMap.of(table)


def test_a_move_joins_then_switches_then_drains_then_frees():
    r, rts, sent, _ = make()
    target = with_entries(
        r.map, b0_0=[3], b1_1=[2, 3]
    )  # (0, 0) moves from 2 to 3; (1, 1) gets a replica on 2
    epoch = r.start(target, "test")
    assert epoch == 1 and kinds(sent) == [(2, "LoadExperts"), (3, "LoadExperts")]
    assert r.on_message(rts[3], wire.ExpertsLoaded(3, 1, [[0, 0]], 100))
    assert (
        sent == [] and r.map != target
    )  # runtime 2 has not landed: nobody routes to runtime 3's new replica
    assert r.on_message(rts[2], wire.ExpertsLoaded(2, 1, [[1, 1]], 100))
    assert kinds(sent) == [(0, "SetExpertMap"), (1, "SetExpertMap")] and r.map == target and r.epoch == 1
    assert r.on_message(rts[0], wire.Drained(0, 1)) and sent == []  # rank 1 may still owe rows to (0, 0) on 2
    assert r.on_message(rts[1], wire.Drained(1, 1))
    assert kinds(sent) == [(2, "DropExperts")] and (0, 0) not in r.hosted[2]
    assert r.on_message(rts[2], wire.ExpertsDropped(2, 1, [[0, 0]], 100))
    assert r.move is None and r.counters.rebalances == {
        "started": 1,
        "completed": 1,
        "failed": 0,
        "unchanged": 0,
    }
    assert (r.counters.moved_bytes, r.counters.freed_bytes, r.counters.joins, r.counters.drains) == (
        200,
        100,
        2,
        1,
    )
    assert asyncio.run(r.wait(1)) == "completed"


def test_a_load_that_fails_cancels_the_joins_and_the_old_map_serves_on():
    r, rts, sent, _ = make()
    old = r.map
    epoch = r.start(with_entries(old, b0_0=[2, 3], b0_1=[2, 3]), "test")
    kinds(sent)
    assert r.on_message(rts[3], wire.ExpertsLoaded(3, epoch, [[0, 0]], 100))
    assert r.on_message(rts[2], wire.PlacementFailed(2, epoch, "InjectedFault: injected join fault"))
    assert kinds(sent) == [
        (2, "DropExperts"),
        (3, "DropExperts"),
    ]  # what landed goes, what loads is cancelled
    assert r.move is None and r.map == old and r.epoch == 0 and r.counters.rebalances["failed"] == 1
    assert r.hosted[3] == set(HOMES[3]) and "injected" in r.last_error
    assert r.on_message(rts[3], wire.ExpertsDropped(3, epoch, [[0, 0]], 100))  # a late answer: harmless
    assert r.start(with_entries(old, b1_3=[2, 3]), "test") == 2  # epochs never repeat


def test_a_joiner_lost_or_too_slow_fails_the_move():
    r, rts, sent, clock = make(join_timeout_s=5.0)
    r.start(with_entries(r.map, b0_0=[2, 3]), "test")
    rts[3].lost, rts[3].spawned = "killed", 1
    r.tick()
    assert r.move is None and "lost during its join" in r.last_error
    assert kinds(sent) == [(3, "LoadExperts")]  # no drop sent to the dead process
    assert r.welcome(rts[3]).hosted == [list(x) for x in HOMES[3]]  # its replacement starts without the join
    rts[3].lost = None
    r.start(with_entries(r.map, b0_0=[2, 3]), "test")
    clock.now = 6.0
    r.tick()
    assert r.move is None and "join_timeout_s" in r.last_error and r.counters.rebalances["failed"] == 2


def test_an_attention_runtime_that_cannot_take_the_map_sends_everyone_back():
    r, rts, sent, _ = make()
    old = r.map
    epoch = r.start(with_entries(old, b0_0=[3]), "test")
    r.on_message(rts[3], wire.ExpertsLoaded(3, epoch, [[0, 0]], 100))
    kinds(sent)
    assert r.on_message(rts[1], wire.PlacementFailed(1, epoch, "bad map"))
    assert r.move.reason == "rollback" and r.map == old and r.epoch == epoch + 1
    assert kinds(sent) == [(0, "SetExpertMap"), (1, "SetExpertMap")]
    for rt in rts[:2]:
        r.on_message(rt, wire.Drained(rt.id, epoch + 1))
    assert kinds(sent) == [(3, "DropExperts")]  # the replica that joined drains again
    r.on_message(rts[3], wire.ExpertsDropped(3, epoch + 1, [[0, 0]], 100))
    assert r.move is None and r.counters.rebalances == {
        "started": 2,
        "completed": 1,
        "failed": 1,
        "unchanged": 0,
    }


def test_a_replaced_attention_runtime_owes_no_drain():
    r, rts, sent, _ = make()
    epoch = r.start(with_entries(r.map, b0_0=[3]), "test")
    r.on_message(rts[3], wire.ExpertsLoaded(3, epoch, [[0, 0]], 100))
    r.on_message(rts[0], wire.Drained(0, epoch))
    assert (
        r.welcome(rts[1]).replicas == r.map.table()
    )  # its replacement starts on the new map: nothing sent before
    r.tick()
    assert r.move.phase == "free"


def test_answers_that_answer_nothing_are_refused():
    r, rts, sent, _ = make()
    epoch = r.start(with_entries(r.map, b0_0=[2, 3]), "test")
    assert not r.on_message(rts[3], wire.ExpertsLoaded(3, epoch + 7, [[0, 0]], 1))  # an epoch never used
    assert not r.on_message(rts[3], wire.ExpertsLoaded(3, epoch, [[1, 1]], 1))  # layers nobody asked it for
    assert not r.on_message(
        rts[2], wire.ExpertsLoaded(2, epoch, [[0, 0]], 1)
    )  # a runtime that was not joining
    assert not r.on_message(rts[0], wire.ExpertsLoaded(0, epoch, [[0, 0]], 1))  # from an attention runtime
    assert not r.on_message(rts[3], wire.Drained(3, epoch))  # a drain answer from an expert runtime
    assert r.move.phase == "join"


def test_a_move_waits_its_turn_and_a_map_must_fit_the_cluster():
    r, rts, _, _ = make()
    with pytest.raises(ConfigError, match="not an expert runtime"):
        r.start(with_entries(r.map, b0_0=[0]), "test")
    with pytest.raises(ConfigError, match="blocks"):
        r.start(ExpertMap.of([[[2]] * E]), "test")
    r.start(with_entries(r.map, b0_0=[2, 3]), "test")
    with pytest.raises(RebalanceBusy, match="under way"):
        r.start(r.map, "test")
    r.move = None
    rts[1].lost = "gone"
    with pytest.raises(RebalanceBusy, match="being replaced"):
        r.start(r.map, "test")
    rts[1].lost = None
    assert r.start(r.map, "test") == r.epoch and r.counters.rebalances["unchanged"] == 1


def report(runtime: int, steps: int, routed) -> dict:
    return {"routed": routed, "batches": {("attn", NB, runtime): steps}}


def test_the_periodic_rebalance_starts_every_step_interval_on_the_window_load():
    r, rts, sent, _ = make(enable=True, window_size=10, step_interval=10, num_redundant_experts=2)
    hot = [[90, 5, 5, 5], [5, 5, 90, 5]]
    r.on_report(rts[0], report(0, 5, hot))
    r.on_report(rts[1], report(1, 5, hot))
    r.tick()
    assert r.move is None and not r._planning  # 5 steps: not due

    async def due() -> None:
        r.on_report(rts[0], report(0, 12, [[2 * x for x in row] for row in hot]))
        r.on_report(rts[1], report(1, 12, [[2 * x for x in row] for row in hot]))
        r.tick()
        for _ in range(2000):  # the plan runs on an executor thread
            if r.move is not None:
                return
            await asyncio.sleep(0.001)

    asyncio.run(due())
    assert r.move is not None and r.move.reason == "periodic"
    assert {rt for rt, msg in sent if isinstance(msg, wire.LoadExperts)} <= {2, 3}
    counts = r.move.target.counts()
    assert counts[0][0] == 2 and counts[1][2] == 2  # the hot experts get the redundant replicas


def test_the_load_window_counts_the_last_window_size_steps_across_restarts():
    load = ExpertLoad(window_size=10, num_blocks=1, num_experts=2)
    load.report(0, {"routed": [[4, 0]], "batches": {("attn", 1, 0): 4}, "incarnation": "a"})
    load.report(0, {"routed": [[10, 2]], "batches": {("attn", 1, 0): 10}, "incarnation": "a"})
    assert load.steps == 10 and load.window().tolist() == [[10, 2]]  # the window reaches back to the start
    load.report(0, {"routed": [[3, 3]], "batches": {("attn", 1, 0): 5}, "incarnation": "b"})  # a new process
    assert load.steps == 15 and load.total().tolist() == [[13, 5]]
    assert load.window().tolist() == [[9, 5]]  # since step 5 (the snapshot at step 4, the newest <= 15 - 10)
    load.report(
        0, {"routed": [[13, 3]], "batches": {("attn", 1, 0): 12}, "incarnation": "c"}
    )  # above: still new
    assert load.steps == 27 and load.total().tolist() == [[26, 8]]


def test_placement_messages_are_typed_versioned_and_ranged():
    import msgspec

    state = wire.PlacementState(3, [[[2, 3], [2]]], [(0, 1)])
    for msg in (
        wire.LoadExperts(1, [(0, 1), (3, 7)]), wire.DropExperts(2, [(0, 1)]), wire.SetExpertMap(3, [(0, 1, [2, 3])]),
        wire.ExpertsLoaded(2, 1, [(0, 1)], 4096), wire.ExpertsDropped(2, 2, [], 0), wire.Drained(0, 3),
        wire.PlacementFailed(3, 1, "boom"), wire.Welcome(["ipc://a"], [0], state),
        wire.Hello(2, "expert", 1, "ipc://a", 0, 16, 16, num_blocks=2, num_expert_ids=4, hosted=[(0, 1)]),
    ):  # fmt: skip
        assert wire.decode(wire.encode(msg)) == msg
    for bad in ([21, 1, [[70000, 0]]], [21, -1, []], [9, 0, 1], [23, 1, [[0, 1, [-2]]]]):
        with pytest.raises(
            wire.WireError
        ):  # out of range, or a field missing: dropped and counted, never acted on
            wire.decode(bytes([wire.PROTOCOL_VERSION]) + msgspec.msgpack.encode(bad))


def test_a_join_that_keeps_loading_layers_is_never_late():
    """join_timeout_s bounds a stall, not a join's size: each heartbeat that shows another layer loaded restarts
    it; a join that stops loading fails once it has passed."""
    r, rts, sent, clock = make(join_timeout_s=5.0)
    r.start(with_entries(r.map, b0_0=[2, 3], b1_0=[2, 3]), "test")
    for second, loaded in ((4.0, 0), (8.0, 1), (12.0, 2)):  # 12 s in all, never 5 without a layer
        clock.now = second
        r.on_report(rts[3], {"runtime": 3, "role": "expert", "loaded_layers": loaded})
        r.tick()
        assert r.move is not None and r.move.phase == "join", second
    clock.now = 16.0
    r.on_report(rts[3], {"runtime": 3, "role": "expert", "loaded_layers": 2})  # no new layer
    r.tick()
    assert r.move is not None
    clock.now = 17.5
    r.tick()
    assert r.move is None and "loaded no layer" in r.last_error
