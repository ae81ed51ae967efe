"""The simulation at frontier scale: deployments of 16–256 GPUs and 100,000+ requests in flight, in
seconds on a 2-core host, where the event-level simulation (amoe.perf.plan.simulate) would take hours.

Measured first (docs/simulation.md "Simulation at scale"): the event-level AEP simulation spends its time in one
Python event per (attention step, expert) message and per (expert step, attention rank) reply, and in keyed
routing draws of every token over every expert (256 Gumbel keys per token and block for DeepSeek-V3). At 64 GPUs
and 4,096 requests it simulates 0.07 emulated seconds in 6.8 s; a plan needs 12 ITLs of ~0.3 s. Neither
vectorising the events nor a C++ port removes the per-token routing cost (19 G keys for 100 k requests over 12
ITLs), so at scale the simulation changes its unit, not its language:

* **Counts, not tokens**: a block's rows per expert are drawn from the inclusion probabilities
  (amoe.perf.model.ep_scale.sample_counts), once per (block, micro-batch or wave), at a cost independent of the rows.
* **Attention GPUs alike** (EP, ping-pong): every attention GPU holds the same share of requests, so one
  timeline stands for them (ping-pong's lock-step keeps them together anyway); each expert GPU keeps its own.
* **AEP: each attention GPU on its own phase** (docs/simulation.md "Simulation at scale", written down
  before its numbers were looked at). Each attention GPU keeps W waves of w rows (w:
  the attention cap, or fewer when its requests are fewer), each starting at a block drawn from the seed, and runs
  its waves in the order they become ready; a wave's block is its attention step, its dispatch (its own w rows'
  counts) through its link out and each expert GPU's link in, the expert steps that take its rows, and the combine
  back; the wave goes on when every part is back (attention waves never split or merge). An expert GPU, when free,
  runs the rows queued at it as defrag picks them (the one expert-side rule modelled here, grouped steps: the
  block maximising LScore(b) + max_e Q[b][e] over its hosted experts' queues, ties to the lowest block; every
  hosted expert's queue of that block, each up to the expert cap, first arrived first), computed exactly from the
  queued counts; rows of one block from different attention GPUs share a step only if they are in when it starts.
  Links: one message set at a time each way, first sent first through; a set is what one GPU sends at one instant
  (a wave's dispatch, an expert step's outputs); sets that leave different GPUs at the same instant share the
  receiving link and arrive together, so with every attention GPU on one phase (`same_phase`) this is the old one
  timeline but for the pick among queued blocks. Left out: request-level affinity, the attention runtime's
  fragmented steps.
* **Step-time variance** (docs/simulation.md "Step-time variance at scale"), as the event-level simulation draws
  it: each GPU a fixed speed (seed, device id), each step a jitter, drawn as arrays; EP's and ping-pong's
  barriers pay the slowest device of each step, AEP's queues each GPU's own step times. Off: today's figures.
* **Speed**: conservative rounds vectorised over GPUs (aep_scale.AepAtScale.run): about as many rounds as one
  expert GPU runs steps, each ~0.3–3 ms of numpy — up to A times the one timeline's events where steps split.

simulate() takes this path above EXACT_MAX_GPUS GPUs, EXACT_MAX_REQUESTS requests in one copy or EXACT_MAX_EXPERTS
expert layers; every Mixtral plan of 16 GPUs or fewer (all of today's plan checks and tests) stays event-level and
gives the numbers it gave.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from amoe.config import SchedulerSection
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.traces import RequestTrace
from amoe.perf.model.variance import OFF, StepVariance
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate.counts import Counts, GroupedSteps
from amoe.perf.plan.simulate.result import Simulated

if TYPE_CHECKING:
    from amoe.perf.plan.simulate.aep_scale import AepAtScale

EXACT_MAX_GPUS = 16  # one copy of at most this many GPUs: the event-level simulation (today's plans)
EXACT_MAX_REQUESTS = 16384  # ... and at most this many requests (the cap the planner had)
# ... and at most this many expert layers per block: an event-level step fans out to every expert, and keyed
# routing draws a key per expert per token, so 257 experts (DeepSeek-V3) on 16 GPUs already take hours a plan.
EXACT_MAX_EXPERTS = 64


def is_exact(dep: Deployment, concurrency: int, num_expert_ids: int = 0) -> bool:
    """Whether simulate() runs `dep` event by event (True) or at scale (amoe.perf.plan.simulate.scale)."""
    return (
        dep.num_attn + dep.num_expert <= EXACT_MAX_GPUS
        and concurrency <= EXACT_MAX_REQUESTS
        and num_expert_ids <= EXACT_MAX_EXPERTS
    )


def aep_waves(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int,
    duration_s: float, warmup_s: float, seed: int, same_phase: bool = False, batches: int = 0,
    variance: StepVariance = OFF, trace: RequestTrace | None = None, scheduler: SchedulerSection | None = None,
) -> Simulated:  # fmt: skip
    """AEP at scale, each attention GPU on its own phase (module docstring; amoe.perf.plan.simulate.aep_scale): returns
    simulate.Simulated. `same_phase`: every attention GPU's waves start at the same blocks (the one timeline the
    simulation had before; kept for the comparison). `batches`: AepAtScale.run's stopping rule (0: none).
    `variance`: every GPU's steps × its speed × a jitter each (docs/simulation.md "Step-time variance at scale").
    `trace`: each wave's attention from its own requests (amoe.perf.plan.simulate.trace_loads). `scheduler`: its
    policy's expert side, `waves`' group cells or else defrag's pick (aep_scale.AepAtScale)."""
    sim = aep_at_scale(
        model, dep, routing, ctx, host, concurrency, seed, same_phase=same_phase, variance=variance, trace=trace,
        scheduler=scheduler,
    )  # fmt: skip
    return sim.run(warmup_s, duration_s, batches=batches)


def aep_at_scale(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int,
    seed: int, same_phase: bool = False, variance: StepVariance = OFF, trace: RequestTrace | None = None,
    scheduler: SchedulerSection | None = None,
) -> AepAtScale:  # fmt: skip
    """The own-phase AEP simulation of `dep` (amoe.perf.plan.simulate.aep_scale.AepAtScale), with this module's routing
    counts and grouped step costs."""
    from amoe.perf.plan.simulate.aep_scale import AepAtScale

    steps = GroupedSteps(model, gpu_profile(dep.expert_gpu), dep.experts_on(model.num_expert_ids), host)
    counts = Counts(model, routing, seed)
    return AepAtScale(
        model, dep, routing, ctx, host, concurrency, seed, counts=counts, steps=steps, same_phase=same_phase,
        variance=variance, trace=trace, scheduler=scheduler,
    )  # fmt: skip
