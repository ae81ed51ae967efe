"""AEP's bound for a schedule that merges no two ranks (docs/simulation.md "Merged ranks move at the slowest rank's
pace"): each attention rank's groups are expert steps of their own, so each rank runs at its own speed, and the
expert GPUs' time is shared among the ranks. Not the planner's bound: it checks that the merged bound
(amoe.perf.plan.bound_pools `_aep`) is the larger at the tables' operating points (seconds):

    amoe bench aep-unmerged [--itl-slo-ms 100]

For every (w, W, m) as `_aep` searches them: rank r's ITL is at least own_r = max(its path with its own group's step,
W · attention work · s_r, link), and the busiest expert GPU spends c = (W / m) · Σ_blocks grouped(m · w rows) per
iteration of each rank, so with x_r = 1 / ITL_r the throughput W · w · Σ x_r is at most W · w · min(Σ_r 1 / own_r,
1 / c) (x_r ≤ 1 / own_r, Σ_r c · x_r ≤ 1). One JSON line per plan: the merged bound and this one.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model.cost_model import attention_batch
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.variance import SOURCED, expected_max
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan import bounds as B
from amoe.perf.plan.bound_pools import MAX_WAVES, doublings, pool_links
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.expert_steps import expert_shares, grouped_steps
from amoe.perf.plan.search import balanced_map
from amoe.perf.studies.waves_emulated import PLANS as WAVES32  # waves-emulated's seven plans
from amoe.perf.studies.waves_emulated import ROUTING

# The 100 ms table's AEP plans (experiments/2026-11-27-itl-100ms-slowest-rank-pace/100/plan_table.json).
TABLE = (
    ("a100-80g", 1, 4, 4, 512, 512, True),
    ("a100-80g", 2, 4, 4, 256, 512, True),
    ("h100", 1, 6, 2, 512, 1024, False),
    ("h100", 2, 5, 3, 512, 1024, False),
)


def unmerged(model, dep, slo_s=None, variance=SOURCED):
    """(tokens/s, requests, ITL s) of the best unmerged point, or None when none meets slo_s."""
    q = routing_inclusion(model, ROUTING)
    host, ctx = host_overhead("amoe-paper"), mean_context("short")
    ga, ge = gpu_profile(dep.attn_gpu), gpu_profile(dep.expert_gpu)
    placed = dep.experts_on(model.num_expert_ids)
    weights = cm.attention_rank_weight_bytes(model)
    b = attention_batch(model, ga, dep.attn_cap, weights, ctx)
    kv = max(b, int(cm.kv_capacity_tokens(ga, model, weights) // max(ctx, 1)))
    ctx = int(round(ctx))
    blocks, A, k = model.num_blocks, dep.num_attn, model.experts_per_token
    links = pool_links(model, dep)
    share = expert_shares(placed, q)
    hottest, per_iteration = share.max(axis=1), float(share.sum(axis=0).max())
    s_attn, s_exp = variance.speeds(0, A), variance.speeds(A, len(placed))
    best = None
    for w in doublings(1, b):
        t_attn = cm.decode_attention_time(model, ga, w, ctx, host)
        attn_busy = blocks * t_attn + cm.head_time(model, ga, w, host=host)
        # One rank's wave alone reaches the expert GPUs: w rows, not A · w.
        moves = float(np.sum(links.out_s(w * k, w * hottest) + links.back_s(w * k, w * hottest)))
        link_1 = max(
            A * w * per_iteration * max(links.expert_in, links.expert_out),
            blocks * w * k * max(links.attn_out, links.attn_in),
        )
        for W in doublings(1, max(1, min(MAX_WAVES, kv // w))):
            m = 1
            while m <= W:
                steps = grouped_steps(model, ge, placed, q, m * w, dep.expert_cap, host) * s_exp
                wait = float(np.sum(expected_max(steps, variance.jitter)))
                own = np.maximum(
                    moves + m * attn_busy * s_attn + wait, np.maximum(W * attn_busy * s_attn, W * link_1)
                )
                c = (W // m) * float(steps.sum(axis=0).max())
                tps = W * w * min(float(np.sum(1 / own)), 1 / c)
                itl = A * W * w / tps
                if (slo_s is None or itl <= slo_s) and (best is None or tps > best[0]):
                    best = (tps, A * W * w, itl)
                m *= 2
    return best


def line(name, model, dep, slo_s):
    merged = B.predict(model, dep, routing_inclusion(model, ROUTING), mean_context("short"),
                       host_overhead("amoe-paper"), slo_s)  # fmt: skip
    got = unmerged(model, dep, slo_s)
    return {
        "plan": name,
        "merged": round(merged.tokens_per_s),
        "merged_requests": merged.concurrency,
        "unmerged": None if got is None else round(got[0]),
        "unmerged_requests": None if got is None else got[1],
        "unmerged_itl_ms": None if got is None else round(got[2] * 1e3, 1),
    }


def main(args: argparse.Namespace) -> int:
    """`amoe bench aep-unmerged` (its flags: amoe.perf.studies.commands)."""
    slo_s = args.itl_slo_ms / 1e3 if args.itl_slo_ms else None
    if slo_s is not None:
        for gpu, k, a, e, cap, ecap, balanced in TABLE:
            model = model_profile("mixtral-8x7b-mqa", k)
            q = routing_inclusion(model, ROUTING)
            where = balanced_map(q, e) if balanced else None
            dep = Deployment("aep", gpu, a, gpu, e, cap, ecap, expert_map=where)
            print(json.dumps(line(f"{gpu} top{k} {a}+{e} cap {cap}/{ecap}", model, dep, slo_s)))
        return 0
    for i, (gpu, k, a, e, cap, ecap) in enumerate(WAVES32):
        model = model_profile("mixtral-8x7b-mqa:32", k)
        dep = Deployment("aep", gpu, a, gpu, e, cap, ecap)
        print(json.dumps(line(f"waves32 plan {i}", model, dep, slo_s)))
    return 0
