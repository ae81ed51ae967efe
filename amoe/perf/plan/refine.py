"""A plan's prediction refined by the simulation (amoe.perf.plan.simulate) where the bound is not enough: the
concurrency an AEP plan's runtimes need to fill their batches, and the lock-step modes under each iteration's
routing; with `--aep-policy best`, the scheduling policy that simulates more."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from amoe.config import DEFAULT_POLICY, SchedulerSection
from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import GPUS
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.traces import RequestTrace
from amoe.perf.model.variance import SOURCED, StepVariance
from amoe.perf.plan import bounds
from amoe.perf.plan.bound_pools import wave_group
from amoe.perf.plan.deployment import Deployment, describe
from amoe.perf.plan.prediction import Prediction
from amoe.perf.plan.request import BEST, BEST_OF, Plan, check_policy

if TYPE_CHECKING:
    from amoe.perf.plan.simulate.result import Simulated

logger = logging.getLogger(__name__)

# Throughputs the simulation cannot tell apart (a fraction): an AEP plan's operating point is the least concurrency
# within it of the most (refine, bound_pools._aep), and of plans within it of each other the lowest ITL ranks first.
RESOLUTION = 0.03


# Doublings of concurrency the simulation tries above the bound's operating point (AEP): the bound's point fills
# every batch at once, the runtimes need more requests in flight to fill theirs.
SIM_DOUBLINGS = 3


# Requests of one copy up to which AEP's refinement doubles concurrency event by event (~2 s for 6,000 at full depth);
# past it, or past 16 GPUs a copy, the simulation runs at scale (amoe.perf.plan.simulate.scale), which
# doubles up to the requests the attention GPUs' KV cache holds. No plan keeps its bound for being large.
SIM_MAX_REQUESTS = 16384


# AEP at scale (amoe.perf.plan.simulate.aep_scale) splits refine's window of 8 ITLs into this many batches and stops at
# the first k ≥ 10 whose batch-means 95 % interval of throughput is within ±1 % (the rule written down before its
# series were looked at; docs/simulation.md "A stopping rule"): 2.5–4 of the 8 ITLs on the 256-GPU plans.
SIM_BATCHES = 32


# The AEP policies whose expert side the simulation at scale models (amoe.perf.plan.simulate.aep_scale).
SCALE_POLICIES = ("waves", "defrag")


def refine(
    model: ModelProfile,
    dep: Deployment,
    routing: str,
    ctx: float,
    host: HostOverhead,
    pred: Prediction | None = None,
    itl_slo_ms: float | None = None,
    concurrency: int | None = None,
    variance: StepVariance | None = None,
    policy: str = DEFAULT_POLICY,
    trace: RequestTrace | None = None,
) -> Plan:
    """The plan's prediction from the simulation (amoe.perf.plan.simulate) where the bound is not enough: AEP at
    the least concurrency (from the bound's operating point, doubling while that gains more than 3 %) within 3 % of
    the most it simulates under the ITL objective; EP and ping-pong at their concurrency, in lock-step with each
    iteration's routing. The bound (ping-pong: the analytic Eq. 5 shape) stays in extra["bound"]. With
    `concurrency` (requests of one copy) the simulation runs there and nowhere else (`amoe bench plan-check`'s
    full-depth points, which cannot afford the AEP plan's own concurrency on this host). `variance`: the GPUs'
    step-time variance (None: the sourced one, as `bounds.predict` and `simulate` default to). `policy`: the
    scheduling policy an AEP plan's runtimes run (its simulation's; the other modes have no scheduler); BEST: each
    of BEST_OF, keeping the one that gives more within the objective (extra["aep_policy"] names it). `trace`: a
    trace workload, each attention rank's steps from its own requests (amoe.perf.plan.simulate.trace_loads)."""
    if check_policy(policy) == BEST:
        if dep.mode == "aep":
            return _refine_best(
                model, dep, routing, ctx, host, pred, itl_slo_ms, concurrency, variance, trace
            )
        policy = DEFAULT_POLICY  # EP and ping-pong have no scheduler to choose
    variance = variance or SOURCED
    if pred is None:
        pred = bounds.predict(model, dep, routing_inclusion(model, routing), ctx, host, variance=variance)
    # waves: the expert side gathers the bound's group of waves (docs/scheduler.md "Group cells")
    scheduler = SchedulerSection(policy=policy, wave_group=wave_group(pred.extra, dep.attn_cap))
    per_copy = concurrency or pred.concurrency // dep.replicas
    if pred.tokens_per_s <= 0:
        return Plan(dep, pred, None)
    one = replace(dep, replicas=1)
    run = _CopyRuns(
        model, one, routing, ctx, host, variance, scheduler, pred.tokens_per_s / dep.replicas, trace
    )
    sims = [run(per_copy)]
    if dep.mode == "aep" and concurrency is None:
        _more_requests(run, sims, _max_requests(model, one, ctx), itl_slo_ms)
        _fewer_requests(run, sims, itl_slo_ms)
    ok = [s for s in sims if itl_slo_ms is None or s.itl_s * 1e3 <= itl_slo_ms] or sims[:1]
    most = max(s.tokens_per_s for s in ok)
    sim = next(s for s in ok if s.tokens_per_s >= (1 - RESOLUTION) * most)
    extra = {**pred.extra, "bound": pred.tokens_per_s, "simulated": True, "wave_group": scheduler.wave_group}
    if dep.mode == "aep":
        extra["aep_policy"] = _policy_simulated(model, one, sim, policy)
    refined = replace(
        pred, tokens_per_s=sim.tokens_per_s * dep.replicas, itl_s=sim.itl_s,
        concurrency=sim.concurrency * dep.replicas, extra=extra,
    )  # fmt: skip
    return Plan(dep, refined, None)


@dataclass(frozen=True)
class _CopyRuns:
    """Simulations of one copy of a plan at a given concurrency, in rounds of a token's way round (its ITL)."""

    model: ModelProfile
    one: Deployment
    routing: str
    ctx: float
    host: HostOverhead
    variance: StepVariance
    scheduler: SchedulerSection
    bound_tps: float  # one copy's bound
    trace: RequestTrace | None = None  # a trace workload (each rank's own requests), or the mean context

    def __call__(self, c: int) -> Simulated:
        # Looked up at each call: a test may put a spy in the simulation's place.
        from amoe.perf.plan.simulate import simulate

        # The estimate settles to within ~2 % after a warm-up of 4 ITLs and over a window of 8 (measured on 2-block
        # and full-depth plans). The bound's ITL first; where batches stay small the simulated ITL is several times
        # that (3.4× on the full-depth check's AEP plan), and a window of 8 bound ITLs would be 2 of the simulated
        # ones: then again in rounds of the simulated ITL. AEP at scale stops the window early once its batch-means
        # interval is within ±1 % (SIM_BATCHES).
        model, one, routing, ctx, host = self.model, self.one, self.routing, self.ctx, self.host
        itl, cpu = c / self.bound_tps, time.process_time()
        sim = simulate(
            model, one, routing, ctx, host, c, warmup_s=4 * itl, duration_s=8 * itl, variance=self.variance,
            batches=SIM_BATCHES, scheduler=self.scheduler, trace=self.trace,
        )  # fmt: skip
        if sim.itl_s > 1.5 * itl:
            sim = simulate(
                model, one, routing, ctx, host, c, warmup_s=4 * sim.itl_s, duration_s=8 * sim.itl_s,
                variance=self.variance, batches=SIM_BATCHES, scheduler=self.scheduler, trace=self.trace,
            )  # fmt: skip
        logger.info(
            "[plan] simulated %s at %d requests a copy: %.0f tok/s, ITL %.1f ms (%.1f s CPU)", describe(one), c,
            sim.tokens_per_s, sim.itl_s * 1e3, time.process_time() - cpu,
        )  # fmt: skip
        return sim


def _more_requests(run: _CopyRuns, sims: list[Simulated], ceiling: int, itl_slo_ms: float | None) -> None:
    """Double an AEP copy's requests while that still gains more than 3 %; never when the simulation is within 3 %
    of the bound already (no schedule beats the bound, so no concurrency could gain more)."""
    while (
        len(sims) <= SIM_DOUBLINGS and sims[-1].tokens_per_s < (1 - RESOLUTION) * run.bound_tps
        and 2 * sims[-1].concurrency <= ceiling
    ):  # fmt: skip
        if itl_slo_ms is not None and 2 * sims[-1].concurrency / run.bound_tps * 1e3 > itl_slo_ms:
            break  # even at the bound's rate twice the requests would miss the objective
        more = run(2 * sims[-1].concurrency)
        sims.append(more)
        if more.tokens_per_s < 1.03 * sims[-2].tokens_per_s:
            break


def _fewer_requests(run: _CopyRuns, sims: list[Simulated], itl_slo_ms: float | None) -> None:
    """Under an ITL objective none of the runs may meet it (the bound's point is its knee, where the schedule runs a
    little slower than the bound): then fewer requests, aimed by Little's law at 95 % of the objective."""
    fewer = sims[0]
    while (
        itl_slo_ms is not None and len(sims) <= 2 * SIM_DOUBLINGS
        and not any(s.itl_s * 1e3 <= itl_slo_ms for s in sims) and fewer.concurrency > run.one.num_attn
    ):  # fmt: skip
        target = int(fewer.concurrency * 0.95 * itl_slo_ms / (fewer.itl_s * 1e3))
        fewer = run(max(run.one.num_attn, min(target, fewer.concurrency - 1)))
        sims.append(fewer)


def _policy_simulated(model: ModelProfile, one: Deployment, sim: Simulated, policy: str) -> str:
    """The policy an AEP plan's figure is of. The simulation at scale models the expert side of `waves` (group
    cells) and of defrag (amoe.perf.plan.simulate.aep_scale); any other policy runs defrag's pick there, so a plan
    simulated at scale is then served with defrag, not with a policy its prediction never ran (the 32-runtime check
    under waves measured 1.30× a defrag prediction)."""
    from amoe.perf.plan.simulate.scale import is_exact

    if sim.expert_pick is not None and sim.expert_pick != policy and policy in SCALE_POLICIES:
        logger.info(
            "[plan] %s is simulated at scale with %s's pick (waves' group cells not run at this size): served with it",
            describe(one), sim.expert_pick,
        )  # fmt: skip
        return sim.expert_pick
    if policy in SCALE_POLICIES or is_exact(one, sim.concurrency, model.num_expert_ids):
        return policy
    logger.info(
        "[plan] %s is simulated at scale, where %s is not modelled: served with defrag", describe(one), policy
    )
    return "defrag"


def _refine_best(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, pred: Prediction | None,
    itl_slo_ms: float | None, concurrency: int | None, variance: StepVariance | None,
    trace: RequestTrace | None = None,
) -> Plan:  # fmt: skip
    """refine() with each policy of BEST_OF; the plan whose simulation meets the ITL objective with the most
    tokens/s (ties and misses: the earlier policy). A policy a simulation does not model runs as defrag there
    (refine's record): the comparison stops at the first such run."""
    tried: list[Plan] = []
    for policy in BEST_OF:
        plan = refine(model, dep, routing, ctx, host, pred, itl_slo_ms, concurrency, variance, policy, trace)
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


def _max_requests(model: ModelProfile, dep: Deployment, ctx: float) -> int:
    """The most requests refine's doublings take one copy to: SIM_MAX_REQUESTS where the simulation is event-level,
    else what the attention GPUs' KV cache holds at the mean context."""
    from amoe.perf.plan.simulate.scale import is_exact

    if is_exact(dep, SIM_MAX_REQUESTS, model.num_expert_ids):
        return SIM_MAX_REQUESTS
    gpu = GPUS[dep.attn_gpu]
    kv = cm.kv_capacity_tokens(gpu, model, cm.attention_rank_weight_bytes(model))
    return max(SIM_MAX_REQUESTS, dep.num_attn * int(kv // max(ctx, 1.0)))
