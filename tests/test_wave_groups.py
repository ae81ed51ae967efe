"""Wave groups (docs/scheduler.md "Group cells"): the attention runtime writes each row's wave
into its expert parts, the expert runtime serves one (block, group) a step and waits for its group's waves on
their way; the C++ scheduler picks what the Python oracle picks; a plan's command carries its bound's group; in
the simulation the groups bring out-of-phase ranks to the bound where gathering per rank does not."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_waves import BARRIER_OPS  # (kind, block, column, rank) ops: the rank barrier's, here with waves

from amoe import core
from amoe.config import ConfigError, SchedulerSection
from amoe.placement import Placement
from amoe.testing import policies


@settings(max_examples=150, deadline=None)
@given(
    blocks=st.integers(1, 5), experts=st.integers(1, 3), ranks=st.integers(1, 3), waves=st.integers(1, 4),
    group=st.integers(1, 3), ops=BARRIER_OPS,
)  # fmt: skip
def test_expert_wave_groups_match_the_oracle(blocks, experts, ranks, waves, group, ops):
    """Rows of (rank, wave) arrive in their group's columns, each step takes one (block, group) and serves its
    waves, the clock moves: every pick, hold, release time and turn-around agrees with the oracle."""
    groups = -(-waves // group)
    cols = experts * groups
    s = core.Scheduler(blocks, cols, "waves", 0, 0.0)
    o = policies.Waves(blocks, cols, wave_cols=False)
    for x in (s, o):
        x.set_rank_barrier(ranks, 5.0, 1)
        x.set_wave_groups(waves, group, experts)
    assert s.num_groups == groups
    now = 0.0
    for op, bi, ci, ri in ops:
        b, r, w = bi % blocks, ri % ranks, ci % waves
        c = w // group * experts + ci % experts
        if op == "arrive":
            for x in (s, o):
                x.add(b, c, 1 + ri % 3)
                x.arrived(b, r, now, w)
        elif op == "wait":
            now += 0.25 * (1 + ri % 8)
        else:
            want = o.pick(force=op == "force", now=now)
            assert s.pick(force=op == "force", now=now) == want
            assert s.holding == o.holding
            if o.holding:
                assert s.release_at == o.release_at
            if want is not None:  # a grouped step takes the picked group's columns and serves its waves
                first = want[1] // experts * experts
                for c2 in range(first, first + experts):
                    n2 = o.depths[want[0]][c2]
                    s.add(want[0], c2, -n2)
                    o.add(want[0], c2, -n2)
                g = want[1] // experts
                for x in (s, o):
                    x.served(want[0], r, now, min(waves - 1, g * group + ci % group))
        assert [s.turn_around(x, v) for x in range(ranks) for v in range(waves)] == o.turn


def test_a_group_waits_for_its_own_wave_and_another_group_goes_first():
    """Two ranks, two waves, one wave a group, 4 blocks: (rank 1, wave 0) is on its way to block 2, so rank 0's
    wave 0 waits there — while rank 1's wave 1, in the other group at the same block, is served at once. Per rank
    (the straggler wait) rank 1 would count as arrived the moment its wave 1 did."""
    s = core.Scheduler(4, 2, "waves", 0, 0.0)
    s.set_rank_barrier(2, 10.0)
    s.set_wave_groups(2, 1, 1)
    s.served(0, 1, 0.0, 0)
    s.add(1, 0, 3)
    s.arrived(1, 1, 1.0, 0)  # (1, 0): served at block 0 at t=0, at block 1 at t=1
    assert s.turn_around(1, 0) == 1.0 and s.turn_around(1, 1) == -1.0
    assert s.pick(now=1.0) == (1, 0)
    s.add(1, 0, -3)
    s.served(1, 1, 1.0, 0)
    s.add(2, 0, 4)
    s.arrived(2, 0, 1.25, 0)  # rank 0's wave 0: waits for (1, 0)
    assert s.pick(now=1.25) is None and s.holding and s.release_at == 3.0
    s.add(2, 1, 5)
    s.arrived(2, 1, 1.5, 1)  # rank 1's wave 1 (group 1): nothing of its group is on its way
    assert s.pick(now=1.5) == (2, 1)
    s.add(2, 1, -5)
    s.served(2, 1, 1.5, 1)
    assert s.pick(now=1.5) is None  # group 0 at block 2 still waits for (1, 0)
    s.add(2, 0, 3)
    s.arrived(2, 1, 1.75, 0)
    assert s.pick(now=1.75) == (2, 0) and s.depth(2, 0) == 7  # the group's two waves in one step


def test_block_0_waits_for_a_groups_wave_wherever_it_is():
    """8 blocks: (rank 1, wave 0) was last served at block 2, six blocks before block 0, after it last arrived
    there; rank 0's wave 0 at block 0 waits for it until 2 x 6 turn-arounds after that serving (the meeting
    block looked only ceil(8 / W) blocks back); (rank 1, wave 1) of the other group is not waited for."""
    s = core.Scheduler(8, 2, "waves", 0, 0.0)
    s.set_rank_barrier(2, 100.0)
    s.set_wave_groups(2, 1, 1)
    for r, w in ((0, 0), (1, 0), (1, 1)):  # turn-arounds of 1 s
        s.served(0, r, 0.0, w)
        s.add(1, w, 1)
        s.arrived(1, r, 1.0, w)
        s.add(1, w, -1)
    s.served(2, 1, 2.0, 0)
    s.served(7, 1, 2.0, 1)  # wave 1 of rank 1 is one block from block 0: group 1's business
    s.add(0, 0, 4)
    s.arrived(0, 0, 2.5, 0)
    assert s.pick(now=2.5) is None and s.release_at == 2.0 + 2 * 6 * 1.0
    assert s.pick(now=14.0) == (0, 0)


def test_attention_rows_carry_their_wave_and_an_expert_step_serves_one_group():
    """An attention runtime under waves (two waves of one request) sends each wave's expert parts with the wave;
    the expert runtime with wave groups of one wave drains block 0's two waves as two steps, where per rank
    (wave_group 0) one step takes both."""
    placement = Placement.disaggregated(1, 1, 2)
    for wave_group, steps in ((1, [[7], [8]]), (0, [[7, 8]])):
        hub = core.LoopbackHub(2)
        sched = SchedulerSection(policy="waves", attn_batch_cap=1, wave_group=wave_group)

        def engine(runtime, sched=sched, hub=hub):
            cfg = core.engine_config(
                runtime, placement, num_blocks=2, num_experts=2, top_k=1, hidden=4, scheduler=sched,
                max_requests=2,
            )  # fmt: skip
            return core.Engine(cfg, hub.communicator(runtime))

        attn, expert = engine(0), engine(1)
        for rid in (7, 8):
            one = torch.tensor([rid])
            attn.add_tokens(one, torch.tensor([5]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))
        for _ in range(2):  # one attention step a wave, each to expert 0
            batch = attn.next_batch(0)
            attn.submit_attention(
                batch, torch.zeros(1, 4), torch.ones(1, 4), torch.tensor([[0]]), torch.tensor([[1.0]])
            )
        expert.pump(1.0)
        expert.pump(0.0)
        got = []
        while (batch := expert.next_batch(0)) is not None:
            got.append(sorted(batch.request_ids.tolist()))
        assert got == steps, wave_group


def test_a_waves_plans_command_carries_its_bounds_wave_group():
    """`amoe plan`'s command for an AEP plan under waves sets the expert side's group to the bound's m waves of w
    rows in waves of the attention cap (A100 5 + 3 top-1, caps 128 / 1024: m = 2, w = 128 -> 2)."""
    from amoe.perf.model.hosts import host_overhead
    from amoe.perf.model.models import model_profile
    from amoe.perf.model.routing import routing_inclusion
    from amoe.perf.model.workloads import mean_context
    from amoe.perf.plan import bounds
    from amoe.perf.plan.bound_pools import wave_group
    from amoe.perf.plan.deployment import Deployment
    from amoe.perf.plan.request import Plan, PlanRequest
    from amoe.perf.plan.serving import plan_config

    model = model_profile("mixtral-8x7b-mqa:32", 1)
    dep = Deployment("aep", "a100-80g", 5, "a100-80g", 3, 128, 1024)
    pred = bounds.predict(
        model, dep, routing_inclusion(model, "skew-exp:0.08"), mean_context("short"),
        host_overhead("amoe-paper"),
    )  # fmt: skip
    assert (pred.extra["group_waves"], pred.extra["wave_rows"]) == (2, 128)
    req = PlanRequest("mixtral-8x7b-mqa:32", {"a100-80g": 8}, top_k=1, aep_policy="waves")
    scheduler = plan_config(Plan(dep, pred, None), req, emulated=True).scheduler
    assert (scheduler.policy, scheduler.wave_group) == ("waves", 2)
    # a bound whose waves are half the cap's: its group of 8 is 4 of the runtime's waves
    assert wave_group({"group_waves": 8, "wave_rows": 128}, 256) == 4
    with pytest.raises(ConfigError, match="wave_group"):
        SchedulerSection(wave_group=-1)


def test_the_simulation_with_wave_groups_brings_out_of_phase_ranks_to_the_bound():
    """H100 6 + 2 top-1 at 32 blocks at the corrected bound's operating point (under the AMoE-paper roofline 3,072
    requests: W = 2 waves of 256 a rank, groups of one wave; under the 2026-11-29 kernel calibration 6,144: W = 4,
    groups of 2), ranks started out of phase: per rank (the straggler wait) a rank's wave that fell one step behind is run
    alone every block, well under the bound; the bound's groups reach it."""
    from amoe.perf.model.hosts import host_overhead
    from amoe.perf.model.models import model_profile
    from amoe.perf.model.routing import routing_inclusion
    from amoe.perf.model.workloads import mean_context
    from amoe.perf.plan import bounds
    from amoe.perf.plan.bound_pools import wave_group
    from amoe.perf.plan.deployment import Deployment
    from amoe.perf.plan.simulate import simulate

    host, ctx, routing = host_overhead("amoe-paper"), mean_context("short"), "skew-exp:0.08"
    model = model_profile("mixtral-8x7b-mqa:32", 1)
    dep = Deployment("aep", "h100", 6, "h100", 2, 256, 512)
    bound = bounds.predict(model, dep, routing_inclusion(model, routing), ctx, host)
    group = wave_group(bound.extra, 256)
    assert bound.concurrency == 6 * bound.extra["waves"] * 256 and group >= 1
    got = {
        g: simulate(
            model, dep, routing, ctx, host, bound.concurrency, warmup_s=4 * bound.itl_s,
            duration_s=8 * bound.itl_s, stagger_ranks=True,
            scheduler=SchedulerSection(policy="waves", attn_batch_cap=256, expert_batch_cap=512, wave_group=g),
        ).tokens_per_s / bound.tokens_per_s
        for g in (0, group)
    }  # fmt: skip
    assert got[0] < 0.85
    assert got[group] > 0.95


def test_a_plan_tables_row_keeps_the_wave_group_it_was_simulated_with():
    """`amoe bench plan-table --measure` serves a row's plan from the table's JSON: the group the simulation ran
    (refine's extra["wave_group"]) goes into the row and back into the served config, not the default of one."""
    from amoe.perf.plan.deployment import Deployment
    from amoe.perf.plan.request import PlanRequest
    from amoe.perf.plan.serving import plan_config
    from amoe.perf.studies.plan_table import one_copy

    dep = Deployment("aep", "a100-80g", 2, "a100-80g", 2, 128, 256, replicas=2)
    row = {
        "tokens_per_s": 26017, "bound": 26765, "itl_ms": 78.7, "concurrency": 2048, "simulated": True,
        "bottleneck": "experts", "deployment": dataclasses.asdict(dep), "wave_group": 2,
    }  # fmt: skip
    req = PlanRequest("mixtral-8x7b-mqa:32", {"a100-80g": 8}, top_k=2, aep_policy="waves")
    config = plan_config(one_copy(row), req, emulated=True)
    assert config.scheduler.wave_group == 2
    assert config.cache.max_num_seqs == 512  # one copy's 1,024 requests on 2 ranks
