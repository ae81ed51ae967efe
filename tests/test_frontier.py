"""Frontier MoE at scale: profiles from config.json shapes, FP8 in the cost model, EP as deployed (EPLB,
two-batch overlap), and the simulation at scale, which must agree with the event-level one where both run."""

from __future__ import annotations

from dataclasses import replace

import golden
import numpy as np
import pytest

from amoe.perf.model import cost_model as cm
from amoe.perf.model import ep_scale as ep_at_scale
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import (
    RouterOverride,
    RoutingSpec,
    inclusion_probabilities,
    popularity_by_rank,
    routing_inclusion,
)
from amoe.perf.model.variance import OFF
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan import bounds
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate import scale, simulate

HOST = host_overhead("amoe-paper")
CTX = mean_context("short")
ROUTING = "skew-exp:0.08"


def _activated(name: str) -> float:
    """Parameters a token passes through (per-token FLOPs / 2): every block's attention side, its top-k experts
    and the shared expert, the embedding and lm_head."""
    m = model_profile(name)
    per_block = m.attn_params + m.top_k * m.expert_params + m.num_shared_experts * m.params_of(m.num_experts)
    return m.num_blocks * per_block + 2 * m.vocab_size * m.hidden_size


@pytest.mark.parametrize(
    "name, published",
    [("deepseek-v3", 37e9), ("qwen3-235b-a22b", 22e9), ("qwen3-30b-a3b", 3.3e9)],
)
def test_profiles_carry_the_activated_parameters_their_model_cards_state(name, published):
    """The shapes come from config.json; their sum per token is the model card's "activated" figure (DeepSeek-V3
    37 B, Qwen3 22 B and 3.3 B), which a wrong layer count, dense block or expert width would miss."""
    assert _activated(name) == pytest.approx(published, rel=0.04)


def test_fp8_halves_the_weight_bytes_and_the_compute_bound_time_of_an_expert_step():
    fp8 = model_profile("deepseek-v3")
    bf16 = replace(fp8, attn_precision="bf16", expert_precision="bf16")
    gpu = gpu_profile("h800")
    assert cm.expert_rank_weight_bytes(bf16, 2) == 2 * cm.expert_rank_weight_bytes(fp8, 2)
    # the launches and the two GEMM kernels' fixed costs are the same at either precision
    k = gpu.kernels
    launches = cm.EXPERT_KERNELS * gpu.launch_s + 2 * k.gemm_fixed_s * k.decode_grouped_slowdown

    def ratio(rows):
        return (cm.expert_layer_time(fp8, gpu, rows) - launches) / (
            cm.expert_layer_time(bf16, gpu, rows) - launches
        )

    small, large = ratio(8), ratio(8192)  # weight streaming; compute-bound
    assert small == pytest.approx(0.5, abs=0.05) and large == pytest.approx(0.5, abs=0.05)
    # The embedding and lm_head stay BF16 in DeepSeek's FP8 checkpoint.
    assert cm.head_time(fp8, gpu, 1) == pytest.approx(cm.head_time(bf16, gpu, 1))


def _eplb_loads():
    """Loads ∝ exp(-0.02 rank) · k, a hot head and a long tail, without sampling 256-expert inclusions (slow here)."""
    return np.random.default_rng(0).permutation(popularity_by_rank(256, 0.02) * 8)


def _spread(q, placement):
    load = [sum(q[e] * share for e, share in copies) for copies in placement]
    return max(load) / np.mean(load)


@golden.case("frontier")
def eplb_spread() -> golden.Figures:
    """The busiest of 32 devices over their mean load, EPLB's placement without and with 32 redundant experts."""
    q = _eplb_loads()
    return {
        f"{copies} redundant": _spread(q, ep_at_scale.eplb_placement(q, 32, copies)) for copies in (0, 32)
    }


def test_eplb_splits_hot_experts_and_evens_the_devices():
    q = _eplb_loads()
    devices = 32
    plain = ep_at_scale.eplb_placement(q, devices, 0)
    with_copies = ep_at_scale.eplb_placement(q, devices, 32)
    for placement, slots in ((plain, 8), (with_copies, 9)):
        assert max(len(d) for d in placement) <= slots
        shares = np.zeros(len(q))
        for copies in placement:
            for e, share in copies:
                shares[e] += share
        assert np.allclose(shares, 1.0)  # every expert's tokens are served once
    spread = eplb_spread.check()
    assert spread["32 redundant"] < spread["0 redundant"]
    hottest = int(np.argmax(q))
    assert sum(e == hottest for copies in with_copies for e, _ in copies) >= 2


@golden.case("frontier")
def two_batch_overlap() -> golden.Figures:
    """EP on 64 H800s (DeepSeek-V3, uniform routing, cap 128): the bound without and with two-batch overlap."""
    model = model_profile("deepseek-v3")
    q = routing_inclusion(model, "uniform")
    plain = Deployment("ep", "h800", 64, attn_cap=128)
    none = host_overhead("none")
    preds = {
        name: bounds.predict(model, d, q, 2000, none)
        for name, d in (("plain", plain), ("overlapped", replace(plain, two_batch_overlap=True)))
    }
    return {name: {"tokens_per_s": p.tokens_per_s, "concurrency": p.concurrency} for name, p in preds.items()}


def test_two_batch_overlap_hides_the_exchange_when_it_dominates():
    f = two_batch_overlap.check()
    a, b = f["plain"], f["overlapped"]
    assert b["tokens_per_s"] > a["tokens_per_s"] and b["concurrency"] == a["concurrency"]
    mb = ep_at_scale.MicroBatch(stage_in=0.5, stage_out=0.5, experts=1.0, dispatch=0.4, combine=0.4)
    assert ep_at_scale.block_time(mb, True) == 4.0  # each wire hidden behind the other micro-batch's stage
    slow = replace(mb, dispatch=1.5)
    assert ep_at_scale.block_time(slow, True) == 2 * (1.5 + 1.0 + 0.5)  # the stream waits for the dispatch
    assert ep_at_scale.block_time(slow, False) == pytest.approx(0.5 + 0.5 + 1.5 + 1.0 + 0.4)


def test_inclusion_sampled_once_by_rank_is_each_blocks_permutation(monkeypatch):
    from amoe.perf.model import routing

    monkeypatch.setattr(routing, "_EXACT_LIMIT", 10)  # sample where DeepSeek-V3's 256 experts would (cheaply)
    router = RouterOverride(RoutingSpec.parse("skew-exp:0.3"), 8, 2, 3, seed=4)
    q = router.inclusion_at(0)
    assert q.shape == (3, 8) and np.allclose(q.sum(axis=1), 2.0, atol=0.02)
    monkeypatch.setattr(routing, "_EXACT_LIMIT", 2_000_000)
    assert np.allclose(q, inclusion_probabilities(router.popularity, 2), atol=0.01)  # the exact answer
    for b in range(3):  # the hottest expert of each block has the hottest rank's probability
        assert q[b].argmax() == router.popularity[b].argmax()
        assert np.allclose(np.sort(q[b]), np.sort(q[0]))
    small = RouterOverride(RoutingSpec.parse("skew-exp:0.08"), 8, 2, 2, seed=1)  # exact: unchanged
    assert np.array_equal(small.inclusion_at(0), inclusion_probabilities(small.popularity, 2))


@golden.case("frontier")
def scale_and_events() -> golden.Figures:
    """Mixtral at 2 blocks: EP 8 H100s and ping-pong 4 + 4 A100s simulated event by event and at scale, and AEP 4 + 4
    H100s at four times its bound's requests event by event and in waves, with its bound."""
    model = model_profile("mixtral-8x7b-mqa:2", 2)
    out = {}
    for dep, c in (
        (Deployment("ep", "h100", 8, attn_cap=256), 2048),
        (Deployment("pingpong", "a100-80g", 4, "a100-80g", 4, attn_cap=256, micro_batches=2), 1024),
    ):
        exact = simulate(model, dep, ROUTING, CTX, HOST, c, variance=OFF)  # the scale path draws none
        fast = (scale.ep if dep.mode == "ep" else scale.pingpong)(model, dep, ROUTING, CTX, HOST, c, 0.25, 0)
        out[dep.mode] = {"events": exact.tokens_per_s, "scale": fast.tokens_per_s}
    dep = Deployment("aep", "h100", 4, "h100", 4, attn_cap=256, expert_cap=1024)
    bound = bounds.predict(model, dep, routing_inclusion(model, ROUTING), CTX, HOST, variance=OFF)
    c = 4 * bound.concurrency
    itl = c / bound.tokens_per_s
    event = simulate(model, dep, ROUTING, CTX, HOST, c, warmup_s=4 * itl, duration_s=8 * itl, variance=OFF)
    waves = scale.aep_waves(model, dep, ROUTING, CTX, HOST, c, 8 * itl, 4 * itl, 0)
    out["aep"] = {"bound": bound.tokens_per_s, "events": event.tokens_per_s, "waves": waves.tokens_per_s}
    return out


def test_the_simulation_at_scale_agrees_with_the_event_level_one_where_both_run():
    """EP and ping-pong at scale draw counts instead of routing tokens, with every expert GPU's step at once:
    within 1 % of the event-level simulation of the same plan. AEP in waves leaves out the scheduler's picks, so it
    is never below the event level by more than noise and comes to it as requests fill the batches (the bound's
    operating point is where they differ most, docs/simulation.md "Simulation at scale")."""
    f = scale_and_events.check()
    for mode in ("ep", "pingpong"):
        assert f[mode]["scale"] == pytest.approx(f[mode]["events"], rel=0.01), mode
    aep = f["aep"]
    assert aep["events"] * 0.97 < aep["waves"] <= 1.02 * aep["bound"]


@golden.case("frontier")
def ep_as_deployed_at_scale() -> golden.Figures:
    """DeepSeek-V3 on 144 H800s as deployed (EPLB, two-batch overlap), 4,989 tokens of context: the bound and the
    simulation at scale without and with the sourced step-time variance."""
    model = model_profile("deepseek-v3")
    dep = Deployment(
        "ep", "h800", 144, attn_cap=128, redundant_experts=32, two_batch_overlap=True, gpus_per_node=8
    )
    none = host_overhead("none")
    bound = bounds.predict(model, dep, routing_inclusion(model, "uniform"), 4989, none)
    run = {"duration_s": 8 * bound.itl_s}
    sim = simulate(model, dep, "uniform", 4989, none, 144 * 128, variance=OFF, **run)
    varied = simulate(model, dep, "uniform", 4989, none, 144 * 128, **run)
    return {
        "bound_tokens_per_s": bound.tokens_per_s,
        "simulated": {"tokens_per_s": sim.tokens_per_s, "concurrency": sim.concurrency},
        "varied_tokens_per_s": varied.tokens_per_s,
    }


def test_plans_past_16_gpus_or_16384_requests_are_simulated_at_scale():
    small = Deployment("aep", "h800", 8, "h800", 8)
    assert scale.is_exact(small, 16384, 9) and not scale.is_exact(small, 16385, 9)
    assert not scale.is_exact(small, 1024, 257)  # DeepSeek-V3's experts: hours a plan event by event
    assert not scale.is_exact(Deployment("ep", "h800", 32), 1024)
    f = ep_as_deployed_at_scale.check()
    bound, sim, varied = f["bound_tokens_per_s"], f["simulated"]["tokens_per_s"], f["varied_tokens_per_s"]
    # EP as deployed's bound (bound_ep._ep_at_scale) charges no step-time variance, so it is compared with the
    # simulation without it; with the sourced variance (simulate()'s default, at scale too) each micro-batch's
    # barriers wait for the slowest device: a loss, and no more than the slowest speed and jitter together.
    assert f["simulated"]["concurrency"] == 144 * 128
    assert sim <= 1.005 * bound  # above the bound only by the rounding of expected loads
    assert sim / (1.04 * 1.04) < varied < sim
