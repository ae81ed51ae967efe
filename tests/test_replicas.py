"""Replicas in the engine and the executor (docs/rebalancing.md): the dispatcher's replica rule against a Python
oracle, an attention engine routing rows to replicas and counting what each still owes, an expert engine taking
and dropping layers while serving, and an expert executor whose layers come and go with the same floats."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_comm_basic import recv_n

from amoe import _core, core
from amoe.config import SchedulerSection
from amoe.expert_map import ExpertMap
from amoe.model.layers import build_expert_layer_set
from amoe.model.make import make_model
from amoe.placement import Placement
from amoe.runtime.executors import ExpertExecutor

H, NB, E = 4, 2, 4


def oracle(candidates: list[list[int]], inflight: list[int]) -> list[int]:
    """The replica rule as docs/rebalancing.md states it: the fewest rows in flight (this dispatch's included),
    ties to the lowest runtime id."""
    load = dict(enumerate(inflight))
    out = []
    for where in candidates:
        best = min(where, key=lambda r: (load.get(r, 0), r))
        load[best] = load.get(best, 0) + 1
        out.append(best)
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4, unique=True).map(sorted), max_size=30),
    st.lists(st.integers(0, 20), max_size=7),
)
def test_the_replica_rule_matches_its_statement(candidates, inflight):
    assert _core.choose_replicas(candidates, inflight) == oracle(candidates, inflight)


def test_the_rule_spreads_one_dispatch_and_prefers_the_shorter_backlog():
    assert _core.choose_replicas([[1, 2]] * 4, []) == [1, 2, 1, 2]
    assert _core.choose_replicas([[1, 2]] * 3, [0, 5, 1]) == [2, 2, 2]  # runtime 1 owes 5 rows already


def engine(runtime: int, expert_map: ExpertMap, hub: core.LoopbackHub) -> core.Engine:
    placement = Placement.disaggregated(1, 2, E)  # experts 0, 2 on runtime 1; 1, 3 on runtime 2
    cfg = core.engine_config(
        runtime, placement, num_blocks=NB, num_experts=E, top_k=1, hidden=H,
        scheduler=SchedulerSection(policy="defrag"),  # a batch at once: what is tested here is the routing
        track_requests=True, expert_map=expert_map,
    )  # fmt: skip
    return core.Engine(cfg, hub.communicator(runtime))


def attend(attn: core.Engine, request_ids: list[int], expert: int) -> None:
    """Every request's token through attention(0), routed to `expert` (top-1)."""
    n = len(request_ids)
    ids = torch.tensor(request_ids)
    attn.add_tokens(ids, torch.full((n,), 5), torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                    torch.ones(n, dtype=torch.long))  # fmt: skip
    batch = attn.next_batch(0)
    x = torch.arange(n * H, dtype=torch.float32).view(n, H)
    attn.submit_attention(batch, torch.zeros(n, H), x, torch.full((n, 1), expert), torch.ones(n, 1))


def test_an_attention_engine_routes_by_the_rule_and_knows_what_each_replica_owes():
    table = ExpertMap.homes(Placement.disaggregated(1, 2, E), NB).table()
    table[0][0] = [1, 2]  # expert 0 of block 0 has a replica on runtime 2
    hub = core.LoopbackHub(3)
    attn = engine(0, ExpertMap.of(table), hub)
    experts = [hub.communicator(r) for r in (1, 2)]
    attend(attn, [10, 11, 12, 13], expert=0)
    got = [recv_n(c, 1) for c in experts]
    rows = [sorted(m.meta()["request_id"].tolist()) for msgs in got for m in msgs]
    assert rows == [[10, 12], [11, 13]]  # alternating, runtime 1 first (a tie goes to the lowest id)
    assert [attn.outstanding([(r, 0, 0)]) for r in (1, 2)] == [2, 2]
    assert attn.stats()["inflight"] == [0, 2, 2]
    attn.set_replicas(0, 0, [2])  # expert 0 leaves runtime 1: new rows go to 2, runtime 1 still owes its two
    attend(attn, [14, 15], expert=0)
    assert recv_n(experts[0], 1, timeout=0.3) == [] and len(recv_n(experts[1], 1)) == 1
    assert attn.replicas(0, 0) == [2] and attn.outstanding([(1, 0, 0), (2, 0, 1)]) == 2
    answer = dict(request_id=[10, 12], kind=[core.ATTN] * 2, block=[1] * 2, index=[0] * 2, position=[0] * 2,
                  slot=[1] * 2, expert_id=[0] * 2, weight=[1.0] * 2)  # fmt: skip
    attn.ingest(core.make_message(torch.zeros(2, H), **answer))
    assert (
        attn.outstanding([(1, 0, 0)]) == 0 and attn.stats()["inflight"][1] == 0
    )  # drained: it owes nothing now
    with pytest.raises(Exception, match="needs a replica"):
        attn.set_replicas(0, 0, [])
    with pytest.raises(Exception, match="outside the model"):
        attn.set_replicas(NB, 0, [1])


def expert_rows(block: int, expert: int, n: int) -> core.Message:
    return core.make_message(
        torch.randn(n, H), request_id=list(range(n)), kind=[core.EXPERT] * n, block=[block] * n,
        index=[expert] * n, position=[0] * n, slot=[1] * n, expert_id=[expert] * n, weight=[1.0] * n,
    )  # fmt: skip


def test_an_expert_engine_takes_and_drops_layers_while_serving():
    hub = core.LoopbackHub(3)
    runtime1 = engine(1, ExpertMap.homes(Placement.disaggregated(1, 2, E), NB), hub)  # hosts 0 and 2
    runtime1.ingest(expert_rows(0, 1, 3))
    assert runtime1.stats()["dropped"]["misrouted"] == 3  # expert 1 is not hosted here
    runtime1.host(0, 1)
    runtime1.ingest(expert_rows(0, 1, 3))
    assert runtime1.stats()["depth"][("expert", 0, 1)] == 3
    assert ("expert", 1, 1) not in runtime1.stats()[
        "depth"
    ]  # expert 1 of block 1: never hosted, never listed
    assert runtime1.unhost(0, 1) == 3  # rows still queued when it goes: second copies, dropped and counted
    stats = runtime1.stats()
    assert stats["dropped"]["retired"] == 3 and stats["depth"].get(("expert", 0, 1), 0) == 0
    assert runtime1.next_batch(0) is None
    runtime1.ingest(expert_rows(0, 1, 1))
    assert runtime1.stats()["dropped"]["misrouted"] == 4


def test_layers_that_come_and_go_keep_the_floats(tmp_path):
    """Stacked (one grouped GEMM a block) or alone, added while serving or built at start: every row gets the same
    bits; a removed layer's weights are freed with their bytes counted."""
    model = make_model("tiny", tmp_path / "tiny", seed=0)
    from amoe.model.config import load_model_config

    cfg = load_model_config(model)
    start = build_expert_layer_set(model, cfg, [(0, 0), (0, 2)])
    executor = ExpertExecutor(start)
    added = executor.add(build_expert_layer_set(model, cfg, [(0, 5)]))
    assert added == 3 * cfg.hidden_size * cfg.intermediate_size * 4  # float32 gate, up, down
    reference = ExpertExecutor(build_expert_layer_set(model, cfg, [(0, 0), (0, 2), (0, 5)]))
    x, w = torch.randn(6, cfg.hidden_size), torch.rand(6)
    cu = [0, 2, 4, 6]
    assert torch.equal(
        executor._run_groups(0, x, w, [0, 2, 5], cu), reference._run_groups(0, x, w, [0, 2, 5], cu)
    )
    assert executor.remove([(0, 2)]) == added and (0, 2) not in executor.layers
    alone = ExpertExecutor(build_expert_layer_set(model, cfg, [(0, 0), (0, 5)]))
    cu = [0, 3, 6]
    assert torch.equal(executor._run_groups(0, x, w, [0, 5], cu), alone._run_groups(0, x, w, [0, 5], cu))


# ---- a runtime's side of joins and drains (amoe/runtime/replicas.py)


class Weights:
    """An executor's add/remove, counting bytes: 10 a layer."""

    def __init__(self) -> None:
        self.layers: set = set()

    def add(self, layers) -> int:
        self.layers |= set(layers)
        return 10 * len(layers)

    def remove(self, keys) -> int:
        self.layers -= set(keys)
        return 10 * len(keys)


def replies_until(side, want: int) -> list:
    """The side's replies once `want` have come (the loop thread's turns run here), within 10 s."""
    import time

    out, deadline = [], time.monotonic() + 10
    while len(out) < want and time.monotonic() < deadline:
        side.between_batches()
        out += side.replies()
        time.sleep(0.001)
    return out


def settled(side) -> list:
    """Every reply until nothing is under way (no load in flight, nothing to land or send), within 10 s."""
    import time

    out, deadline = [], time.monotonic() + 10
    while side.busy and time.monotonic() < deadline:
        side.between_batches()
        out += side.replies()
        time.sleep(0.001)
    return out


def test_an_expert_runtime_joins_lands_between_batches_and_drains():
    import threading

    from amoe import wire
    from amoe.runtime.replicas import ExpertReplicas

    hub = core.LoopbackHub(3)
    eng = engine(1, ExpertMap.homes(Placement.disaggregated(1, 2, E), NB), hub)
    gate = threading.Event()

    def loader(layers):
        if (1, 3) in layers:
            raise OSError("the checkpoint is gone")
        if (0, 3) in layers:
            gate.wait(10)  # a slow read, cancelled before it lands
        return dict.fromkeys(layers)

    weights = Weights()
    side = ExpertReplicas(1, eng, weights, loader, {(b, e) for b in range(NB) for e in (0, 2)}, (NB, E))
    side.apply(wire.LoadExperts(1, [(0, 1), (1, 1)]))
    assert replies_until(side, 1) == [wire.ExpertsLoaded(1, 1, [[0, 1], [1, 1]], 20)]
    assert weights.layers == {(0, 1), (1, 1)} and {(0, 1), (1, 1)} <= side.hosted
    eng.ingest(expert_rows(0, 1, 2))
    assert eng.stats()["depth"][("expert", 0, 1)] == 2  # hosted: it takes rows now
    side.apply(wire.LoadExperts(2, [(1, 3)]))
    (failed,) = replies_until(side, 1)
    assert isinstance(failed, wire.PlacementFailed) and "checkpoint is gone" in failed.error
    side.apply(wire.LoadExperts(3, [(0, 3)]))
    side.apply(wire.DropExperts(3, [(0, 3)]))  # cancelled while loading
    gate.set()
    assert settled(side) == [wire.ExpertsDropped(1, 3, [], 0)]  # and nothing when its weights land
    assert (0, 3) not in side.hosted | weights.layers
    side.apply(wire.DropExperts(4, [(0, 1)]))
    assert replies_until(side, 1) == [wire.ExpertsDropped(1, 4, [[0, 1]], 10)]
    assert eng.stats()["dropped"]["retired"] == 2 and (0, 1) not in side.hosted
    side.apply(wire.LoadExperts(5, [(NB, 0)]))
    assert "outside the model" in side.replies()[0].error


def test_an_attention_runtime_switches_and_says_drained_once_nothing_is_owed():
    from amoe import wire
    from amoe.runtime.replicas import AttentionReplicas

    hub = core.LoopbackHub(3)
    start = ExpertMap.homes(Placement.disaggregated(1, 2, E), NB)
    attn = engine(0, start, hub)
    side = AttentionReplicas(0, attn, start, num_runtimes=3)
    attend(attn, [10, 11], expert=0)  # two rows out to runtime 1
    side.apply(wire.SetExpertMap(1, [(0, 0, [2])]))
    assert attn.replicas(0, 0) == [2] and side.replies() == []  # runtime 1 still owes two rows
    answer = dict(request_id=[10, 11], kind=[core.ATTN] * 2, block=[1] * 2, index=[0] * 2, position=[0] * 2,
                  slot=[1] * 2, expert_id=[0] * 2, weight=[1.0] * 2)  # fmt: skip
    attn.ingest(core.make_message(torch.zeros(2, H), **answer))
    assert side.replies() == [wire.Drained(0, 1)]
    side.apply(wire.SetExpertMap(2, [(0, 0, [7])]))
    (refused,) = side.replies()
    assert isinstance(refused, wire.PlacementFailed) and "runtimes of this cluster" in refused.error
    side.apply(wire.LoadExperts(3, [(0, 0)]))
    assert isinstance(side.replies()[0], wire.PlacementFailed) and attn.replicas(0, 0) == [2]
