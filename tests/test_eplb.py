"""DeepSeek's EPLB as amoe runs it (amoe/eplb.py), and the expert map built on it (amoe/expert_map.py): cases worked
by hand, properties over random loads, and the map's joins and drains."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amoe import eplb
from amoe.errors import ConfigError
from amoe.expert_map import ExpertMap, expected_load
from amoe.perf.model.ep_scale import eplb_placement
from amoe.placement import Placement


def test_a_hot_expert_gets_the_redundant_slots_and_the_devices_even_out():
    # 4 experts, 6 slots, 2 devices of 3. Replicate: 10/1 is the most per replica, then 10/2 = 5, so expert 0 gets
    # both extra slots (10/3 each). Pack heaviest first: 0 → device 0, 0 → device 1 (lighter), 0 → device 0 (equal:
    # the lower index), then the 1s, equal, higher id first: 3 → device 1, 2 → device 1 (now full), 1 → device 0.
    counts, packs = eplb.place_layer([10, 1, 1, 1], 6, 2)
    assert counts.tolist() == [3, 1, 1, 1]
    assert packs == [[0, 0, 1], [0, 3, 2]]
    assert eplb.device_loads([10, 1, 1, 1], packs) == pytest.approx([10 / 3 * 2 + 1, 10 / 3 + 2])


def test_equal_experts_take_replicas_in_ascending_id():
    assert eplb.replica_counts([3, 3, 1], 5).tolist() == [2, 2, 1]
    assert eplb.replica_counts([0, 0, 0], 4).tolist() == [2, 1, 1]


def test_the_hierarchical_policy_keeps_each_group_on_one_node():
    # 4 groups of 2 experts, 2 nodes of 2 devices. Group loads 9, 2, 7, 2: node 0 takes group 0, node 1 group 2,
    # then group 3 (equal to group 1, higher id first) the lighter node 1, group 1 node 0.
    load = np.array([[8, 1, 1, 1, 6, 1, 1, 1.0]])
    (layer,) = eplb.rebalance_experts(load, 12, num_groups=4, num_nodes=2, num_devices=4)
    assert layer == [[0, 0, 1], [0, 3, 2], [4, 4, 5], [4, 7, 6]]
    node_of = {e: d // 2 for d, pack in enumerate(layer) for e in pack}
    assert all(node_of[2 * g] == node_of[2 * g + 1] for g in range(4))


def test_groups_that_do_not_divide_over_the_nodes_fall_back_to_the_global_policy():
    load = np.array([[8, 1, 1, 1, 6, 1.0]])
    assert eplb.rebalance_experts(load, 8, 3, 2, 2) == eplb.rebalance_experts(load, 8, 1, 1, 2)


def test_bad_loads_and_too_few_slots_are_refused():
    with pytest.raises(ConfigError, match="finite"):
        eplb.rebalance_experts(np.array([[1.0, np.nan]]), 2, 1, 1, 1)
    with pytest.raises(ConfigError, match="cannot hold"):
        eplb.replica_counts([1, 1, 1], 2)


def test_the_cost_model_places_with_the_same_implementation():
    load = np.random.default_rng(3).exponential(size=16)
    counts, packs = eplb.place_layer(load, 20, 4)
    assert eplb_placement(load, 4, 4) == [[(e, 1.0 / counts[e]) for e in pack] for pack in packs]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 24).flatmap(lambda e: st.tuples(st.just(e), st.integers(1, 8), st.integers(0, 16))),
    st.integers(0, 2**31 - 1),
)
def test_every_expert_has_a_replica_and_the_slots_add_up(shape, seed):
    num_experts, devices, redundant = shape
    load = np.random.default_rng(seed).exponential(size=(3, num_experts))
    plan = eplb.rebalance_experts(load, num_experts + redundant, 1, 1, devices)
    for packs in plan:
        copies = np.bincount([e for pack in packs for e in pack], minlength=num_experts)
        assert copies.min() >= 1 and copies.sum() == num_experts + redundant
        assert max(len(p) for p in packs) <= -(-(num_experts + redundant) // devices)


@pytest.mark.parametrize("seed", range(5))
def test_balancedness_improves_on_skewed_loads(seed):
    rng = np.random.default_rng(seed)
    load = np.exp(-0.5 * rng.permutation(16))  # a hot head and a long tail
    devices = 4
    round_robin = [[e for e in range(16) if e % devices == d] for d in range(devices)]
    plain = eplb.balancedness(eplb.device_loads(load, round_robin))
    packed = eplb.balancedness(eplb.device_loads(load, eplb.place_layer(load, 16, devices)[1]))
    replicated = eplb.balancedness(eplb.device_loads(load, eplb.place_layer(load, 20, devices)[1]))
    assert plain < packed <= replicated
    assert replicated > 0.9


# ---- the expert map


def homes() -> ExpertMap:
    return ExpertMap.homes(Placement.disaggregated(1, 2, 4), num_blocks=2)  # experts 0, 2 on 1; 1, 3 on 2


def test_redundant_experts_go_to_the_hottest_expected_expert_first():
    # 3 routed experts at 2/3 of a token each and a shared one (id 3) every token visits, homes e mod 3 on runtimes
    # 1..3. The shared expert is hottest: its replica goes to the lighter of 2 and 3 (2/3 each: the lower id, 2).
    # Then expert 0 (2/3 beats the shared one's 1/2 per replica, and 0 is the lowest id), to runtime 3, the
    # lightest (2/3 against 2/3 + 1/2 on runtime 2).
    prior = expected_load(2, 3, 1, 2)
    m = ExpertMap.homes(Placement.disaggregated(1, 3, 4), 2).with_redundant(2, prior, (1, 2, 3))
    assert m.replicas == (((1, 3), (2,), (3,), (1, 2)),) * 2


def test_too_many_redundant_experts_are_refused():
    with pytest.raises(ConfigError, match="exceed"):
        homes().with_redundant(5, expected_load(2, 4, 0, 2), (1, 2))


def test_moves_are_the_joins_and_drains_between_two_maps():
    a = homes()
    b = ExpertMap.of([[[1, 2], [2], [2], [2]], [[1], [2], [1], [2]]])
    joins, drains = a.moves(b)
    assert joins == {2: [(0, 0), (0, 2)]} and drains == {1: [(0, 2)]}
    assert a.changed(b) == [(0, 0, (1, 2)), (0, 2, (2,))]
    assert b.moves(b) == ({}, {})


def test_a_map_from_the_hosted_layers_needs_every_layer_hosted():
    full = {1: [(0, 0), (0, 2), (1, 0), (1, 2)], 2: [(0, 1), (0, 3), (1, 1), (1, 3)]}
    assert ExpertMap.from_hosted(full, 2, 4) == homes()
    with pytest.raises(ConfigError, match="no expert runtime hosts"):
        ExpertMap.from_hosted({1: [(0, 0)]}, 2, 4)
    with pytest.raises(ConfigError, match="distinct"):
        ExpertMap((((),),))


def test_a_rebalance_keeps_replicas_where_they_are_when_it_can():
    load = np.array([[9, 1, 1, 1], [1, 1, 5, 1.0]])
    first = homes().rebalanced(load, 2, (1, 2), (0, 0), 1)
    assert first.counts().sum(axis=1).tolist() == [6, 6]
    assert first.rebalanced(load, 2, (1, 2), (0, 0), 1) == first  # the same load: nothing moves
    b0 = first.balancedness(load, (1, 2))
    assert min(b0) > min(homes().balancedness(load, (1, 2)))
