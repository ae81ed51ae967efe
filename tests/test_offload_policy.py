"""The activation-aware policy's parts: EAM distance, the EAMC (build, match, files, shapes), its priorities."""

import numpy as np
import pytest

from amoe.errors import ConfigError
from amoe.offload.activation import EPSILON, MAX_PRIORITY, ActivationPolicy
from amoe.offload.choose import make_policy
from amoe.offload.eam import EAMC, Refiner, distance
from amoe.offload.policy import LRU


def test_distance_is_eq1():
    a = np.array([[3, 0, 1], [0, 2, 0]])
    assert distance(a, a) == pytest.approx(0.0)
    assert distance(a, 5 * a) == pytest.approx(0.0)  # independent of the number of tokens
    b = np.array([[0, 4, 0], [0, 2, 0]])  # block 0 orthogonal, block 1 identical
    assert distance(a, b) == pytest.approx(0.5)
    partial = np.array([[3, 0, 1], [0, 0, 0]])  # a block not reached yet is left out
    assert distance(partial, b) == pytest.approx(1.0)
    assert distance(partial, a) == pytest.approx(0.0)


def _clusters(rng, per=20):
    """Three obvious patterns over 2 blocks x 6 experts, with noise."""
    centres = np.array(
        [[[9, 1, 0, 0, 0, 0], [0, 0, 9, 1, 0, 0]],
         [[0, 0, 9, 1, 0, 0], [0, 0, 0, 0, 9, 1]],
         [[0, 0, 0, 0, 1, 9], [9, 0, 0, 0, 0, 1]]], dtype=float)  # fmt: skip
    return np.concatenate([c + rng.random((per, 2, 6)) for c in centres]), centres


def test_eamc_build_keeps_one_member_per_cluster_and_matches():
    eams, centres = _clusters(np.random.default_rng(0))
    eamc = EAMC.build(eams, size=3, seed=0)
    assert len(eamc) == 3
    found = sorted(eamc.nearest(c)[0] for c in centres)
    assert found == [0, 1, 2]  # each pattern's nearest entry is a different one
    for c in centres:
        index, d = eamc.nearest(c)
        assert d < 0.05 and distance(eamc.matrices[index], c) == pytest.approx(d, abs=1e-5)
    # a partial EAM (block 0 only) already tells the patterns apart
    index, _ = eamc.nearest(np.array([centres[1][0], np.zeros(6)]))
    assert eamc.nearest(centres[1])[0] == index


def test_eamc_file_round_trip_and_wrong_shape(tmp_path):
    eams, _ = _clusters(np.random.default_rng(1), per=4)
    eamc = EAMC.build(eams, size=5)
    path = tmp_path / "eamc.npz"
    eamc.save(path)
    back = EAMC.load(path, 2, 6)
    assert np.array_equal(back.matrices, eamc.matrices)
    with pytest.raises(ConfigError, match=r"\(2, 6\).*\(3, 6\)"):
        EAMC.load(path, 3, 6)
    with pytest.raises(ConfigError, match=r"\(2, 6\).*\(2, 8\)"):
        make_policy("activation", 2, 8, str(path))
    np.savez(tmp_path / "other.npz", matrices=eamc.matrices)
    with pytest.raises(ConfigError, match="not an EAMC"):
        EAMC.load(tmp_path / "other.npz", 2, 6)
    with pytest.raises(ConfigError, match="cannot read"):
        EAMC.load(tmp_path / "missing.npz", 2, 6)


def test_refiner_fills_then_rebuilds_from_poor_predictions():
    refiner = Refiner(capacity=2, rebuild_every=2, poor_distance=0.5)
    eamc = EAMC.empty(1, 4)
    for row in ([4, 0, 0, 0], [0, 4, 0, 0]):
        eamc = refiner.observe(eamc, np.array([row], dtype=float))
    assert len(eamc) == 2
    same = refiner.observe(eamc, np.array([[3, 0, 0, 0]], dtype=float))  # predicted well: nothing to learn
    assert same is eamc and not refiner.pending
    eamc = refiner.observe(eamc, np.array([[0, 0, 0, 5]], dtype=float))
    assert len(refiner.pending) == 1
    eamc = refiner.observe(eamc, np.array([[0, 0, 0, 6]], dtype=float))
    assert refiner.rebuilds == 1 and len(eamc) == 2
    assert eamc.nearest(np.array([[0, 0, 0, 1]]))[1] < 1e-6  # the new pattern is in the collection now


def test_priorities_follow_algorithms_1_and_2():
    # 4 blocks x 3 experts; the only EAMC entry says: block 1 -> expert 2 (3 of 4 tokens) and 0, block 2 -> 1,
    # block 3 -> 0.
    entry = np.array([[4, 0, 0], [1, 0, 3], [0, 4, 0], [4, 0, 0]], dtype=float)
    policy = ActivationPolicy(4, 3, eamc=EAMC(entry[None], 4, 3), refine=False)
    policy.routed(seq=7, block=0, experts=[0], counts=[2])
    decay = {1: 0.75, 2: 0.5, 3: 0.25}
    expected = {(0, 0): MAX_PRIORITY}
    for b in (1, 2, 3):
        for e in range(3):
            expected[(b, e)] = (entry[b, e] / 4 + EPSILON) * decay[b]
    order = sorted(expected, key=lambda k: (-expected[k], k))
    # wanted() lists the predicted experts (ratio > 0) and the on-demand one; the ε-priority rest only orders them
    assert policy.wanted(100) == [k for k in order if k == (0, 0) or entry[k] > 0]
    assert policy.wanted(3) == [(0, 0), (1, 2), (2, 1)]
    # Eviction: the on-demand expert outranks everything, predicted experts outrank cached ones, and among the
    # rest the current EAM's ratio times the decay decides.
    policy.used((0, 0))
    assert policy.victim([(0, 0), (1, 2), (0, 1)]) == (0, 1)  # (0,1): ratio 0 -> ε; (0,0): ratio 1
    assert policy.victim([(1, 2), (1, 1), (3, 1)]) == (3, 1)  # unpredicted; the later block goes first
    assert policy.victim([(1, 2), (3, 0)]) == (3, 0)  # both predicted: 0.25 * 1.0 < 0.75 * 0.75
    policy.routed(
        seq=7, block=1, experts=[1], counts=[2]
    )  # the prediction is refined: block 1 is history now
    assert policy.wanted(1) == [(1, 1)]
    assert policy.victim([(0, 0), (1, 1), (1, 2), (0, 2)]) == (
        1,
        2,
    )  # no longer predicted, ratio 0 at block 1
    policy.end(7)
    assert policy.wanted(5) == []


def test_a_prefetch_evicts_only_experts_ranked_below_it():
    entry = np.array([[4, 0, 0], [1, 0, 3], [0, 4, 0], [4, 0, 0]], dtype=float)
    policy = ActivationPolicy(4, 3, eamc=EAMC(entry[None], 4, 3), refine=False)
    policy.routed(seq=1, block=0, experts=[0], counts=[2])
    policy.used((0, 0))
    # (1, 2) is queued at (3/4 + ε) · 0.75; (0, 0) is cached at (1 + ε) · 1, (0, 1) at ε · 1
    assert not policy.admits((1, 2), (0, 0))
    assert policy.admits((1, 2), (0, 1))
    assert LRU().admits((1, 2), (0, 0))  # policies without a queue never refuse


def test_activation_policy_without_eamc_learns_from_finished_sequences():
    policy = make_policy("activation", 2, 4)
    assert policy.wanted(4) == []  # nothing to predict from yet
    for block, expert in ((0, 1), (1, 3)):
        policy.routed(0, block, [expert], [1])
    policy.end(0)
    policy.routed(1, 0, [1], [1])
    assert policy.wanted(2) == [(0, 1), (1, 3)]
