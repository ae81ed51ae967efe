"""`amoe plan`: which deployment serves a model best on the GPUs at hand (MegaScale-Infer's deployment-plan search,
over amoe's modes).

It enumerates AEP splits (how many GPUs run attention and how many experts, and which GPU type takes which role
when the pool is heterogeneous), attention and expert batch caps, expert placements (round robin, or balanced for
the routing's skew), ping-pong micro-batch counts and EP group sizes; predicts each one's decode throughput, ITL and
cost per million output tokens with the cost model's bounds (amoe.emulation.bounds, at the model's full depth);
drops those over the ITL objective; and prints the best, each with the `amoe serve` command that runs it.

    amoe plan --model-profile mixtral-8x7b-mqa --gpus a100-80g:8 --workload short --top-k 1
    amoe plan --model-profile mixtral-8x7b-mqa --gpus a100-80g:8,h100:4 --price a100-80g=1.5,h100=3 --json
    amoe plan --model /models/DeepSeek-V3 --gpus h100:16     # any supported checkpoint: its config.json's shapes
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from amoe.config import POLICIES
from amoe.emulation import bounds
from amoe.errors import ConfigError
from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import GPUS
from amoe.perf.model.hosts import host_overhead
from amoe.perf.model.models import model_profile
from amoe.perf.model.routing import DEFAULT_LAMBDA, RoutingSpec, routing_inclusion
from amoe.perf.model.variance import StepVariance
from amoe.perf.model.workloads import mean_context

ATTN_CAPS = (32, 64, 128, 256, 512, 1024)
EXPERT_CAPS = (256, 512, 1024)
MICRO_BATCHES = (2, 3, 4)
# The scheduling policy the planner simulates, measures and serves AEP plans with (`--aep-policy`): `waves`
# (docs/engine.md "The waves rule"). Checked against defrag, the runtime's default, on the 100 ms table's AEP plans
# before the table was rerun with it (docs/results.md "Under a 100 ms ITL target, measured (m32, 2026-11-27)").
AEP_POLICY = "waves"
# `--aep-policy best`: each AEP plan refined with each of these and served with the one whose simulation gives more
# within the ITL objective (ties: the first). Why per plan: under 100 ms waves was the better on 3 of the 100 ms
# table's 4 AEP plans and defrag on the fourth (A100 top-1, where a rank holds less than one wave of requests).
BEST = "best"
BEST_OF = ("waves", "defrag")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanRequest:
    """What the user asks `amoe plan` for."""

    profile: str  # a named model profile, or (with model_dir) the checkpoint's name
    gpus: dict[str, int]  # available GPUs by type
    workload: str = "short"
    top_k: int | None = None
    routing: str = f"skew-exp:{DEFAULT_LAMBDA:g}"
    itl_slo_ms: float | None = None
    prices: dict[str, float] | None = None  # $ per GPU-hour by type
    gpus_per_node: int = 8
    host: str = "amoe-paper"
    modes: tuple[str, ...] = ("aep", "ep", "pingpong")
    seed: int = 0
    attn_caps: tuple[int, ...] = ATTN_CAPS
    expert_caps: tuple[int, ...] = EXPERT_CAPS
    balanced: bool = True  # also try the skew-balanced expert placement
    replicate: bool = True  # also try copies of a smaller deployment behind one load balancer
    simulate_top: int = (
        3  # refine this many of the best plans by simulation; 0: bounds only (no refinement at all)
    )
    # ... and, of each mode, the best plan of this many shapes (GPUs in each role, copies, micro-batches): the best
    # by the bound can need far more requests in flight to fill its batches than a smaller split (H100 top-1).
    simulate_per_mode: int = 3
    # ... and, of a mode whose refined plans all miss the ITL objective, up to this many of its next plans, one at
    # a time, until one meets it (search).
    refine_retries: int = 3
    model_dir: str | None = None  # plan for this checkpoint's config.json instead of a named profile
    # EP deployments with EPS-MoE's expert pipeline, PN and kernel chosen by `auto` (`amoe plan --eps`)
    eps: bool = False
    # the GPUs' step-time variance the plans assume (amoe.emulation.variance): sourced | off | SPREAD[,...]
    step_variance: str = "sourced"
    # Frontier planning (issue 35): a mean decode context instead of the workload's (e.g. 2,000 tokens, as the
    # published DeepSeek-V3 deployments ran), and EP also as deployed at scale: EPLB's redundant experts (this
    # many) and two-batch overlap.
    context: float | None = None
    ep_redundant_experts: int = 0
    # the scheduling policy AEP plans are simulated with and served with (`amoe serve --scheduler`)
    aep_policy: str = AEP_POLICY


@dataclass(frozen=True)
class Plan:
    deployment: bounds.Deployment
    prediction: bounds.Prediction
    cost_per_mtok: float | None  # $ per million output tokens, with prices

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.prediction.tokens_per_s / self.deployment.num_gpus


def parse_gpus(text: str) -> dict[str, int]:
    """ "a100-80g:8,h100:4" → {"a100-80g": 8, "h100": 4}."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, count = part.strip().partition(":")
        if name not in GPUS:
            raise ConfigError(f"--gpus: unknown GPU {name!r}; choose from {', '.join(GPUS)}")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--gpus wants TYPE:COUNT with a positive count; got {part.strip()!r}")
        out[name] = out.get(name, 0) + int(count)
    return out


def parse_prices(text: str | None, gpus: dict[str, int]) -> dict[str, float] | None:
    """ "a100-80g=1.5,h100=3" → $ per GPU-hour; every GPU type of --gpus needs one."""
    if not text:
        return None
    prices: dict[str, float] = {}
    for part in text.split(","):
        name, _, value = part.strip().partition("=")
        try:
            prices[name] = float(value)
        except ValueError:
            raise ConfigError(f"--price wants TYPE=DOLLARS_PER_HOUR; got {part.strip()!r}") from None
        if prices[name] < 0:
            raise ConfigError(f"--price for {name} must be >= 0")
    missing = sorted(set(gpus) - set(prices))
    if missing:
        raise ConfigError(f"--price has no price for {', '.join(missing)}")
    return prices


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


def candidates(req: PlanRequest, num_experts: int, inclusion: np.ndarray):
    """Every deployment of the search space that fits the GPUs."""
    types = sorted(req.gpus)
    common = {"gpus_per_node": req.gpus_per_node}
    if "ep" in req.modes:
        for gpu in types:
            for n in counts(req.gpus[gpu]):
                replicas = req.gpus[gpu] // n if req.replicate else 1
                pipeline = {"ep_pipelines": 0, "ep_kernel": "auto"} if req.eps else {}
                for cap in req.attn_caps:
                    yield bounds.Deployment(
                        "ep", gpu, n, attn_cap=cap, replicas=replicas, **common, **pipeline
                    )
                    if req.ep_redundant_experts and n > 1:
                        yield bounds.Deployment(
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
                            yield bounds.Deployment(
                                "aep", ta, a, te, x, cap, ecap, expert_map=expert_map, **shape
                            )
                    if "pingpong" in req.modes:
                        for m in MICRO_BATCHES:
                            yield bounds.Deployment(
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


def plan_profile(req: PlanRequest):
    """The model a plan is for: a named profile, or the shapes of a checkpoint's config.json (any supported
    family; no weights are read)."""
    if req.model_dir is None:
        return model_profile(req.profile, req.top_k)
    from amoe.model.config import load_model_config
    from amoe.perf.model.shapes import profile_of

    profile = profile_of(load_model_config(req.model_dir), name=req.profile)
    if req.top_k is None or req.top_k == profile.top_k:
        return profile
    if not 1 <= req.top_k <= profile.num_experts:
        raise ConfigError(f"top_k must be in [1, {profile.num_experts}] for {req.profile}; got {req.top_k}")
    return replace(profile, top_k=req.top_k)


def check_policy(policy: str) -> str:
    """`policy` if it is a scheduling policy amoe serves with (amoe.config.POLICIES) or BEST, else a ConfigError."""
    if policy not in (*POLICIES, BEST):
        raise ConfigError(f"--aep-policy must be one of {', '.join((*POLICIES, BEST))}; got {policy!r}")
    return policy


def prefer_headroom(plans: list[Plan]) -> list[Plan]:
    """`plans` (ranked by throughput) with each place given to the lowest-ITL plan of those left within the
    simulation's resolution (RESOLUTION) of the best left: the rule each plan's own operating point already follows
    (the least concurrency within 3 % of the most, refine and the bound), now between plans. Why: the simulation
    cannot tell such plans apart, and the one at the objective's edge has no room for the runtime's ITL, which
    measured 1-3 % over its simulation's on AEP plans (the 100 ms table, H100 top-2: a plan simulated at 97.1 ms
    measured 99.7 ms, where a plan 1.1 % slower by the simulation sat at 83 ms; docs/results.md "Headroom")."""
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


def _meets_slo(pred: bounds.Prediction, req: PlanRequest) -> bool:
    return req.itl_slo_ms is None or pred.itl_s * 1e3 <= req.itl_slo_ms


def _cost(dep: bounds.Deployment, pred: bounds.Prediction, req: PlanRequest) -> float | None:
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


# Throughputs the simulation cannot tell apart (a fraction): an AEP plan's operating point is the least concurrency
# within it of the most (refine, bounds._aep), and of plans within it of each other the lowest ITL ranks first.
RESOLUTION = 0.03
# Doublings of concurrency the simulation tries above the bound's operating point (AEP): the bound's point fills
# every batch at once, the runtimes need more requests in flight to fill theirs.
SIM_DOUBLINGS = 3
# Requests of one copy up to which AEP's refinement doubles concurrency event by event (~2 s for 6,000 at full depth);
# past it, or past 16 GPUs a copy, the simulation runs at scale (amoe.emulation.simulate_scale, issue 35), which
# doubles up to the requests the attention GPUs' KV cache holds. No plan keeps its bound for being large.
SIM_MAX_REQUESTS = 16384
# AEP at scale (amoe.emulation.aep_at_scale) splits refine's window of 8 ITLs into this many batches and stops at
# the first k ≥ 10 whose batch-means 95 % interval of throughput is within ±1 % (the rule written down before its
# series were looked at; docs/results.md "`amoe plan` on 256 H800s"): 2.5–4 of the 8 ITLs on the 256-GPU plans.
SIM_BATCHES = 32


def refine(
    model,
    dep: bounds.Deployment,
    routing: str,
    ctx: float,
    host,
    pred: bounds.Prediction | None = None,
    itl_slo_ms: float | None = None,
    concurrency: int | None = None,
    variance: StepVariance | None = None,
    policy: str = AEP_POLICY,
) -> Plan:
    """The plan's prediction from the simulation (amoe.emulation.simulate) where the bound is not enough: AEP at
    the least concurrency (from the bound's operating point, doubling while that gains more than 3 %) within 3 % of
    the most it simulates under the ITL objective; EP and ping-pong at their concurrency, in lock-step with each
    iteration's routing. The bound (ping-pong: the analytic Eq. 5 shape) stays in extra["bound"]. With
    `concurrency` (requests of one copy) the simulation runs there and nowhere else (`amoe bench plan-check`'s
    full-depth points, which cannot afford the AEP plan's own concurrency on this host). `variance`: the GPUs'
    step-time variance (None: the sourced one, as `bounds.predict` and `simulate` default to). `policy`: the
    scheduling policy an AEP plan's runtimes run (its simulation's; the other modes have no scheduler); BEST: each
    of BEST_OF, keeping the one that gives more within the objective (extra["aep_policy"] names it)."""
    from amoe.config import SchedulerSection
    from amoe.emulation.simulate import simulate
    from amoe.perf.model.variance import SOURCED

    if check_policy(policy) == BEST:
        if dep.mode == "aep":
            return _refine_best(model, dep, routing, ctx, host, pred, itl_slo_ms, concurrency, variance)
        policy = AEP_POLICY  # EP and ping-pong have no scheduler to choose
    variance = variance or SOURCED
    if pred is None:
        pred = bounds.predict(model, dep, routing_inclusion(model, routing), ctx, host, variance=variance)
    # waves: the expert side gathers the bound's group of waves (docs/engine.md "The waves rule" item 13)
    scheduler = SchedulerSection(policy=policy, wave_group=bounds.wave_group(pred.extra, dep.attn_cap))
    per_copy = concurrency or pred.concurrency // dep.replicas
    if pred.tokens_per_s <= 0:
        return Plan(dep, pred, None)
    one = replace(dep, replicas=1)
    ceiling = _max_requests(model, one, ctx)
    bound_tps = pred.tokens_per_s / dep.replicas

    def run(c: int):
        # In rounds of a token's way round (its ITL): the estimate settles to within ~2 % after a warm-up of 4 and
        # over a window of 8 (measured on 2-block and full-depth plans). The bound's ITL first; where batches stay
        # small the simulated ITL is several times that (3.4× on the full-depth check's AEP plan), and a window of
        # 8 bound ITLs would be 2 of the simulated ones: then again in rounds of the simulated ITL. AEP at scale
        # stops the window early once its batch-means interval is within ±1 % (SIM_BATCHES).
        itl, cpu = c / bound_tps, time.process_time()
        sim = simulate(
            model, one, routing, ctx, host, c, warmup_s=4 * itl, duration_s=8 * itl, variance=variance,
            batches=SIM_BATCHES, scheduler=scheduler,
        )  # fmt: skip
        if sim.itl_s > 1.5 * itl:
            sim = simulate(
                model, one, routing, ctx, host, c, warmup_s=4 * sim.itl_s, duration_s=8 * sim.itl_s,
                variance=variance, batches=SIM_BATCHES, scheduler=scheduler,
            )  # fmt: skip
        logger.info(
            "[plan] simulated %s at %d requests a copy: %.0f tok/s, ITL %.1f ms (%.1f s CPU)", describe(one), c,
            sim.tokens_per_s, sim.itl_s * 1e3, time.process_time() - cpu,
        )  # fmt: skip
        return sim

    sims = [run(per_copy)]
    # Double while that still gains more than 3 %; never when the simulation is within 3 % of the bound already
    # (no schedule beats the bound, so no concurrency could gain more).
    while (
        dep.mode == "aep" and concurrency is None and len(sims) <= SIM_DOUBLINGS and sims[-1].tokens_per_s < (1 - RESOLUTION) * bound_tps
        and 2 * sims[-1].concurrency <= ceiling
    ):  # fmt: skip
        if itl_slo_ms is not None and 2 * sims[-1].concurrency / bound_tps * 1e3 > itl_slo_ms:
            break  # even at the bound's rate twice the requests would miss the objective
        more = run(2 * sims[-1].concurrency)
        sims.append(more)
        if more.tokens_per_s < 1.03 * sims[-2].tokens_per_s:
            break
    # Under an ITL objective none of those may meet it (the bound's point is its knee, where the schedule runs a
    # little slower than the bound): then fewer requests, aimed by Little's law at 95 % of the objective.
    fewer = sims[0]
    while (
        dep.mode == "aep" and concurrency is None and itl_slo_ms is not None and len(sims) <= 2 * SIM_DOUBLINGS
        and not any(s.itl_s * 1e3 <= itl_slo_ms for s in sims) and fewer.concurrency > one.num_attn
    ):  # fmt: skip
        target = int(fewer.concurrency * 0.95 * itl_slo_ms / (fewer.itl_s * 1e3))
        fewer = run(max(one.num_attn, min(target, fewer.concurrency - 1)))
        sims.append(fewer)
    ok = [s for s in sims if itl_slo_ms is None or s.itl_s * 1e3 <= itl_slo_ms] or sims[:1]
    most = max(s.tokens_per_s for s in ok)
    sim = next(s for s in ok if s.tokens_per_s >= (1 - RESOLUTION) * most)
    extra = {**pred.extra, "bound": pred.tokens_per_s, "simulated": True, "wave_group": scheduler.wave_group}
    if dep.mode == "aep":
        # The simulation at scale models one expert-side rule, defrag's (amoe.emulation.simulate_scale), whatever
        # the policy asked: a plan simulated there is served with the policy its figure is of, not with one its
        # prediction never ran (the 32-runtime check under waves measured 1.30× that defrag prediction).
        from amoe.emulation.simulate_scale import is_exact

        ran = policy if is_exact(one, sim.concurrency, model.num_expert_ids) else "defrag"
        if ran != policy:
            logger.info(
                "[plan] %s is simulated at scale, where only defrag is modelled: served with it",
                describe(one),
            )
        extra["aep_policy"] = ran
    refined = replace(
        pred, tokens_per_s=sim.tokens_per_s * dep.replicas, itl_s=sim.itl_s,
        concurrency=sim.concurrency * dep.replicas, extra=extra,
    )  # fmt: skip
    return Plan(dep, refined, None)


def _refine_best(model, dep, routing, ctx, host, pred, itl_slo_ms, concurrency, variance) -> Plan:
    """refine() with each policy of BEST_OF; the plan whose simulation meets the ITL objective with the most
    tokens/s (ties and misses: the earlier policy). A plan simulated at scale models defrag only (refine's record):
    one run is then all there is to compare."""
    tried: list[Plan] = []
    for policy in BEST_OF:
        plan = refine(model, dep, routing, ctx, host, pred, itl_slo_ms, concurrency, variance, policy)
        tried.append(plan)
        if plan.prediction.extra.get("aep_policy", policy) != policy:
            break  # simulated at scale: served with defrag whatever was asked

    def score(plan: Plan) -> tuple[bool, float]:
        p = plan.prediction
        return (itl_slo_ms is None or p.itl_s * 1e3 <= itl_slo_ms, p.tokens_per_s)

    best = max(tried, key=score)  # the first of equals
    if len(tried) > 1:
        logger.info(
            "[plan] %s: %s", describe(dep),
            ", ".join(f"{name} {p.prediction.tokens_per_s:.0f} tok/s at {p.prediction.itl_s * 1e3:.1f} ms"
                      for name, p in zip(BEST_OF, tried)),
        )  # fmt: skip
    return best


def _max_requests(model, dep: bounds.Deployment, ctx: float) -> int:
    """The most requests refine's doublings take one copy to: SIM_MAX_REQUESTS where the simulation is event-level,
    else what the attention GPUs' KV cache holds at the mean context."""
    from amoe.emulation.simulate_scale import is_exact

    if is_exact(dep, SIM_MAX_REQUESTS, model.num_expert_ids):
        return SIM_MAX_REQUESTS
    gpu = GPUS[dep.attn_gpu]
    kv = cm.kv_capacity_tokens(gpu, model, cm.attention_rank_weight_bytes(model))
    return max(SIM_MAX_REQUESTS, dep.num_attn * int(kv // max(ctx, 1.0)))


def best_per_mode(plans: list[Plan]) -> dict[str, Plan]:
    """Each mode's best plan (the first of its mode in `plans`)."""
    return {plan.deployment.mode: plan for plan in best_shapes(plans, 1)}


def shape(d: bounds.Deployment) -> tuple:
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


def serve_command(plan: Plan, req: PlanRequest, model_dir: str = "MODEL_DIR", emulated: bool = False) -> str:
    """The `amoe serve` command line that runs `plan` (emulated: on emulated GPUs of the plan's type, with the
    routing the plan assumed, as `amoe bench plan-check` runs it)."""
    d = plan.deployment
    args = ["amoe", "serve"]
    if emulated:
        where = ["--model", req.model_dir] if req.model_dir else ["--executor-profile", req.profile]
        args += ["--executor", "emulated", *where]
    else:
        args += ["--model", req.model_dir or model_dir]
    if d.mode == "ep":
        args += ["--parallel", "ep", "--attn-ranks", str(d.num_attn)]
        if d.pipelined:
            pn = str(d.ep_pipelines) if d.ep_pipelines else "auto"
            args += ["--ep-pipelines", pn, *(["--ep-kernel", d.ep_kernel] if d.ep_kernel else [])]
    else:
        args += ["--parallel", d.mode, "--attn-ranks", str(d.num_attn), "--expert-ranks", str(d.num_expert)]
    args += ["--scheduler-attn-batch-cap", str(d.attn_cap)]
    # The requests each attention GPU holds at the plan's operating point (one copy's share): more only lengthens
    # ITL, fewer leaves the experts' batches smaller than the prediction assumed.
    per_rank = math.ceil(plan.prediction.concurrency / d.replicas / d.num_attn)
    args += ["--cache-max-num-seqs", str(per_rank)]
    if d.mode == "aep":
        args += ["--scheduler-expert-batch-cap", str(d.expert_cap)]
        # The policy the plan's figure was simulated with (refine's record; a bound-only plan: the one asked for).
        policy = plan.prediction.extra.get(
            "aep_policy", AEP_POLICY if req.aep_policy == BEST else req.aep_policy
        )
        if policy != "defrag":  # `amoe serve`'s default
            # waves keeps ceil(--cache-max-num-seqs / attention cap) waves a rank: the W the plan was simulated with
            args += ["--scheduler", policy]
        # the expert side's groups of those waves: the simulated plan's, else the bound's (item 13)
        if policy == "waves":
            extra = plan.prediction.extra
            group = extra.get("wave_group") or bounds.wave_group(extra, d.attn_cap)
            args += ["--scheduler-wave-group", str(group)]
    if d.mode == "pingpong":
        args += ["--parallel-micro-batches", str(d.micro_batches)]
    if d.expert_map is not None:
        args += ["--parallel-expert-map", ",".join(map(str, d.expert_map))]
    if emulated:
        args += ["--gpu", d.attn_gpu, "--routing", req.routing, "--executor-decode-only", "true"]
        if d.mode != "ep" and d.expert_gpu != d.attn_gpu:
            args += ["--expert-gpu", d.expert_gpu]
        if d.num_attn + d.num_expert > d.gpus_per_node:
            # One copy spans hosts: the prediction priced its messages between them at the network's time.
            args += ["--executor-gpus-per-node", str(d.gpus_per_node)]
        if req.top_k is not None:
            args += ["--executor-top-k", str(req.top_k)]
        if req.step_variance != "sourced":  # the emulated executor's default
            args += ["--step-variance", req.step_variance]
    return " ".join(args)


def describe(d: bounds.Deployment) -> str:
    copies = f" x{d.replicas} replicas" if d.replicas > 1 else ""
    if d.mode == "ep":
        pipeline = f" eps pn {d.ep_pipelines or 'auto'} {d.ep_kernel or 'grouped'}" if d.pipelined else ""
        scale = f" eplb+{d.redundant_experts}" if d.redundant_experts else ""
        scale += " tbo" if d.two_batch_overlap else ""
        return f"ep {d.num_attn}x{d.attn_gpu}{copies} cap {d.attn_cap}{pipeline}{scale}"
    roles = f"{d.num_attn}x{d.attn_gpu} attn + {d.num_expert}x{d.expert_gpu} experts"
    extra = f" ecap {d.expert_cap}" if d.mode == "aep" else f" m={d.micro_batches}"
    placement = " balanced" if d.expert_map is not None else ""
    return f"{d.mode} {roles}{copies} cap {d.attn_cap}{extra}{placement}"


def report(plans: list[Plan], req: PlanRequest, top: int = 5) -> str:
    """The table `amoe plan` prints: the best plans, the best of each mode, the verdict and the commands."""
    if not plans:
        return "no deployment fits: too few GPUs for the model's weights, or the ITL objective is too tight"
    lines = [
        f"{'#':>2} {'deployment':<58} {'tok/s':>9} {'/GPU':>7} {'ITL ms':>7} {'$/Mtok':>7} {'bound by':<9}",
        "-" * 106,
    ]
    best = best_per_mode(plans)
    shown = plans[:top] + [p for p in best.values() if p not in plans[:top]]
    for plan in shown:
        p = plan.prediction
        cost = f"{plan.cost_per_mtok:7.3f}" if plan.cost_per_mtok is not None else f"{'-':>7}"
        rank = f"{plans.index(plan) + 1:>2}"
        mark = " " if p.extra.get("simulated") else "*"
        lines.append(
            f"{rank} {describe(plan.deployment):<58} {p.tokens_per_s:9.0f}{mark}{plan.tokens_per_s_per_gpu:7.0f} "
            f"{p.itl_s * 1e3:7.2f} {cost} {p.bottleneck:<9}"
        )
    if any("*" in line[61:72] for line in lines[2:]):
        lines.append("* the bound only: not refined by the simulation (--simulate-top)")
    winner = plans[0]
    verdict = f"best: {describe(winner.deployment)}"
    if "aep" in best and "ep" in best:
        ratio = best["aep"].prediction.tokens_per_s / best["ep"].prediction.tokens_per_s
        verdict += f"; best AEP / best EP = {ratio:.2f}x" + (
            "" if winner.deployment.mode == "aep" else " (AEP is not the better choice here)"
        )
    lines += ["", verdict, "", "run it:", "  " + serve_command(winner, req)]
    if winner.deployment.replicas > 1:
        lines.append(
            f"  (x{winner.deployment.replicas} such servers, each on its own GPUs, behind one load balancer)"
        )
    lines += ["check it on emulated GPUs:", "  " + serve_command(winner, req, emulated=True)]
    return "\n".join(lines)


def plan_json(plan: Plan, req: PlanRequest) -> dict:
    return {
        "deployment": asdict(plan.deployment),
        "prediction": plan.prediction.to_dict(),
        "tokens_per_s_per_gpu": plan.tokens_per_s_per_gpu,
        "cost_per_mtok": plan.cost_per_mtok,
        "command": serve_command(plan, req),
        "emulated_command": serve_command(plan, req, emulated=True),
    }


def main(args) -> int:
    """`amoe plan` (amoe.cli)."""
    gpus = parse_gpus(args.gpus)
    model_dir = getattr(args, "model", None)
    req = PlanRequest(
        profile=args.model_profile or Path(model_dir).resolve().name, gpus=gpus, workload=args.workload,
        top_k=args.top_k, routing=args.routing, itl_slo_ms=args.itl_slo_ms, prices=parse_prices(args.price, gpus),
        gpus_per_node=args.gpus_per_node, modes=tuple(args.modes.split(",")), simulate_top=args.simulate_top,
        simulate_per_mode=args.simulate_per_mode, model_dir=model_dir, eps=getattr(args, "eps", False),
        step_variance=getattr(args, "step_variance", "sourced"), refine_retries=getattr(args, "refine_retries", 3),
        aep_policy=check_policy(getattr(args, "aep_policy", AEP_POLICY)),
    )  # fmt: skip
    if req.simulate_top < 0 or req.simulate_per_mode < 0:
        raise ConfigError(
            f"--simulate-top and --simulate-per-mode must be >= 0; got {req.simulate_top}, {req.simulate_per_mode}"
        )
    if req.refine_retries < 0:
        raise ConfigError(f"--refine-retries must be >= 0; got {req.refine_retries}")
    bad = set(req.modes) - {"aep", "ep", "pingpong"}
    if bad:
        raise ConfigError(f"--modes takes aep, ep, pingpong; got {', '.join(sorted(bad))}")
    plans = search(req)
    if args.json:
        print(json.dumps({"request": asdict(req), "plans": [plan_json(p, req) for p in plans[: args.top]]}))
    else:
        print(report(plans, req, args.top))
    return 0 if plans else 1
