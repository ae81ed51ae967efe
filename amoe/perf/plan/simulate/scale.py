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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model.ep_scale import sample_counts
from amoe.perf.model.gpus import GpuProfile, gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.routing import RouterOverride, RoutingSpec
from amoe.perf.model.variance import OFF, StepVariance
from amoe.perf.plan.bound_ep import ep_placements
from amoe.perf.plan.bound_pools import pool_link, pool_links
from amoe.perf.plan.deployment import Deployment
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


# Inclusion probabilities by (router, shared experts, epoch): sampled for DeepSeek-V3 (Gumbel keys, ~5 s), they are
# the same for every simulation of one routing and seed, and a plan runs dozens (measured: most of a 256-GPU
# AEP simulation's CPU time was this, once per simulation). A few entries: one routing a plan, epochs move on.
_INCLUSION: dict[tuple, np.ndarray] = {}


def _inclusion(router: RouterOverride, num_shared: int, epoch: int) -> np.ndarray:
    key = (
        repr(router.spec),
        router.num_experts,
        router.top_k,
        router.num_blocks,
        router.seed,
        num_shared,
        epoch,
    )
    if key not in _INCLUSION:
        q = router.inclusion_at(epoch)
        q = np.concatenate([q, np.ones((q.shape[0], num_shared))], axis=1)
        q.flags.writeable = False
        if len(_INCLUSION) >= 8:
            _INCLUSION.pop(next(iter(_INCLUSION)))
        _INCLUSION[key] = q
    return _INCLUSION[key]


class Counts:
    """Rows per expert id of n tokens of a block, drawn from the routing's inclusion probabilities (by skew epoch
    when the skew shifts); the shared expert, if any, gets every token."""

    def __init__(self, model: ModelProfile, routing: str, seed: int) -> None:
        spec = RoutingSpec.parse(routing)
        if not spec.is_override:
            spec = RoutingSpec("uniform")
        self.model, self.rng = model, np.random.default_rng([seed, 35])
        self.router = RouterOverride(spec, model.num_experts, model.top_k, model.num_blocks, seed)
        self._q: dict[int, np.ndarray] = {}

    def inclusion(self, now_s: float) -> np.ndarray:
        """[blocks, expert ids] inclusion probabilities in the skew epoch at `now_s`."""
        epoch = self.router.epoch(now_s)
        if epoch not in self._q:
            self._q = {
                epoch: _inclusion(self.router, self.model.num_shared_experts, epoch)
            }  # time only moves on
        return self._q[epoch]

    def draw(self, block: int, tokens: int, now_s: float) -> np.ndarray:
        return sample_counts(self.rng, tokens, self.inclusion(now_s)[block])

    def draw_many(self, blocks: np.ndarray, tokens: int, now_s: float) -> np.ndarray:
        """[len(blocks), expert ids]: one draw of `tokens` tokens for each of `blocks` (AEP at scale: each
        attention GPU's wave its own)."""
        return sample_counts(self.rng, tokens, self.inclusion(now_s)[blocks])


class GroupedSteps:
    """Every expert GPU's grouped step (cost_model.grouped_expert_time) for one vector of rows per expert id, at
    once: [expert ids] -> [expert GPUs] seconds. `placed`: each GPU's experts, or a [expert ids, GPUs] matrix of
    the share of an expert's rows each copy serves (EPLB's redundant copies; each copy reads its own weights)."""

    def __init__(
        self, model: ModelProfile, gpu: GpuProfile, placed: list[list[int]] | np.ndarray, host: HostOverhead
    ) -> None:
        num_ids = model.num_expert_ids
        if isinstance(placed, np.ndarray):
            self.where = placed
        else:
            self.where = np.zeros((num_ids, len(placed)))
            for g, experts in enumerate(placed):
                self.where[experts, g] = 1.0
        self.inter = np.array([model.intermediate_of(e) for e in range(num_ids)], dtype=float)[:, None]
        self.model, self.gpu, self.host = model, gpu, host

    def __call__(self, rows: np.ndarray) -> np.ndarray:
        m, gpu, inter = self.model, self.gpu, self.inter
        h, bp, ba = m.hidden_size, m.bytes_per_param, m.bytes_per_activation
        copy = rows[:, None] * self.where  # [ids, GPUs] rows each copy serves
        busy = copy > 0
        r = np.where(busy, np.maximum(1.0, np.round(copy)), 0.0)
        weights = np.where(busy, h * inter * bp, 0.0)
        gate_up_f, gate_up_b = (4 * r * h * inter).sum(0), (2 * weights + r * (h + 2 * inter) * ba).sum(0)
        act_b = (r * 3 * inter * ba).sum(0)
        down_f, down_b = (2 * r * inter * h).sum(0), (weights + r * (inter + h) * ba).sum(0)
        count = busy.sum(0)
        phases = ((gate_up_f, gate_up_b), (0.0, act_b), (down_f, down_b))
        mean_rows = r.sum(0) / np.maximum(count, 1)
        slow = gpu.kernels.decode_grouped_slowdown
        gpu_s = cm.swiglu_gemms_time(gpu, m.expert_precision, phases, mean_rows, count > 0, slow)
        fixed = np.where(busy.any(0), cm.EXPERT_KERNELS * gpu.launch_s + self.host.expert_step_s, 0.0)
        return gpu_s + fixed + copy.sum(0) * self.host.expert_row_s


def share_matrix(num_ids: int, placement: list[list[tuple[int, float]]]) -> np.ndarray:
    """[expert ids, devices]: the share of each expert's rows each device's copy serves."""
    out = np.zeros((num_ids, len(placement)))
    for d, copies in enumerate(placement):
        for e, share in copies:
            out[e, d] += share
    return out


class Nics:
    """Transfers between the pools on both ends' links (the incast), each link direction carrying one
    message set at a time (full duplex: in and out apart): the alike attention GPUs' one NIC (their timeline) and
    each expert GPU's. A dispatch of `rows` rows per attention GPU (their row copies, rows · top-k) leaves the
    attention GPU's link out and enters each expert GPU's link in with the rows it gets from all A attention GPUs;
    it arrives when both ends are through, plus the latency. The combine leaves each expert GPU's link out once
    that GPU is done and enters the attention GPU's link in once the last one is (every part must be back before
    the block goes on), as the transfer back was priced before. While no link is busy when a message set comes, this is latency + the slower end's bytes, which is
    the sender's whenever each expert GPU receives no more than one attention GPU sends (A ≤ E and no hot GPU):
    those plans keep the times they had."""

    def __init__(self, model: ModelProfile, dep: Deployment, rows: int, num_expert: int) -> None:
        self.links = pool_links(model, dep)
        self.copies = rows * model.experts_per_token
        self.a_out = self.a_in = 0.0
        self.e_in, self.e_out = np.zeros(num_expert), np.zeros(num_expert)

    def dispatch(self, t: float, into: np.ndarray) -> np.ndarray:
        """[expert GPUs] when a dispatch that leaves at `t` is in each expert GPU (`into`: its rows)."""
        lk = self.links
        self.a_out = max(t, self.a_out) + self.copies * lk.attn_out
        got = into > 0
        self.e_in = np.where(got, np.maximum(t, self.e_in) + into * lk.expert_in, self.e_in)
        return np.maximum(self.a_out, np.where(got, self.e_in, 0.0)) + lk.latency

    def combine(self, done: np.ndarray, into: np.ndarray, last: float) -> float:
        """When every part of a block is back at the attention GPU: each expert GPU `done` with its `into` rows
        at that time, the last of them at `last`."""
        lk = self.links
        got = into > 0
        self.e_out = np.where(got, np.maximum(done, self.e_out) + into * lk.expert_out, self.e_out)
        self.a_in = max(last, self.a_in) + self.copies * lk.attn_in
        return max(self.a_in, float(self.e_out[got].max()) if got.any() else 0.0) + lk.latency


def aep_waves(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int,
    duration_s: float, warmup_s: float, seed: int, same_phase: bool = False, batches: int = 0,
    variance: StepVariance = OFF,
) -> Simulated:  # fmt: skip
    """AEP at scale, each attention GPU on its own phase (module docstring; amoe.perf.plan.simulate.aep_scale): returns
    simulate.Simulated. `same_phase`: every attention GPU's waves start at the same blocks (the one timeline the
    simulation had before; kept for the comparison). `batches`: AepAtScale.run's stopping rule (0: none).
    `variance`: every GPU's steps × its speed × a jitter each (docs/simulation.md "Step-time variance at scale")."""
    sim = aep_at_scale(
        model, dep, routing, ctx, host, concurrency, seed, same_phase=same_phase, variance=variance
    )
    return sim.run(warmup_s, duration_s, batches=batches)


def aep_at_scale(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int,
    seed: int, same_phase: bool = False, variance: StepVariance = OFF,
) -> AepAtScale:  # fmt: skip
    """The own-phase AEP simulation of `dep` (amoe.perf.plan.simulate.aep_scale.AepAtScale), with this module's routing
    counts and grouped step costs."""
    from amoe.perf.plan.simulate.aep_scale import AepAtScale

    steps = GroupedSteps(model, gpu_profile(dep.expert_gpu), dep.experts_on(model.num_expert_ids), host)
    counts = Counts(model, routing, seed)
    return AepAtScale(
        model, dep, routing, ctx, host, concurrency, seed, counts=counts, steps=steps, same_phase=same_phase,
        variance=variance,
    )  # fmt: skip


def ep(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int,
    duration_s: float, seed: int, variance: StepVariance = OFF,
) -> Simulated:  # fmt: skip
    """EP at scale (and with EPLB or two-batch overlap at any scale): per iteration and block this iteration's
    counts, each device's grouped GEMM over its expert copies, the barrier at the slowest (ep_lockstep)."""
    from amoe.perf.plan.simulate.ep_lockstep import simulate_ep

    counts = Counts(model, routing, seed)
    gpu = gpu_profile(dep.attn_gpu)
    placements = ep_placements(model, dep, counts.inclusion(0.0))
    unique = {
        id(p): GroupedSteps(model, gpu, share_matrix(model.num_expert_ids, p), host) for p in placements
    }
    steps = [unique[id(p)] for p in placements]
    return simulate_ep(model, dep, ctx, host, concurrency, duration_s, counts, steps, variance)


@dataclass(frozen=True)
class _Lockstep:
    """One ping-pong iteration in lock-step: its m micro-batches' attention steps block by block, each block's
    expert steps of every expert GPU at once, both ends' links."""

    counts: Counts
    steps: GroupedSteps
    nics: Nics
    rows: int
    m: int
    L: int
    attn: float
    head: float

    def iteration(
        self, a_free: float, now: float, exp_busy: float, a_steps: np.ndarray | None, e_jit: np.ndarray | None
    ) -> tuple[float, float]:
        """From `a_free` (the iteration's start after its BEGIN message): when its last attention step ends, and
        `exp_busy` with its expert GPUs' seconds added. `now`: the routing's time (shifting skew). `a_steps`
        [L + 1, m] and `e_jit` [L, m, E]: the iteration's varied attention steps and expert jitters (None: none)."""
        varied, steps, nics, m = a_steps is not None, self.steps, self.nics, self.m
        e_free = np.full(steps.where.shape[1], a_free)
        sent = []  # when each micro-batch's attention step ends (its dispatch leaves)
        for i in range(m):
            a_free += float(a_steps[0, i]) if varied else self.attn
            sent.append(a_free)
        for blk in range(self.L):
            returned = []
            for i in range(m):
                drawn = self.counts.draw(blk, self.rows, now)
                per_gpu = steps(drawn)
                if varied:
                    per_gpu = per_gpu * e_jit[blk, i]
                into = drawn @ steps.where
                e_free = np.maximum(e_free, nics.dispatch(sent[i], into)) + per_gpu
                exp_busy += float(per_gpu.sum())
                returned.append(nics.combine(e_free, into, float(e_free.max())))
            step = self.attn if blk < self.L - 1 else self.head
            for i in range(m):
                a_free = max(a_free, returned[i]) + (float(a_steps[blk + 1, i]) if varied else step)
                sent[i] = a_free
        return a_free, exp_busy


def pingpong(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int,
    duration_s: float, seed: int, variance: StepVariance = OFF,
) -> Simulated:  # fmt: skip
    """Ping-pong's lock-step (amoe.perf.plan.simulate.events.simulate_pingpong) with counts and every expert GPU's step
    at once; returns Simulated. `variance`: each attention step the slowest attention GPU's (× speed × jitter),
    each expert GPU's step × its speed × its jitter (docs/simulation.md "Step-time variance at scale")."""
    ga, ge = gpu_profile(dep.attn_gpu), gpu_profile(dep.expert_gpu)
    A, m, L = dep.num_attn, max(1, dep.micro_batches), model.num_blocks
    micro = max(1, min(dep.attn_cap, -(-concurrency // A)) // m)
    rows = A * micro
    steps = GroupedSteps(model, ge, dep.experts_on(model.num_expert_ids), host)
    counts = Counts(model, routing, seed)
    nics = Nics(model, dep, micro, steps.where.shape[1])
    begin = cm.transfer_time(64, pool_link(ga, dep))
    attn = cm.decode_attention_time(model, ga, micro, int(round(ctx)), host)
    head = cm.head_time(model, ga, micro, host=host)
    now, iterations, exp_busy, attn_busy = 0.0, 0, 0.0, 0.0
    E = steps.where.shape[1]
    varied = not variance.is_off
    if varied:
        a_speed, e_speed = variance.speeds(0, A), variance.speeds(A, E)
        rng = variance.jitter_rng(A + E)
        # [L + 1, m] each attention step's length, [L, m, E] each expert GPU's jitter: drawn per iteration
        kinds = np.concatenate([np.full(L, attn), [head]])
    lock = _Lockstep(counts, steps, nics, rows, m, L, attn, head)
    a_steps = e_jit = None
    while now < duration_s or iterations < 8:
        if varied:
            # The attention steps of one iteration: block 0's m steps first, then after block b the m steps of
            # block b + 1 (the head after the last); each the slowest attention GPU's.
            a_steps = (
                kinds[:, None, None] * a_speed * variance.draw(rng, (L + 1) * m * A).reshape(L + 1, m, A)
            )
            a_steps = a_steps.max(2)
            e_jit = variance.draw(rng, L * m * E).reshape(L, m, E) * e_speed
        now, exp_busy = lock.iteration(now + begin, now, exp_busy, a_steps, e_jit)
        attn_busy += m * (L * attn + head)
        iterations += 1
    tokens = rows * m
    tps = tokens * iterations / now
    return Simulated(
        tps, now / iterations, tokens, float(micro), float(rows * model.experts_per_token / model.num_expert_ids),
        min(1.0, attn_busy / now), min(1.0, exp_busy / (steps.where.shape[1] * now)),
    )  # fmt: skip
