"""The scheduling policies in the simulation at full depth (32 blocks), at the corrected AEP bound's concurrency and
twice it, on three of the planner's AEP plans. One JSON line per run.

    amoe bench policies-sim > policies_sim.jsonl
    amoe bench policies-sim waves                  # only the policies named
    amoe bench policies-sim --stagger waves        # each attention rank starts at its own time

`--stagger`: the simulation's `stagger_ranks` (docs/scheduler.md "The straggler wait"): the attention ranks' waves
start out of phase, as the runtime's arrivals make them, instead of all at once. `--no-rank-barrier`: waves'
expert side with no wait (the oldest block), for comparison.
"""

from __future__ import annotations

import argparse
import json

from amoe.config import POLICIES, SchedulerSection
from amoe.errors import ConfigError
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan import bounds as B
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate import simulate

ROUTING = "skew-exp:0.08"
# (GPU, top-k, attention GPUs, expert GPUs, attention cap, expert cap) of the three plans.
PLANS = (
    ("a100-80g", 1, 5, 3, 128, 1024),
    ("h100", 2, 4, 3, 256, 1024),
    ("h100", 1, 4, 4, 256, 512),
)


def main(args: argparse.Namespace) -> int:
    """`amoe bench policies-sim` (its flags: amoe.perf.studies.commands)."""
    chosen = args.policies or list(POLICIES)
    if unknown := set(chosen) - set(POLICIES):
        raise ConfigError(
            f"policies-sim: unknown policies {sorted(unknown)} (expected some of {', '.join(POLICIES)})"
        )
    host, ctx = host_overhead("amoe-paper"), mean_context("short")
    for gpu, k, a, e, cap, ecap in PLANS:
        m = B.full_depth(model_profile("mixtral-8x7b-mqa", k))
        d = Deployment("aep", gpu, a, gpu, e, cap, ecap)
        bound = B.predict(m, d, routing_inclusion(m, ROUTING), ctx, host)
        for mult in (1, 2):
            for policy in chosen:
                row = _run(m, d, bound, mult, policy, args.stagger, not args.no_rank_barrier, ctx, host)
                print(json.dumps({"plan": f"aep {a}+{e} {gpu} top{k} cap {cap}/{ecap}", **row}), flush=True)
    return 0


def _run(m, d, bound, mult: int, policy: str, stagger: bool, barrier: bool, ctx: float, host) -> dict:
    """One simulation of `d` at `mult` times the bound's concurrency under `policy`, as one JSON line's fields."""
    c = mult * bound.concurrency
    s = simulate(
        m, d, ROUTING, ctx, host, c, warmup_s=4 * bound.itl_s * mult, duration_s=8 * bound.itl_s * mult,
        scheduler=SchedulerSection(policy=policy, attn_batch_cap=d.attn_cap, expert_batch_cap=d.expert_cap),
        stagger_ranks=stagger, rank_barrier=barrier,
    )  # fmt: skip
    return {
        "bound": round(bound.tokens_per_s),
        "bound_concurrency": bound.concurrency,
        "concurrency": c,
        "policy": policy,
        "ranks_start": "staggered" if stagger else "together",
        "rank_barrier": barrier,
        "tokens_per_s": round(s.tokens_per_s),
        "of_bound": round(s.tokens_per_s / bound.tokens_per_s, 3),
        "itl_ms": round(s.itl_s * 1e3, 1),
        "attention_rows_per_step": round(s.attention_rows_per_step, 1),
        "expert_rows_per_step": round(s.expert_rows_per_step, 1),
        "attention_busy": round(s.attention_busy, 2),
        "expert_busy": round(s.expert_busy, 2),
    }
