"""Transfers between AEP's and ping-pong's pools on both ends' links (the incast): with A attention GPUs
feeding E < A expert GPUs each expert GPU receives about A / E times what one attention GPU sends, through its own
NIC, and that NIC can bound the deployment; with A ≤ E the receiver's end never binds and plans keep their
numbers."""

from __future__ import annotations

import functools
from dataclasses import replace

import golden
import pytest

from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.variance import OFF
from amoe.perf.plan import bound_pools, bounds
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate import scale

NONE = host_overhead("none")
CTX = 2000.0


def _link_limited_tokens_per_s(model, expert_gpus: int) -> float:
    """By hand: under uniform routing every expert GPU of `expert_gpus` (round robin) gets top-k / E of each
    token's row copies per block and returns them in BF16 through one NIC, so no deployment can decode faster than
    that NIC's usable bandwidth over those bytes per token."""
    nic = gpu_profile("h800").network.bandwidth * 0.80  # 400 Gb/s CX7 per H800 at the links' efficiency
    rows_per_token = model.num_blocks * model.top_k / expert_gpus  # into (and back out of) each expert GPU
    return nic / (rows_per_token * model.hidden_size * 2)


@functools.cache
def deepseek_uniform():
    """DeepSeek-V3 and its inclusion probabilities under uniform routing (sampled: computed once)."""
    model = model_profile("deepseek-v3")
    return model, routing_inclusion(model, "uniform")


@pytest.fixture(scope="module")
def ds():
    return deepseek_uniform()


@golden.case("incast")
def nic_limited_plans() -> golden.Figures:
    """128 attention H800s feeding 16 expert H800s, DeepSeek-V3 under uniform routing: the bounds and the
    simulations at scale of ping-pong and AEP."""
    model, q = deepseek_uniform()
    pp = Deployment("pingpong", "h800", 128, "h800", 16, attn_cap=128, micro_batches=4)
    pred = bounds.predict(model, pp, q, CTX, NONE, variance=OFF)
    pp_sim = scale.pingpong(model, pp, "uniform", CTX, NONE, pred.concurrency, 0.5, seed=0)
    aep = Deployment("aep", "h800", 128, "h800", 16, attn_cap=128, expert_cap=1024)
    best = bounds.predict(model, aep, q, CTX, NONE, variance=OFF)
    aep_sim = scale.aep_waves(model, aep, "uniform", CTX, NONE, best.concurrency, 0.5, warmup_s=0.25, seed=0)
    return {
        "pingpong": {"bound": {"tokens_per_s": pred.tokens_per_s, "itl_s": pred.itl_s, "link_s": pred.extra["link_s"],
                               "bottleneck": pred.bottleneck},
                     "simulated_tokens_per_s": pp_sim.tokens_per_s},
        "aep": {"bound_tokens_per_s": best.tokens_per_s, "simulated_tokens_per_s": aep_sim.tokens_per_s},
    }  # fmt: skip


def test_many_attention_gpus_feeding_few_expert_gpus_are_limited_by_the_expert_gpus_nic():
    """128 attention GPUs feed 16 expert GPUs across hosts: each expert GPU receives 128 · 8 / 16 = 64 row copies
    per attention row, 8 times what an attention GPU sends. Priced on the sender's link alone the bounds put
    ping-pong at 2.1× (199,925 tokens/s) and AEP at 4.5× (433,698) what the expert GPUs' NICs can carry, and the
    simulation at scale ping-pong at 2.4× and AEP at 3.8×."""
    hand = _link_limited_tokens_per_s(deepseek_uniform()[0], 16)
    assert hand == pytest.approx(40e9 / (58 * 0.5 * 7168 * 2))  # 96,209 tokens/s
    f = nic_limited_plans.check()
    pp = f["pingpong"]
    # The NIC's term is the hand figure; under the 2026-11-29 calibration the expert GPUs' steps are 5 % slower
    # still, so the bound sits just under the NIC (bottleneck "experts"), never over it.
    concurrency = pp["bound"]["tokens_per_s"] * pp["bound"]["itl_s"]
    assert concurrency / pp["bound"]["link_s"] == pytest.approx(hand, rel=1e-9)
    assert pp["bound"]["tokens_per_s"] <= hand * (1 + 1e-9)
    assert pp["bound"]["bottleneck"] in ("link", "experts")
    # The simulation at scale cannot beat the NIC either.
    assert pp["simulated_tokens_per_s"] <= 1.001 * hand
    # AEP's best operating point is at most the NIC's rate too (whatever its waves: the bytes per token are the same).
    assert f["aep"]["bound_tokens_per_s"] <= hand * (1 + 1e-9)
    assert f["aep"]["simulated_tokens_per_s"] <= 1.01 * hand


@golden.case("incast")
def receiver_never_binds() -> golden.Figures:
    """16 attention H800s feeding 32 expert H800s at 4,096 requests: the simulations at scale of ping-pong and of
    AEP with every attention GPU on one phase."""
    model, _ = deepseek_uniform()
    pp = Deployment("pingpong", "h800", 16, "h800", 32, attn_cap=128, micro_batches=2)
    aep = Deployment("aep", "h800", 16, "h800", 32, attn_cap=128, expert_cap=1024)
    return {
        "pingpong": scale.pingpong(model, pp, "uniform", CTX, NONE, 4096, 0.05, seed=0).tokens_per_s,
        "aep_one_phase": scale.aep_waves(
            model, aep, "uniform", CTX, NONE, 4096, 0.05, 0.05, 0, same_phase=True
        ).tokens_per_s,
    }


def test_with_no_more_attention_than_expert_gpus_the_receiver_never_binds(ds, monkeypatch):
    """A ≤ E under uniform routing: each expert GPU receives at most what one attention GPU sends, so pricing
    the receiver's end changes nothing: the bound equals itself with the receiving links made free. The simulation
    at scale of these plans is the golden file's (its entries were, when made, the figures the code before the
    incast pricing gave: AEP with every attention GPU on one phase, as that code ran it; on their own phases the
    expert steps split, a change of the model, not of the links — tests/test_aep_phases.py)."""
    model, q = ds
    receiver_never_binds.check()
    deps = [
        Deployment("pingpong", "h800", 16, "h800", 32, attn_cap=128, micro_batches=2),
        Deployment("aep", "h800", 16, "h800", 32, attn_cap=128, expert_cap=1024),
    ]
    priced = [bounds.predict(model, d, q, CTX, NONE, variance=OFF) for d in deps]
    real = bound_pools.pool_links

    def sender_only(model, dep):
        return replace(real(model, dep), expert_in=0.0, expert_out=0.0)

    monkeypatch.setattr(bound_pools, "pool_links", sender_only)
    free = [bounds.predict(model, d, q, CTX, NONE, variance=OFF) for d in deps]
    assert [(p.tokens_per_s, p.itl_s, p.bottleneck) for p in priced] == [
        (p.tokens_per_s, p.itl_s, p.bottleneck) for p in free
    ]


def test_the_frontier_table_names_a_bad_mode(tmp_path):
    """`amoe bench frontier --table --modes` runs some of the three modes (a change to AEP's and ping-pong's links
    leaves EP's cells as they were); an unknown one is a one-line error before any cell runs."""
    import argparse

    from amoe.perf.studies import frontier

    args = argparse.Namespace(
        out=str(tmp_path), sizes="16", profiles="deepseek-v3", gpu="h800", modes="aep,foo"
    )
    with pytest.raises(SystemExit, match="--modes takes aep, pingpong, ep"):
        frontier.table_main(args)
    assert not (tmp_path / "table.jsonl").exists()
