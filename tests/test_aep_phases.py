"""AEP at scale with each attention GPU on its own phase (docs/simulation.md "AEP at scale: each attention
GPU on its own phase"): an expert GPU runs what is queued at it when it starts, so attention GPUs out of phase give
it smaller steps than the A GPUs' waves together; all on one phase, the old one-timeline figures come back."""

import functools

import golden
import numpy as np
import pytest

from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate import scale
from amoe.perf.plan.simulate.aep_scale import _fifo

ROUTING = "skew-exp:0.0025"


@functools.cache
def scale32_runs():
    """`amoe bench plan-check --preset scale32`'s plan: DeepSeek-V3 at 4 blocks, AEP 16 + 16 H800s, caps 64 / 1024,
    4,096 requests (4 waves of 64 per attention GPU), 12 of the one timeline's ITLs (7.07 ms) as refine runs it:
    every attention GPU on one phase, and each on its own."""
    model = model_profile("deepseek-v3:4", 8)
    dep = Deployment("aep", "h800", 16, "h800", 16, attn_cap=64, expert_cap=1024)
    itl = 0.00707
    args = (
        model,
        dep,
        ROUTING,
        mean_context("short"),
        host_overhead("amoe-paper"),
        4096,
        8 * itl,
        4 * itl,
        0,
    )
    return model, dep, scale.aep_waves(*args, same_phase=True), scale.aep_waves(*args)


@pytest.fixture(scope="module")
def scale32():
    return scale32_runs()


@golden.case("aep_phases")
def one_phase_and_own_phases() -> golden.Figures:
    """The scale32 plan simulated at scale with its attention GPUs on one phase and each on its own."""
    _, _, same, own = scale32_runs()
    return {
        name: {"tokens_per_s": r.tokens_per_s, "expert_rows_per_step": r.expert_rows_per_step,
               "expert_busy": r.expert_busy}
        for name, r in (("one phase", same), ("own phases", own))
    }  # fmt: skip


def test_out_of_phase_attention_gpus_give_expert_gpus_smaller_steps():
    model, dep, _, _ = scale32_runs()
    f = one_phase_and_own_phases.check()
    same, own = f["one phase"], f["own phases"]
    together = (
        dep.num_attn * 64 * model.experts_per_token / dep.num_expert
    )  # the A GPUs' wave at one expert GPU
    # One phase: every expert step holds at least the 16 GPUs' wave (512 rows), as the one timeline had it; under
    # the 2026-11-29 kernel calibration the expert side binds (busy 99 %), so waves of two groups meet at some
    # steps and a step holds more.
    assert same["expert_rows_per_step"] >= 0.99 * together
    # Own phases: an expert GPU starts on what has arrived, so its steps hold fewer rows and, their fixed cost (the
    # experts' weights) paid more often, the expert side binds before the attention side does.
    assert own["expert_rows_per_step"] < together
    assert own["expert_busy"] > same["expert_busy"]
    assert own["tokens_per_s"] < same["tokens_per_s"]


def test_an_expert_step_never_holds_more_than_the_cap_and_every_row_is_served_once():
    """Many attention GPUs' small waves queue at two expert GPUs: a step takes at most `expert_cap` rows of an
    expert (the first arrived first) and leaves the rest queued; rows drawn = rows taken + rows still queued."""
    model = model_profile("deepseek-v3:4", 8)
    dep = Deployment("aep", "h800", 32, "h800", 2, attn_cap=16, expert_cap=3)
    sim = scale.aep_at_scale(model, dep, ROUTING, 2000.0, host_overhead("amoe-paper"), 32 * 32, seed=1)
    drawn, taken, most = [0.0], [0.0], [0.0]
    draw, step_times = sim.counts.draw_many, sim.step_times

    def counting_draw(*args):
        out = draw(*args)
        drawn[0] += out.sum()
        return out

    def counting_steps(take, *args):
        taken[0] += take.sum()
        most[0] = max(most[0], float(take.max()))
        return step_times(take, *args)

    sim.counts.draw_many, sim.step_times = counting_draw, counting_steps
    sim.run(0.0, 0.002)
    assert most[0] == dep.expert_cap  # the cap bound, and no step went past it
    assert drawn[0] == pytest.approx(taken[0] + sim.rows.sum(), abs=1e-6)


def test_a_link_serves_message_sets_first_sent_first_through():
    """_fifo's closed form is the recurrence e_k = max(start_k, e_{k-1}) + work_k, link by link, and a set that
    does not use a link (start −inf, no work) leaves it as it was."""
    rng = np.random.default_rng(3)
    start = np.sort(rng.uniform(0, 1, (9, 4)), axis=0)
    work = rng.uniform(0, 0.3, (9, 4))
    start[2, 1], work[2, 1] = -np.inf, 0.0
    free = rng.uniform(0, 0.5, 4)
    expect = np.empty_like(start)
    e = free.copy()
    for k in range(9):
        e = np.maximum(start[k], e) + work[k]
        expect[k] = e
    assert np.allclose(_fifo(start, work, free), expect)


def test_the_per_block_queues_are_the_pending_waves_rows():
    """An expert round reads each GPU's queues per block from `queue`, kept as waves are dispatched and steps take
    their rows, instead of summing every pending wave's rows: after a run (caps binding, steps cut short) it must
    hold exactly the rows still pending, by each wave's block."""
    model = model_profile("deepseek-v3:4", 8)
    dep = Deployment("aep", "h800", 12, "h800", 4, attn_cap=32, expert_cap=24)
    sim = scale.aep_at_scale(model, dep, ROUTING, 2000.0, host_overhead("amoe-paper"), 12 * 96, seed=1)
    sim.run(0.0, 0.003)
    assert sim.rows.sum() > 0  # some rows still pending at the end
    expect = np.zeros_like(sim.queue)
    for s in np.flatnonzero(sim.pend.any(1)):
        expect[sim.layer[s]] += sim.rows[s]
    assert np.array_equal(sim.queue, expect)


def test_the_batch_means_rule_stops_on_a_stationary_series_and_not_on_a_trending_one():
    """refine's AEP at scale stops at the first batch k >= 10 whose batch-means 95 % interval is within +-1 %: a
    stationary series with 2 % noise a batch gets there within 32 batches; one drifting by 20 % over them (a
    transient the warm-up left) never does, its batches' spread being the drift. (A drift within the noise can
    pass: batch means assume a stationary series, which is what the warm-up is for.)"""
    from amoe.perf.plan.simulate.batch_means import batch_means_halfwidth

    for seed in range(5):
        rng = np.random.default_rng(seed)
        flat = 1000.0 * (1 + 0.02 * rng.standard_normal(32))
        drift = flat * np.linspace(0.9, 1.1, 32)
        assert min(batch_means_halfwidth(flat[:k]) for k in range(10, 33)) <= 0.01
        assert min(batch_means_halfwidth(drift[:k]) for k in range(10, 33)) > 0.01
    assert batch_means_halfwidth(flat[:1]) == np.inf
    # t(0.975, 9) * s / sqrt(10) / mean, by hand
    x = np.arange(10.0) + 100
    assert batch_means_halfwidth(x) == pytest.approx(2.2622 * np.std(x, ddof=1) / np.sqrt(10) / x.mean())


def test_a_simulation_with_batches_stops_early_and_reports_the_batches_it_measured(scale32):
    """With `batches` the own-phase simulation stops at the first batch k >= 10 whose interval is within the bound
    asked (refine's +-1 % needs a full-depth plan's many steps a batch; this 4-block plan's batches are noisier, so
    +-10 % here: +-5 % until the 2026-11-29 kernel calibration made its expert side bind) and its figures are those
    k batches' own, within that interval of the whole window's figure."""
    from amoe.perf.plan.simulate.batch_means import batch_means_halfwidth

    model, dep, _, whole = scale32
    itl = 0.00707
    sim = scale.aep_at_scale(model, dep, ROUTING, mean_context("short"), host_overhead("amoe-paper"), 4096, 0)
    early = sim.run(4 * itl, 8 * itl, batches=32, rel_halfwidth=0.10)
    k = int(round(sim.measured_s / sim.batch_s))
    assert 10 <= k < 32 and sim.measured_s < 8 * itl
    per_batch = sim.bins[0] / model.num_blocks / sim.batch_s
    assert early.tokens_per_s == pytest.approx(per_batch[:k].mean())
    assert batch_means_halfwidth(per_batch[:k]) <= 0.10
    assert all(batch_means_halfwidth(per_batch[:j]) > 0.10 for j in range(10, k))  # the first such k
    assert abs(early.tokens_per_s / whole.tokens_per_s - 1) <= 0.10
