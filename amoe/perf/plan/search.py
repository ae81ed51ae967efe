"""`amoe plan`: which deployment serves a model best on the GPUs at hand (MegaScale-Infer's deployment-plan search,
over amoe's modes).

It enumerates AEP splits (how many GPUs run attention and how many experts, and which GPU type takes which role
when the pool is heterogeneous), attention and expert batch caps, expert placements (round robin, or balanced for
the routing's skew), ping-pong micro-batch counts and EP group sizes; predicts each one's decode throughput, ITL and
cost per million output tokens with the cost model's bounds (amoe.perf.plan.bounds, at the model's full depth);
drops those over the ITL objective; and prints the best, each with the `amoe serve` command that runs it.

    amoe plan --model-profile mixtral-8x7b-mqa --gpus a100-80g:8 --workload short --top-k 1
    amoe plan --model-profile mixtral-8x7b-mqa --gpus a100-80g:8,h100:4 --price a100-80g=1.5,h100=3 --json
    amoe plan --model /models/DeepSeek-V3 --gpus h100:16     # any supported checkpoint: its config.json's shapes
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
from threadpoolctl import threadpool_limits

from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.routing import RoutingSpec, routing_inclusion
from amoe.perf.model.variance import StepVariance
from amoe.perf.model.workloads import mean_context
from amoe.perf.plan import bounds
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.prediction import Prediction
from amoe.perf.plan.refine import RESOLUTION, refine
from amoe.perf.plan.request import MICRO_BATCHES, Plan, PlanRequest, check_policy, plan_profile


def balanced_map(inclusion: np.ndarray, num_hosts: int) -> tuple[int, ...]:
    """Experts onto `num_hosts` GPUs so their total loads (over every block) are as even as a greedy
    largest-first packing makes them; ties keep round robin's order."""
    load = inclusion.sum(axis=0)
    order = sorted(range(len(load)), key=lambda e: (-load[e], e))
    where, totals, counts = [0] * len(load), [0.0] * num_hosts, [0] * num_hosts
    per_host = math.ceil(len(load) / num_hosts)  # keep memory even too: no GPU takes more than its share
    for e in order:
        g = min((h for h in range(num_hosts) if counts[h] < per_host), key=lambda h: (totals[h], h))
        where[e], totals[g], counts[g] = g, totals[g] + load[e], counts[g] + 1
    return tuple(where)


def counts(n: int) -> list[int]:
    """GPU counts to try out of n: every one up to 16, then a geometric grid (a 256-GPU pool has too many splits to
    try them all, and neighbouring splits differ little)."""
    if n <= 16:
        return list(range(1, n + 1))
    grid = {c for base in (1, 3) for c in (base * 2**i for i in range(12)) if c <= n}
    return sorted(grid | {n})


def candidates(req: PlanRequest, num_experts: int, inclusion: np.ndarray) -> Iterator[Deployment]:
    """Every deployment of the search space that fits the GPUs."""
    types = sorted(req.gpus)
    common = {"gpus_per_node": req.gpus_per_node}
    if "ep" in req.modes:
        for gpu in types:
            for n in counts(req.gpus[gpu]):
                replicas = req.gpus[gpu] // n if req.replicate else 1
                pipeline = {"ep_pipelines": 0, "ep_kernel": "auto"} if req.eps else {}
                for cap in req.attn_caps:
                    yield Deployment("ep", gpu, n, attn_cap=cap, replicas=replicas, **common, **pipeline)
                    if req.ep_redundant_experts and n > 1:
                        yield Deployment(
                            "ep", gpu, n, attn_cap=cap, replicas=replicas,
                            redundant_experts=req.ep_redundant_experts, two_batch_overlap=True, **common,
                        )  # fmt: skip
    for ta, te in itertools.product(types, types):
        for a in counts(req.gpus[ta]):
            room = req.gpus[te] - (a if ta == te else 0)
            for x in [c for c in counts(room) if c <= num_experts]:
                if ta == te:
                    copies = req.gpus[ta] // (a + x)
                else:
                    copies = min(req.gpus[ta] // a, req.gpus[te] // x)
                shape = {**common, "replicas": copies if req.replicate else 1}
                maps = {None, balanced_map(inclusion, x)} if req.balanced else {None}
                maps -= {tuple(e % x for e in range(num_experts))}
                for cap, expert_map in itertools.product(
                    req.attn_caps, [None, *sorted(m for m in maps if m)]
                ):
                    if "aep" in req.modes:
                        for ecap in req.expert_caps:
                            yield Deployment("aep", ta, a, te, x, cap, ecap, expert_map=expert_map, **shape)
                    if "pingpong" in req.modes:
                        for m in MICRO_BATCHES:
                            yield Deployment(
                                "pingpong",
                                ta,
                                a,
                                te,
                                x,
                                cap,
                                micro_batches=m,
                                expert_map=expert_map,
                                **common,
                            )


def search(req: PlanRequest) -> list[Plan]:
    """`_search` on one BLAS thread: the bounds' products are small ([blocks, expert ids] @ [expert ids, GPUs]) and
    OpenBLAS's threads, spinning on a loaded 2-core host, made one such step of 192 expert GPUs 8x slower (13.8 ms
    against 1.8 ms, measured; the same numbers to the last bit either way: gemm splits its output, not its sums)."""
    with threadpool_limits(limits=1, user_api="blas"):
        return _search(req)


def _search(req: PlanRequest) -> list[Plan]:
    """Every candidate's prediction, best first: by cost per million tokens when priced, else by throughput;
    candidates over the ITL objective or out of memory are dropped. The best `simulate_top` by the bounds, and of each
    mode the best of its `simulate_per_mode` best shapes, are then refined by the simulation (`refine`) and ranked
    first on those numbers: a bound is optimistic, so a simulated plan is never ranked below one that only has its
    bound. A refined plan that misses the ITL objective is dropped; a mode left with none refines its next plans
    (up to `refine_retries`) until one meets it."""
    model = bounds.full_depth(plan_profile(req))
    RoutingSpec.parse(req.routing)  # a clear error before any work
    check_policy(req.aep_policy)
    inclusion = routing_inclusion(model, req.routing, req.seed)
    ctx = req.context or mean_context(req.workload)
    host = host_overhead(req.host)
    variance = StepVariance.parse(req.step_variance)
    plans = []
    slo_s = req.itl_slo_ms / 1e3 if req.itl_slo_ms is not None else None
    for dep in candidates(req, model.num_expert_ids, inclusion):
        pred = bounds.predict(model, dep, inclusion, ctx, host, slo_s, variance)
        if pred.tokens_per_s > 0 and _meets_slo(pred, req):
            plans.append(Plan(dep, pred, _cost(dep, pred, req)))
    _rank(plans, req)
    if not req.simulate_top:
        return plans
    chosen = plans[: req.simulate_top]
    chosen += [p for p in best_shapes(plans, req.simulate_per_mode) if p not in chosen]
    refined = []

    def refine_one(plan: Plan) -> bool:
        pred = refine(
            model, plan.deployment, req.routing, ctx, host, plan.prediction, req.itl_slo_ms, variance=variance,
            policy=req.aep_policy,
        ).prediction  # fmt: skip
        if _meets_slo(pred, req):
            refined.append(Plan(plan.deployment, pred, _cost(plan.deployment, pred, req)))
        return _meets_slo(pred, req)

    for plan in chosen:
        refine_one(plan)
    # A mode whose refined plans all miss the objective in the simulation (the bound meets it, the schedule does
    # not): its next plans by the bound, one at a time, until one meets it or `refine_retries` more are spent.
    # Otherwise the mode's best would be a plan nobody simulated, ranked on the optimistic bound its betters
    # failed to reach.
    for mode in dict.fromkeys(p.deployment.mode for p in chosen):
        if any(p.deployment.mode == mode for p in refined):
            continue
        tried = set(map(id, chosen))
        following = [p for p in plans if p.deployment.mode == mode and id(p) not in tried]
        for plan in following[: req.refine_retries]:
            chosen.append(plan)
            if refine_one(plan):
                break
    _rank(refined, req)
    if not req.prices:
        refined[:] = prefer_headroom(refined)
    # A chosen plan too large to simulate (refine keeps its bound) ranks after every simulated one: its bound is
    # optimistic and would otherwise beat the simulated figures it was chosen to be compared with.
    refined.sort(key=lambda p: not p.prediction.extra.get("simulated"))
    return refined + [p for p in plans if p not in chosen]


def prefer_headroom(plans: list[Plan]) -> list[Plan]:
    """`plans` (ranked by throughput) with each place given to the lowest-ITL plan of those left within the
    simulation's resolution (RESOLUTION) of the best left: the rule each plan's own operating point already follows
    (the least concurrency within 3 % of the most, refine and the bound), now between plans. Why: the simulation
    cannot tell such plans apart, and the one at the objective's edge has no room for the runtime's ITL, which
    measured 1-3 % over its simulation's on AEP plans (the 100 ms table, H100 top-2: a plan simulated at 97.1 ms
    measured 99.7 ms, where a plan 1.1 % slower by the simulation sat at 83 ms;
    experiments/2026-11-28-headroom)."""
    left, ranked = list(plans), []
    while left:
        best = left[0].prediction.tokens_per_s
        # min keeps the first of equal ITLs, so a tie stays in the throughput order
        pick = min(
            (p for p in left if p.prediction.tokens_per_s >= (1 - RESOLUTION) * best),
            key=lambda p: p.prediction.itl_s,
        )
        ranked.append(pick)
        left.remove(pick)
    return ranked


def _meets_slo(pred: Prediction, req: PlanRequest) -> bool:
    return req.itl_slo_ms is None or pred.itl_s * 1e3 <= req.itl_slo_ms


def _cost(dep: Deployment, pred: Prediction, req: PlanRequest) -> float | None:
    if not req.prices:
        return None
    dollars_per_s = sum(req.prices[g] * n for g, n in dep.gpus().items()) / 3600
    return dollars_per_s / pred.tokens_per_s * 1e6


def _rank(plans: list[Plan], req: PlanRequest) -> None:
    if req.prices:
        plans.sort(key=lambda p: (p.cost_per_mtok, -p.prediction.tokens_per_s))
    else:
        # Bounds that tie (an attention-bound AEP plan's expert caps and placements all reach the same figure):
        # the one with the most slack on its critical path first, since a schedule's shortfall shows first on a
        # path that has none (the lock-step modes' path is their ITL).
        plans.sort(
            key=lambda p: (
                -p.prediction.tokens_per_s,
                p.deployment.num_gpus,
                p.prediction.itl_s,
                p.prediction.extra.get("critical_path_s", p.prediction.itl_s),
            )
        )


def best_per_mode(plans: list[Plan]) -> dict[str, Plan]:
    """Each mode's best plan (the first of its mode in `plans`)."""
    return {plan.deployment.mode: plan for plan in best_shapes(plans, 1)}


def shape(d: Deployment) -> tuple:
    """What a deployment's batch caps and expert placement leave out: its mode and GPUs in each role."""
    return (d.mode, d.attn_gpu, d.num_attn, d.expert_gpu, d.num_expert, d.replicas, d.micro_batches)


def best_shapes(plans: list[Plan], per_mode: int) -> list[Plan]:
    """Of each mode, the best plan (the first in `plans`) of each of its `per_mode` best shapes."""
    seen: dict[tuple, Plan] = {}
    taken: dict[str, int] = {}
    for plan in plans:
        key, mode = shape(plan.deployment), plan.deployment.mode
        if key not in seen and taken.get(mode, 0) < per_mode:
            seen[key] = plan
            taken[mode] = taken.get(mode, 0) + 1
    return list(seen.values())
