"""Transfers between AEP's and ping-pong's pools on both ends' links (issue 35, the incast): with A attention GPUs
feeding E < A expert GPUs each expert GPU receives about A / E times what one attention GPU sends, through its own
NIC, and that NIC can bound the deployment; with A ≤ E the receiver's end never binds and plans keep their
numbers."""

from __future__ import annotations

from dataclasses import replace

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


@pytest.fixture(scope="module")
def ds():
    model = model_profile("deepseek-v3")
    return model, routing_inclusion(model, "uniform")


def test_many_attention_gpus_feeding_few_expert_gpus_are_limited_by_the_expert_gpus_nic(ds):
    """128 attention GPUs feed 16 expert GPUs across hosts: each expert GPU receives 128 · 8 / 16 = 64 row copies
    per attention row, 8 times what an attention GPU sends. Priced on the sender's link alone (before issue 35's
    fix) the bounds put ping-pong at 2.1× (199,925 tokens/s) and AEP at 4.5× (433,698) what the expert GPUs'
    NICs can carry, and the simulation at scale ping-pong at 2.4× and AEP at 3.8×."""
    model, q = ds
    hand = _link_limited_tokens_per_s(model, 16)
    assert hand == pytest.approx(40e9 / (58 * 0.5 * 7168 * 2))  # 96,209 tokens/s
    pp = Deployment("pingpong", "h800", 128, "h800", 16, attn_cap=128, micro_batches=4)
    pred = bounds.predict(model, pp, q, CTX, NONE, variance=OFF)
    assert pred.bottleneck == "link"
    assert pred.tokens_per_s == pytest.approx(hand, rel=1e-9)
    assert pred.itl_s == pytest.approx(pred.extra["link_s"], rel=1e-12)
    # The simulation at scale cannot beat the NIC either, and gets close to it.
    sim = scale.pingpong(model, pp, "uniform", CTX, NONE, pred.concurrency, 0.5, seed=0)
    assert 0.85 * hand <= sim.tokens_per_s <= 1.001 * hand
    # AEP's best operating point is the NIC's rate too (whatever its waves: the bytes per token are the same).
    aep = Deployment("aep", "h800", 128, "h800", 16, attn_cap=128, expert_cap=1024)
    best = bounds.predict(model, aep, q, CTX, NONE, variance=OFF)
    assert 0.97 * hand <= best.tokens_per_s <= hand * (1 + 1e-9)
    sim = scale.aep_waves(
        model, aep, "uniform", CTX, NONE, best.concurrency, 0.5, warmup_s=0.25, seed=0
    )  # fmt: skip
    assert sim.tokens_per_s <= 1.01 * hand


def test_with_no_more_attention_than_expert_gpus_the_receiver_never_binds(ds, monkeypatch):
    """A ≤ E under uniform routing: each expert GPU receives at most what one attention GPU sends, so pricing
    the receiver's end changes nothing: the bound equals itself with the receiving links made free, and the
    simulation at scale gives the figures it gave before issue 35's incast pricing (pinned from that code; AEP
    with every attention GPU on one phase, as that code ran it: on their own phases the expert steps split, a
    change of the model, not of the links — tests/test_aep_phases.py)."""
    model, q = ds
    deps = [
        Deployment("pingpong", "h800", 16, "h800", 32, attn_cap=128, micro_batches=2),
        Deployment("aep", "h800", 16, "h800", 32, attn_cap=128, expert_cap=1024),
    ]
    sims = [
        scale.pingpong(model, deps[0], "uniform", CTX, NONE, 4096, 0.05, seed=0).tokens_per_s,
        scale.aep_waves(
            model, deps[1], "uniform", CTX, NONE, 4096, 0.05, 0.05, 0, same_phase=True
        ).tokens_per_s,
    ]
    assert sims == pytest.approx([53144.72345968983, 69208.27586206896], rel=1e-9)
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
