"""The simulations of a deployment on emulated GPUs, behind one entry: `simulate`. What `amoe plan` refines its
best plans with where the analytic bounds (amoe.perf.plan.bounds) are not enough.

Two levels. `events` (events.py, events_aep.py): the same pieces the emulated runtimes run — the C++ scheduler, the
routing override, the cost model's step times, the links — token by token. `scale` (scale.py, aep_scale.py): counts
per expert instead of tokens, for deployments of 16-256 GPUs and 100,000+ requests in flight. `level="auto"` picks
the event level for one copy of at most 16 GPUs, 16,384 requests and 64 experts a block (scale.is_exact), else the
simulation at scale; EP with EPLB's redundant experts or two-batch overlap runs at scale, EP with EPS-MoE's expert
pipeline event by event, whatever its size. Both report a `result.Simulated`.
"""

from __future__ import annotations

from amoe.config import SchedulerSection
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.variance import SOURCED, StepVariance
from amoe.perf.plan.deployment import Deployment, describe
from amoe.perf.plan.simulate import scale
from amoe.perf.plan.simulate.events import Steps, simulate_ep, simulate_pingpong
from amoe.perf.plan.simulate.events_aep import AepEvents
from amoe.perf.plan.simulate.result import Simulated

LEVELS = ("auto", "events", "scale")


def simulate(
    model: ModelProfile,
    dep: Deployment,
    routing: str,
    mean_context: float,
    host: HostOverhead,
    concurrency: int,
    *,
    duration_s: float = 0.25,
    warmup_s: float = 0.1,
    scheduler: SchedulerSection | None = None,
    seed: int = 0,
    variance: StepVariance = SOURCED,
    stagger_ranks: bool = False,
    rank_barrier: bool = True,
    batches: int = 0,
    level: str = "auto",
) -> Simulated:
    """Steady-state decode of `concurrency` requests (spread evenly over the attention ranks) on one copy of `dep`,
    for `duration_s` emulated seconds after `warmup_s`, on GPUs with `variance` (module docstring). AEP with
    `stagger_ranks`: each attention rank starts at its own time (docs/scheduler.md "The straggler wait");
    `rank_barrier=False`: waves' expert side with no wait, the oldest block (for comparison). Plans past
    16 GPUs, 16,384 requests or 64 experts a block run in counts (`level="auto"`; module docstring), with the same
    variance and without EPS-MoE's pipeline (which stays event-level); `batches`: AEP at scale may stop early by
    its batch-means rule (aep_scale.AepAtScale.run; 0: the whole window). `level` "events" or "scale": that level
    whatever the size, a ValueError where it has no model of `dep` (EPS-MoE's pipeline is event-level only, EPLB's
    redundant experts and two-batch overlap at scale only)."""
    if dep.mode not in ("aep", "ep", "pingpong"):
        raise ValueError(f"simulate: no simulation of mode {dep.mode!r}")
    if level not in LEVELS:
        raise ValueError(f"simulate: level must be one of {', '.join(LEVELS)}; got {level!r}")
    steps = Steps(variance, dep.num_attn + dep.num_expert)
    # 16-256 GPUs, 100 k requests: counts, not tokens (docs/simulation.md "Simulation at scale").
    at_scale = (
        not scale.is_exact(dep, concurrency, model.num_expert_ids) if level == "auto" else level == "scale"
    )
    if dep.mode == "ep":
        scale_only = bool(dep.redundant_experts or dep.two_batch_overlap) and not dep.pipelined
        if (level == "events" and scale_only) or (level == "scale" and dep.pipelined):
            raise ValueError(f"simulate: no {level}-level simulation of {describe(dep)}")
        if (at_scale or dep.redundant_experts or dep.two_batch_overlap) and not dep.pipelined:
            return scale.ep(model, dep, routing, mean_context, host, concurrency, duration_s, seed, variance)
        return simulate_ep(model, dep, routing, mean_context, host, concurrency, duration_s, seed, steps)
    if dep.mode == "pingpong":
        if at_scale:
            return scale.pingpong(
                model, dep, routing, mean_context, host, concurrency, duration_s, seed, variance
            )
        return simulate_pingpong(
            model, dep, routing, mean_context, host, concurrency, duration_s, seed, steps
        )
    if at_scale:
        return scale.aep_waves(
            model, dep, routing, mean_context, host, concurrency, duration_s, warmup_s, seed, batches=batches,
            variance=variance,
        )  # fmt: skip
    return AepEvents(
        model, dep, routing, mean_context, host, concurrency, scheduler or SchedulerSection(), seed, steps,
        stagger_ranks, rank_barrier,
    ).run(warmup_s, duration_s)  # fmt: skip
