"""The C++ scheduler picks exactly what the plain Python policies (Algorithm 1, MTFS, FLFS) pick."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amoe import core
from amoe.config import POLICIES, SchedulerSection
from amoe.placement import Placement
from amoe.testing import policies

# waves keeps state between picks (wave positions, readiness stamps): tests/test_waves.py checks it step by step.
POLICY = st.sampled_from([p for p in POLICIES if p != "waves"])
DECAY = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 0.9, 1.0]), st.floats(0.0, 2.0, allow_nan=False))


@st.composite
def grids(draw):
    num_blocks = draw(st.integers(1, 12))
    num_cols = draw(st.integers(1, 6))
    depth = st.one_of(st.just(0), st.integers(0, 5), st.integers(0, 1000))
    return [[draw(depth) for _ in range(num_cols)] for _ in range(num_blocks)]


def scheduler_for(grid, policy, lookahead, decay):
    s = core.Scheduler(len(grid), len(grid[0]), policy, lookahead, decay)
    s.set_depths(grid)
    return s


@settings(max_examples=400, deadline=None)
@given(grid=grids(), policy=POLICY, lookahead=st.integers(0, 14), decay=DECAY)
def test_pick_matches_python(grid, policy, lookahead, decay):
    s = scheduler_for(grid, policy, lookahead, decay)
    assert s.pick() == policies.pick(policy, grid, lookahead, decay)
    assert s.total == sum(map(sum, grid))


@settings(max_examples=150, deadline=None)
@given(
    grid=grids(),
    policy=POLICY,
    lookahead=st.integers(0, 6),
    decay=DECAY,
    ops=st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100), st.integers(-50, 50)), max_size=40),
)
def test_incremental_updates_match_python(grid, policy, lookahead, decay, ops):
    """Per-block totals and maxima kept incrementally agree with re-reading the grid after every change."""
    s = scheduler_for(grid, policy, lookahead, decay)
    for bi, ci, delta in ops:
        b, c = bi % len(grid), ci % len(grid[0])
        delta = max(delta, -grid[b][c])
        grid[b][c] += delta
        s.add(b, c, delta)
        assert s.pick() == policies.pick(policy, grid, lookahead, decay)
        picked = s.pick()
        if picked is not None and delta < 0:  # drain what was picked, like the engine does
            pb, pc = picked
            s.add(pb, pc, -grid[pb][pc])
            grid[pb][pc] = 0
            assert s.pick() == policies.pick(policy, grid, lookahead, decay)


def test_empty_grid_picks_nothing():
    s = core.Scheduler(4, 3, "defrag", 4, 0.5)
    assert s.pick() is None
    s.add(2, 1, 5)
    assert s.pick() == (2, 1)
    s.add(2, 1, -5)
    assert s.pick() is None


def test_defrag_prefers_the_queue_before_a_wave():
    # Algorithm 1 with K = 2, δ = 0.5: score(0) = 3 + 4 * 0.5 + 0 * 0.25 = 5, while
    # score(1) = 4 + 0 * 0.5 + 3 * 0.25 = 4.75 (the look-ahead wraps to block 0); MTFS takes the deeper block 1.
    grid = [[3], [4], [0]]
    assert scheduler_for(grid, "defrag", 2, 0.5).pick() == (0, 0)
    assert scheduler_for(grid, "mtfs", 2, 0.5).pick() == (1, 0)


def test_flfs_and_mtfs():
    grid = [[0, 0], [1, 2], [9, 0]]
    assert scheduler_for(grid, "flfs", 3, 0.5).pick() == (1, 1)
    assert scheduler_for(grid, "mtfs", 3, 0.5).pick() == (2, 0)


def test_bad_arguments_raise_value_error():
    for retired in ("fifo", "wave"):  # `wave`, the merging rule, is retired: `waves` is the wave policy
        with pytest.raises(ValueError, match="policy"):
            core.Scheduler(2, 2, retired, 4, 0.5)
    with pytest.raises(ValueError, match="grid"):
        core.Scheduler(0, 2, "defrag", 4, 0.5)
    s = core.Scheduler(2, 2, "defrag", 4, 0.5)
    with pytest.raises(ValueError, match="outside"):
        s.add(2, 0, 1)
    with pytest.raises(ValueError, match="negative"):
        s.add(0, 0, -1)
    with pytest.raises(ValueError, match="shape"):
        s.set_depths([[1, 2, 3]])


def test_scheduling_defaults_live_in_the_config_only():
    """The C++ side has no defaults of its own: an engine built from the config's scheduler section uses its
    values (lookahead 4, what amoe serves with), and one left unset by hand is refused."""
    assert SchedulerSection().lookahead == 4
    cfg = core.engine_config(
        0, Placement.disaggregated(1, 1, 2), num_blocks=2, num_experts=2, top_k=1, hidden=4
    )
    default = SchedulerSection()
    assert (cfg.policy, cfg.lookahead, cfg.decay) == (default.policy, default.lookahead, default.decay)
    assert (cfg.attn_cap, cfg.expert_cap) == (default.attn_batch_cap, default.expert_batch_cap)
    unset = core.EngineConfig()
    unset.num_blocks, unset.num_experts, unset.hidden = 2, 2, 4
    unset.expert_runtime, unset.attn_runtime = [1, 1], [0]
    with pytest.raises(ValueError, match="scheduling settings unset"):
        unset.validate()
    for policy in POLICIES:  # every name the config accepts, the C++ scheduler knows
        assert core.Scheduler(2, 2, policy, default.lookahead, default.decay).policy == policy
