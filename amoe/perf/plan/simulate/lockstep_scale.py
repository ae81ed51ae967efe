"""The barrier modes at scale (amoe.perf.plan.simulate.scale's docstring): EP (plain, with EPLB's redundant experts,
with two-batch overlap) and ping-pong's lock-step, in counts, every expert GPU's step at once.

Every attention rank's attention step is its own (amoe.perf.plan.simulate.rank_steps): on a trace workload from
the requests it holds, else every rank the same batch at the mean context. A barrier waits for the slowest rank's
step, and the others' waits are counted: `Simulated.barrier_idle` and `attention_idle` (docs/simulation.md "The
barrier tax"). With `balanced` every rank's attention is the mean of the ranks' loads, the same requests
otherwise: the deployment without the attention side's imbalance.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model import ep_scale
from amoe.perf.model.gpus import GpuProfile, gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.traces import RequestTrace
from amoe.perf.model.variance import OFF, StepVariance
from amoe.perf.plan.bound_ep import ep_exchange_parts, ep_micro_batch, ep_placements
from amoe.perf.plan.bound_pools import pool_link
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.simulate.counts import Counts, GroupedSteps, Nics, share_matrix
from amoe.perf.plan.simulate.rank_steps import RankSteps, head_times, kv_blocks, waits
from amoe.perf.plan.simulate.result import Simulated


@dataclass
class _EpBlocks:
    """One EP iteration's blocks: per block this iteration's counts, each device's grouped GEMM over its copies,
    two barriers per micro-batch (dispatch after attention, combine after the experts) and the exchange on the wire
    between, hidden behind the other micro-batch's stages under two-batch overlap (amoe.perf.model.ep_scale).
    `mb`: the nominal micro-batch (every rank the plan's rows at the mean context): its stages' proportions, and
    its exchange where the ranks hold the plan's rows."""

    model: ModelProfile
    gpu: GpuProfile
    dep: Deployment
    counts: Counts
    steps: list[GroupedSteps]
    variance: StepVariance
    mb: ep_scale.MicroBatch
    halves: int
    exchanges: dict[float, tuple[float, float]] = field(
        default_factory=dict
    )  # by a micro-batch's largest rows

    def __post_init__(self) -> None:
        n = self.dep.num_attn
        if not self.variance.is_off:
            self.speed = self.variance.speeds(0, n)  # [devices]
            self.rng = self.variance.jitter_rng(n)

    def exchange(self, rows: float) -> tuple[float, float]:
        """(dispatch, combine) of a micro-batch whose largest device sends `rows` rows."""
        if rows not in self.exchanges:
            self.exchanges[rows] = ep_exchange_parts(self.model, self.gpu, rows, self.dep)
        return self.exchanges[rows]

    def factors(self) -> np.ndarray | None:
        """[1 + 2 · L · halves, devices]: each barrier's speed × jitter (the head, then per block and micro-batch
        the attention's and the experts'), drawn at once an iteration; None without variance."""
        if self.variance.is_off:
            return None
        n, L = self.dep.num_attn, self.model.num_blocks
        return self.speed * self.variance.draw(self.rng, (1 + 2 * L * self.halves) * n).reshape(-1, n)

    def block(self, a: np.ndarray, e: np.ndarray, wire: tuple[float, float] | None) -> float:
        """One block's time from its [halves, devices] attention and expert steps, each barrier at the slowest;
        `wire`: the exchange's (dispatch, combine), None where every step is the nominal micro-batch's."""
        a_max, e_max, mb = a.max(1), e.max(1), self.mb
        if wire is None:
            return ep_scale.block_time(replace(mb, experts=float(e_max[0])), self.halves == 2)
        dispatch, combine = wire
        if self.halves == 1:
            return float(a_max[0] + e_max[0]) + dispatch + combine
        share = mb.stage_in / (
            mb.stage_in + mb.stage_out
        )  # each micro-batch's stages in the nominal proportion
        return ep_scale.overlapped_block(a_max * share, a_max * (1 - share), e_max, dispatch, combine)

    def iteration(
        self, rows: np.ndarray, attn: np.ndarray, head: np.ndarray, elapsed: float, traced: bool
    ) -> tuple[float, float, float, float]:
        """One iteration of the ranks' [halves, devices] requests and attention steps and [devices] heads: (its
        seconds, the devices' mean expert busy seconds, the seconds devices waited at the attention barriers and
        the head's, at the experts' barriers). `traced`: the ranks' loads differ (the exchange at the largest)."""
        f = self.factors()
        n, L, halves, queries = (
            self.dep.num_attn,
            self.model.num_blocks,
            self.halves,
            1 + self.dep.draft_tokens,
        )
        head_max, waited_attn = waits(head if f is None else head * f[0])
        tokens = int(
            round(float(rows.sum()) * queries / halves)
        )  # one micro-batch's rows, drawn once a block
        if traced:
            wire = self.exchange(float(rows.max()) * queries)
        else:
            wire = None if f is None else (self.mb.dispatch, self.mb.combine)
        layers = busy = waited_exp = 0.0
        if f is not None:
            f = f[1:].reshape(L, halves, 2, n)
        for blk in range(L):
            per_device = self.steps[blk](self.counts.draw(blk, tokens, elapsed))  # [devices]
            a = attn if f is None else attn * f[blk, :, 0]
            e = np.broadcast_to(per_device, (halves, n)) if f is None else per_device * f[blk, :, 1]
            layers += self.block(a, e, wire)
            busy += float(e.mean(1).sum()) / halves
            waited_attn += waits(a)[1]
            waited_exp += waits(e)[1]
        mtp = 1 + self.dep.draft_tokens / self.model.layers  # the MTP module: one more layer a draft token
        return float(head_max) + layers * mtp, busy, waited_attn, waited_exp


def ep(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int,
    duration_s: float, seed: int, variance: StepVariance = OFF, trace: RequestTrace | None = None,
    balanced: bool = False,
) -> Simulated:  # fmt: skip
    """EP at scale (and with EPLB or two-batch overlap at any scale): per iteration and block this iteration's
    counts, each device's grouped GEMM over its expert copies, the barriers at the slowest device, and
    multi-token prediction's module; returns Simulated. `variance`: each device's steps × its speed × a jitter per
    barrier (docs/simulation.md "Step-time variance at scale"). `trace`: each device's attention from its own
    requests (module docstring; not with draft tokens)."""
    if trace is not None and dep.draft_tokens:
        raise ValueError(
            "simulate: a trace workload with multi-token prediction's draft tokens is not modelled"
        )
    gpu = gpu_profile(dep.attn_gpu)
    n, halves, queries = dep.num_attn, 2 if dep.two_batch_overlap else 1, 1 + dep.draft_tokens
    b = max(1, min(dep.attn_cap, -(-concurrency // n)))
    counts = Counts(model, routing, seed)
    placements = ep_placements(model, dep, counts.inclusion(0.0))
    unique = {
        id(p): GroupedSteps(model, gpu, share_matrix(model.num_expert_ids, p), host) for p in placements
    }
    mb = ep_micro_batch(
        model, gpu, max(queries, round(b * queries / halves)), int(round(ctx)), dep, host, queries
    )
    blocks = _EpBlocks(model, gpu, dep, counts, [unique[id(p)] for p in placements], variance, mb, halves)
    weights = cm.attention_rank_weight_bytes(model) + max(
        cm.expert_rank_weight_bytes(model, [e for e, _ in p]) for p in placements[0]
    )
    ranks = RankSteps(
        model, gpu, host, n, halves, b / halves, ctx, trace, seed, balanced, kv_blocks(model, gpu, weights)
    )
    nominal = (
        np.full((halves, n), mb.stage_in + mb.stage_out),
        np.full(n, cm.head_time(model, gpu, b * queries, b * queries, host)),
    )
    elapsed, iterations, busy, tokens, waited = 0.0, 0, 0.0, 0.0, np.zeros(2)
    while elapsed < duration_s or iterations < 8:
        rows, attn = ranks.step()
        attn, head = (attn, head_times(model, gpu, rows.sum(0), host)) if ranks.traced else nominal
        seconds, exp_busy, waited_attn, waited_exp = blocks.iteration(rows, attn, head, elapsed, ranks.traced)
        elapsed += seconds
        busy += exp_busy
        tokens += float(rows.sum()) * dep.tokens_per_request_step
        waited += (waited_attn, waited_exp)
        iterations += 1
        ranks.decode()
    conc = n * b
    return Simulated(
        tokens / elapsed, elapsed / iterations / dep.tokens_per_request_step, conc, float(b),
        float(conc * queries * model.experts_per_token / model.num_expert_ids), 1.0,
        min(1.0, busy * halves / elapsed), barrier_idle=float(waited.sum()) / (n * elapsed),
        attention_idle=float(waited[0]) / (n * elapsed),
    )  # fmt: skip


@dataclass(frozen=True)
class _Lockstep:
    """One ping-pong iteration in lock-step: its m micro-batches' attention steps block by block, each block's
    expert steps of every expert GPU at once, both ends' links."""

    counts: Counts
    steps: GroupedSteps
    nics: Nics
    m: int
    L: int
    attn: float
    head: float

    def iteration(
        self, a_free: float, now: float, exp_busy: float, rows: np.ndarray, a_steps: np.ndarray | None,
        e_jit: np.ndarray | None,
    ) -> tuple[float, float]:  # fmt: skip
        """From `a_free` (the iteration's start after its BEGIN message): when its last attention step ends, and
        `exp_busy` with its expert GPUs' seconds added. `now`: the routing's time (shifting skew). `rows` [m]:
        each micro-batch's rows over the attention GPUs; `a_steps` [L + 1, m] and `e_jit` [L, m, E]: the
        iteration's attention steps (each the slowest attention GPU's) and expert jitters (None: the plain
        steps, none)."""
        steps, nics, m = self.steps, self.nics, self.m
        e_free = np.full(steps.where.shape[1], a_free)
        sent = []  # when each micro-batch's attention step ends (its dispatch leaves)
        for i in range(m):
            a_free += float(a_steps[0, i]) if a_steps is not None else self.attn
            sent.append(a_free)
        for blk in range(self.L):
            returned = []
            for i in range(m):
                drawn = self.counts.draw(blk, int(rows[i]), now)
                per_gpu = steps(drawn)
                if e_jit is not None:
                    per_gpu = per_gpu * e_jit[blk, i]
                into = drawn @ steps.where
                e_free = np.maximum(e_free, nics.dispatch(sent[i], into)) + per_gpu
                exp_busy += float(per_gpu.sum())
                returned.append(nics.combine(e_free, into, float(e_free.max())))
            step = self.attn if blk < self.L - 1 else self.head
            for i in range(m):
                a_free = max(a_free, returned[i]) + (
                    float(a_steps[blk + 1, i]) if a_steps is not None else step
                )
                sent[i] = a_free
        return a_free, exp_busy


def _pingpong_steps(
    ranks: RankSteps, model: ModelProfile, gpu: GpuProfile, host: HostOverhead, variance: StepVariance,
    a_speed: np.ndarray | None, rng: np.random.Generator | None,
) -> tuple[np.ndarray, np.ndarray | None, float, float]:  # fmt: skip
    """This iteration's attention GPUs: [m] rows of each micro-batch over them, [L + 1, m] each lock-step (the
    slowest attention GPU's; None: every GPU the plain step), the seconds the others waited for it, and the mean
    GPU's busy seconds. The steps: block 0's m micro-batches first, then after block b the m of block b + 1, the
    heads after the last block."""
    rows, attn = ranks.step()  # [m, A]
    L = model.num_blocks
    per = np.concatenate([np.broadcast_to(attn, (L, *attn.shape)), head_times(model, gpu, rows, host)[None]])
    busy = float(per.sum(axis=(0, 1)).mean())  # the cost model's seconds (busy counts them unvaried)
    if not variance.is_off:
        per = per * a_speed * variance.draw(rng, per.size).reshape(per.shape)
    elif not ranks.traced:
        return rows.sum(1), None, 0.0, busy
    slowest, waited = waits(per)
    return rows.sum(1), slowest, waited, busy


def pingpong(
    model: ModelProfile, dep: Deployment, routing: str, ctx: float, host: HostOverhead, concurrency: int,
    duration_s: float, seed: int, variance: StepVariance = OFF, trace: RequestTrace | None = None,
    balanced: bool = False,
) -> Simulated:  # fmt: skip
    """Ping-pong's lock-step (amoe.perf.plan.simulate.events.simulate_pingpong) with counts and every expert GPU's
    step at once; returns Simulated. `variance`: each attention step the slowest attention GPU's (× speed ×
    jitter), each expert GPU's step × its speed × its jitter (docs/simulation.md "Step-time variance at scale").
    `trace`: each attention GPU's micro-batches from its own requests (module docstring)."""
    ga, ge = gpu_profile(dep.attn_gpu), gpu_profile(dep.expert_gpu)
    A, m, L = dep.num_attn, max(1, dep.micro_batches), model.num_blocks
    micro = max(1, min(dep.attn_cap, -(-concurrency // A)) // m)
    steps = GroupedSteps(model, ge, dep.experts_on(model.num_expert_ids), host)
    E = steps.where.shape[1]
    lock = _Lockstep(
        Counts(model, routing, seed), steps, Nics(model, dep, micro, E), m, L,
        cm.decode_attention_time(model, ga, micro, int(round(ctx)), host), cm.head_time(model, ga, micro, host=host),
    )  # fmt: skip
    blocks = kv_blocks(model, ga, cm.attention_rank_weight_bytes(model))
    ranks = RankSteps(model, ga, host, A, m, micro, ctx, trace, seed, balanced, blocks)
    begin = cm.transfer_time(64, pool_link(ga, dep))
    now, iterations, exp_busy, attn_busy, tokens, waited = 0.0, 0, 0.0, 0.0, 0.0, 0.0
    a_speed = rng = e_jit = None
    if not variance.is_off:
        a_speed, e_speed = variance.speeds(0, A), variance.speeds(A, E)
        rng = variance.jitter_rng(A + E)
    while now < duration_s or iterations < 8:
        rows, a_steps, idle, busy = _pingpong_steps(ranks, model, ga, host, variance, a_speed, rng)
        if not variance.is_off:  # [L, m, E] each expert GPU's jitter, drawn after the attention steps'
            e_jit = variance.draw(rng, L * m * E).reshape(L, m, E) * e_speed
        now, exp_busy = lock.iteration(now + begin, now, exp_busy, rows, a_steps, e_jit)
        attn_busy += busy
        waited += idle
        tokens += float(rows.sum())
        iterations += 1
        ranks.decode()
    conc = A * micro * m
    tps = tokens / now
    return Simulated(
        tps, conc / tps, conc, float(micro), float(A * micro * model.experts_per_token / model.num_expert_ids),
        min(1.0, attn_busy / now), min(1.0, exp_busy / (E * now)), barrier_idle=waited / (A * now),
        attention_idle=waited / (A * now),
    )  # fmt: skip
