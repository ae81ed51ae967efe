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
from amoe.perf.model.traces import RequestTrace
from amoe.perf.model.variance import SOURCED, StepVariance
from amoe.perf.plan.deployment import Deployment, describe
from amoe.perf.plan.simulate import lockstep_scale, scale
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
    trace: RequestTrace | None = None,
    balanced: bool = False,
) -> Simulated:
    """Steady-state decode of `concurrency` requests (spread evenly over the attention ranks) on one copy of `dep`,
    for `duration_s` emulated seconds after `warmup_s`, on GPUs with `variance` (module docstring). AEP with
    `stagger_ranks`: each attention rank starts at its own time (docs/scheduler.md "The straggler wait");
    `rank_barrier=False`: waves' expert side with no wait, the oldest block (for comparison). Plans past
    16 GPUs, 16,384 requests or 64 experts a block run in counts (`level="auto"`; module docstring), with the same
    variance and without EPS-MoE's pipeline (which stays event-level); `batches`: AEP at scale may stop early by
    its batch-means rule (aep_scale.AepAtScale.run; 0: the whole window). `level` "events" or "scale": that level
    whatever the size, a ValueError where it has no model of `dep` (EPS-MoE's pipeline is event-level only, EPLB's
    redundant experts and two-batch overlap at scale only). `trace`: a trace workload (amoe.perf.model.traces),
    every attention rank's steps from its own requests, at scale only (whatever the size; `level="events"` with
    one is refused); `balanced`: with a trace, every rank the mean of the ranks' loads (docs/simulation.md "The
    barrier tax")."""
    at_scale = _at_scale(model, dep, concurrency, level, trace)
    args = (model, dep, routing, mean_context, host, concurrency, duration_s, seed)
    if (
        dep.mode != "aep"
        and (at_scale or dep.redundant_experts or dep.two_batch_overlap)
        and not dep.pipelined
    ):
        run = lockstep_scale.ep if dep.mode == "ep" else lockstep_scale.pingpong
        return run(*args, variance, trace, balanced)
    steps = Steps(variance, dep.num_attn + dep.num_expert)
    if dep.mode == "ep":
        return simulate_ep(*args, steps)
    if dep.mode == "pingpong":
        return simulate_pingpong(*args, steps)
    if at_scale:
        return scale.aep_waves(
            *args[:7], warmup_s, seed, batches=batches, variance=variance, trace=trace,
            scheduler=scheduler or SchedulerSection(),
        )  # fmt: skip
    return AepEvents(
        *args[:6], scheduler or SchedulerSection(), seed, steps, stagger_ranks, rank_barrier
    ).run(warmup_s, duration_s)


def _at_scale(
    model: ModelProfile, dep: Deployment, concurrency: int, level: str, trace: RequestTrace | None
) -> bool:
    """Whether simulate() runs `dep` at scale; a ValueError where the level asked has no model of it."""
    if dep.mode not in ("aep", "ep", "pingpong"):
        raise ValueError(f"simulate: no simulation of mode {dep.mode!r}")
    if level not in LEVELS:
        raise ValueError(f"simulate: level must be one of {', '.join(LEVELS)}; got {level!r}")
    if trace is not None and (level == "events" or dep.pipelined):
        raise ValueError(
            f"simulate: a trace workload is simulated at scale only, not {describe(dep)} {level}"
        )
    scale_only = (
        dep.mode == "ep" and bool(dep.redundant_experts or dep.two_batch_overlap) and not dep.pipelined
    )
    if (level == "events" and scale_only) or (level == "scale" and dep.pipelined):
        raise ValueError(f"simulate: no {level}-level simulation of {describe(dep)}")
    # 16-256 GPUs, 100 k requests: counts, not tokens (docs/simulation.md "Simulation at scale"); a trace's
    # requests: at scale whatever the size.
    if trace is not None:
        return True
    return not scale.is_exact(dep, concurrency, model.num_expert_ids) if level == "auto" else level == "scale"
