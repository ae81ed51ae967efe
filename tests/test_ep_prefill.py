"""EP as deployed beyond decode's plain step: prefill (amoe.perf.model.ep_prefill, amoe.perf.plan.prefill) on
DeepSeek's schedule, and multi-token prediction in decode (Deployment.draft_tokens)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from amoe.perf.model import calibrations
from amoe.perf.model import ep_prefill as pf
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.links import nodes_touched, normal_exchange_time
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.plan import bounds
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.prefill import prefill_step


def profile_step(**change):
    """The prefill step of DeepSeek's prefill profile's workload (EP32 H800s, 16,384 tokens of 4K prompts a GPU,
    balanced routing)."""
    model = model_profile("deepseek-v3")
    dep = replace(Deployment("ep", "h800", 32, two_batch_overlap=True), **change)
    return prefill_step(model, dep, routing_inclusion(model, "uniform"), 16384, 4096)


def test_the_prefill_model_prices_the_profiles_kernels_as_the_calibration_derived_them():
    """At the workload its constants came from, the prefill model's GEMM, attention-core and expert time a layer
    are the profile's bars: the derivation and the model price the same kernels the same way."""
    bars = calibrations.load_raw(calibrations.ACTIVE)["sources"]["prefill_profile"]["bars_ms"]
    got = profile_step().per_layer
    assert got["gemm"] * 1e3 == pytest.approx(bars["gemm"], rel=1e-9)
    assert got["core"] * 1e3 == pytest.approx(bars["attention_core"], rel=1e-9)
    assert got["experts"] * 1e3 == pytest.approx(bars["moe"], rel=1e-9)


def test_with_the_overlap_a_layer_is_the_longer_stream_without_it_their_sum():
    gpu = gpu_profile("h800")
    k = gpu.kernels
    assert pf.layer_time(3.0, 1.0, 1.0, gpu, False) == 5.0
    assert pf.layer_time(3.0, 1.0, 1.0, gpu, True) == pytest.approx(6.0 * (1 + k.prefill_stream_bubble))
    assert pf.layer_time(1.0, 3.0, 3.0, gpu, True) == 12.0
    assert pf.sm_share(gpu, True) == (132 - 24) / 132 and pf.sm_share(gpu, False) == 1.0
    overlapped, serial = profile_step(), profile_step(two_batch_overlap=False)
    # without the overlap the exchange kernels run at their unit-test speed and compute has every SM
    assert serial.per_layer["dispatch"] < overlapped.per_layer["dispatch"]
    assert serial.per_layer["experts"] < overlapped.per_layer["experts"]


def test_a_token_is_sent_once_per_node_its_experts_touch():
    """DeepEP's normal kernels: with DeepSeek-V3's group-limited routing (4 of 8 groups, 2 groups a node over 4
    nodes) a token touches 4 (1 - C(6,4) / C(8,4)) nodes; without group limits top-8 of 128 experts at random."""
    v3, qwen = model_profile("deepseek-v3"), model_profile("qwen3-235b-a22b")
    assert nodes_touched(v3, 4) == pytest.approx(4 * (1 - math.comb(6, 4) / math.comb(8, 4)))
    assert nodes_touched(v3, 8) == pytest.approx(4.0)  # a group a node: the 4 groups' nodes
    assert nodes_touched(qwen, 4) == pytest.approx(4 * (1 - math.comb(96, 8) / math.comb(128, 8)))
    assert nodes_touched(v3, 1) == 1.0
    gpu = gpu_profile("h800")
    one = normal_exchange_time(v3, gpu, 8192, 32, 8, "combine")
    assert normal_exchange_time(v3, gpu, 16384, 32, 8, "combine") == pytest.approx(2 * one)
    assert normal_exchange_time(v3, gpu, 8192, 32, 8, "dispatch") < one  # FP8 out, BF16 back


def test_mtp_verifies_more_rows_a_step_and_credits_the_accepted_drafts():
    """One draft token a request: every layer runs 2 rows a request and the MTP module's layer once more; the
    tokens a step are the requests times 1 + acceptance."""
    model = model_profile("deepseek-v3")
    q = routing_inclusion(model, "uniform")
    base = Deployment("ep", "h800", 128, attn_cap=128, two_batch_overlap=True)
    none = host_overhead("none")
    plain = bounds.predict(model, base, q, 4096, none)
    rejected = bounds.predict(model, replace(base, draft_tokens=1, draft_acceptance=0.0), q, 4096, none)
    accepted = bounds.predict(model, replace(base, draft_tokens=1, draft_acceptance=1.0), q, 4096, none)
    assert rejected.tokens_per_s < plain.tokens_per_s  # the same tokens for more work
    assert accepted.tokens_per_s == pytest.approx(2 * rejected.tokens_per_s)
    assert accepted.concurrency == plain.concurrency == 128 * 128
    # the step: its ITL is the step over the tokens a request gains in it
    assert accepted.itl_s == pytest.approx(rejected.itl_s / 2)


def test_the_simulation_at_scale_runs_mtp_as_the_bound_prices_it():
    """Without step-time variance and on balanced routing the lock-step simulation's step is the bound's, MTP and
    two-batch overlap included (its counts drawn each iteration keep it within a few per cent)."""
    from amoe.perf.model.variance import OFF
    from amoe.perf.plan.simulate import scale

    model = model_profile("deepseek-v3")
    q = routing_inclusion(model, "uniform")
    dep = Deployment(
        "ep", "h800", 128, attn_cap=128, two_batch_overlap=True, draft_tokens=1, draft_acceptance=0.6
    )
    none = host_overhead("none")
    bound = bounds.predict(model, dep, q, 4096, none, variance=OFF)
    sim = scale.ep(model, dep, "uniform", 4096, none, 128 * 128, 0.5, 0, OFF)
    assert sim.concurrency == bound.concurrency
    assert sim.tokens_per_s == pytest.approx(bound.tokens_per_s, rel=0.05)
    assert sim.tokens_per_s <= bound.tokens_per_s * 1.001  # drawn counts only add to the slowest device
