"""The bounds of the two modes with an attention pool and an expert pool, AEP and ping-pong (amoe.perf.plan.bounds'
docstring), and the transfers between the pools: each end's link, the slower of the two setting a message's time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike

from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import GpuProfile, LinkProfile, gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.variance import SOURCED, StepVariance, expected_max
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.expert_steps import block_steps, expert_shares, grouped_steps, steps_key
from amoe.perf.plan.prediction import MEMORY, Prediction

# ---- transfers between the attention and expert pools (AEP, ping-pong): both ends' links, the incast
# (docs/cost-model.md "Both ends of a transfer between the pools")


def pool_link(gpu: GpuProfile, dep: Deployment) -> LinkProfile:
    """The link a transfer between the pools takes on `gpu`'s end: NVLink when both pools fit in one node, else
    its NIC (one 400 Gb/s NIC per H800)."""
    return gpu.nvlink if dep.num_attn + dep.num_expert <= dep.gpus_per_node else gpu.network


@dataclass(frozen=True)
class PoolLinks:
    """Seconds per hidden row on each end of a transfer between the pools. A message set's time is its latency
    plus the slower of its ends: the sender's link out and the receiver's link in, full duplex (a NIC's in and
    out directions are separate). Out (dispatch, model.dispatch_bytes: FP8 where served so) an attention GPU
    sends its rows' top-k copies and an expert GPU receives the rows of every attention GPU whose wave or
    micro-batch reached it: with A attention GPUs feeding E < A expert GPUs that is about A / E times as much
    (the incast), and more on the expert GPU that hosts the hottest experts or the shared one. Back (combine,
    activation bytes) the expert GPU sends those rows and each attention GPU receives its own."""

    latency: float
    attn_out: float
    attn_in: float
    expert_in: float
    expert_out: float

    def out_s(self, attn_rows: ArrayLike, expert_rows: ArrayLike) -> np.ndarray:
        """The dispatch: `attn_rows` leave each attention GPU, `expert_rows` reach the busiest expert GPU."""
        return self.latency + np.maximum(attn_rows * self.attn_out, expert_rows * self.expert_in)

    def back_s(self, attn_rows: ArrayLike, expert_rows: ArrayLike) -> np.ndarray:
        """The combine: `expert_rows` leave the busiest expert GPU, `attn_rows` reach each attention GPU."""
        return self.latency + np.maximum(attn_rows * self.attn_in, expert_rows * self.expert_out)


def pool_links(model: ModelProfile, dep: Deployment) -> PoolLinks:
    la = pool_link(gpu_profile(dep.attn_gpu), dep)
    le = pool_link(gpu_profile(dep.expert_gpu), dep)
    out, back = model.hidden_size * model.dispatch_bytes, model.hidden_size * model.bytes_per_activation
    return PoolLinks(
        latency=la.latency, attn_out=out / la.usable_bandwidth, attn_in=back / la.usable_bandwidth,
        expert_in=out / le.usable_bandwidth, expert_out=back / le.usable_bandwidth,
    )  # fmt: skip


def disaggregated_bound(
    model: ModelProfile,
    dep: Deployment,
    q: np.ndarray,
    mean_context: float,
    host: HostOverhead,
    itl_slo_s: float | None = None,
    variance: StepVariance = SOURCED,
) -> Prediction:
    ga, ge = gpu_profile(dep.attn_gpu), gpu_profile(dep.expert_gpu)
    placed = dep.experts_on(model.num_expert_ids)
    b = cm.attention_batch(model, ga, dep.attn_cap, cm.attention_rank_weight_bytes(model), mean_context)
    heaviest = max(cm.expert_rank_weight_bytes(model, experts) for experts in placed)
    if b < 1 or heaviest > ge.memory * ge.memory_utilization:
        return MEMORY
    ctx = int(round(mean_context))
    if dep.mode == "pingpong":
        return _pingpong(model, dep, q, ga, ge, placed, b, ctx, host, variance)
    kv_requests = int(
        cm.kv_capacity_tokens(ga, model, cm.attention_rank_weight_bytes(model)) // max(mean_context, 1)
    )
    return _aep(model, dep, q, ga, ge, placed, b, ctx, host, max(b, kv_requests), itl_slo_s, variance)


def doublings(start: int, stop: int) -> Iterator[int]:
    c = start
    while c < stop:
        yield c
        c *= 2
    yield stop


# Waves in flight per attention GPU the AEP bound considers at most (in doublings): past the point where the
# attention side is busy all the time more waves only lengthen ITL, and the search stops there well before this.
MAX_WAVES = 64


def _aep(
    model: ModelProfile, dep: Deployment, q: np.ndarray, ga: GpuProfile, ge: GpuProfile, placed: list[list[int]],
    b: int, ctx: int, host: HostOverhead, kv_requests: int, itl_slo_s: float | None = None,
    variance: StepVariance = SOURCED,
) -> Prediction:  # fmt: skip
    """AEP's bound with its critical path (as ping-pong's): each attention GPU keeps W waves of w rows in flight
    (w ≤ the attention batch b, W · w ≤ the requests its KV holds). An expert GPU serves a block's rows of m waves
    of every rank as one grouped step only if they reach it together, and then they travel together: per block
    the attention GPU runs their m steps in turn and the grouped step over A · m · w rows (the A ranks' groups
    arriving together: the best a scheduler can do) is on their critical path. For each m (a doubling dividing W;
    W / m groups of each rank) a group's iteration is at least its critical path — per block its m attention
    steps, one wave's transfer out, the hottest expert GPU's grouped step, one wave's transfer back (the group's
    other rows move while its other steps run), plus m heads; an attention GPU runs its W waves' steps one after
    another; an expert GPU runs W / m grouped steps a block. ITL = the slowest of these, with the m that gives
    the most throughput (m = 1: unmerged expert steps, one wave's path; m = W: merged steps, the merged path);
    throughput = A · W · w / ITL. The operating point is the least concurrency within 3 % of the most any
    (w, W) reaches (under `itl_slo_s`, of those that meet it): more only lengthens ITL (Little's law). Equal
    groups with the same m at every block are a restriction of the search (docs/simulation.md "Bounds": where it
    is only a model); extra["group_waves"] is the chosen m.

    With step-time variance each attention GPU r and expert GPU g has its speed s (a slowdown). A group waits at
    each block for the expected slowest of the expert GPUs it reached (jitter included), and — since every rank's
    group meets at each block's expert step — for the slowest attention GPU's steps: ranks whose waves share every
    expert step cannot run at different speeds, so all go at the slowest rank's pace (lock-step, as ping-pong's
    micro-batches; a rank kept apart would run at its own speed but pay its own expert steps, docs/simulation.md
    "Merged ranks move at the slowest rank's pace"): ITL = max(path at s_max, W · attention work · s_max, the
    slowest expert GPU's work, link).

    Links: each block's transfers take the slower end (`PoolLinks`; the hottest expert GPU receives A · w
    times its share of a token's rows), and ITL is at least the busiest NIC's time for the W waves' rows of an
    iteration ("link": the expert GPU with the most rows over the blocks, or an attention GPU's own w · k per
    block), extra["link_s"]."""
    A = dep.num_attn
    links = pool_links(model, dep)
    share = expert_shares(placed, q)  # [blocks, expert GPUs] rows received per token
    s_own = variance.speeds(0, A)  # [A] each attention GPU's own speed
    # Every rank at the slowest one's: the ranks' groups meet at every block's expert step (the docstring), so the
    # step waits for the slowest rank's attention and the others idle the difference. The per-rank arrays stay
    # (alike) so the search below reads as the per-rank sum it is.
    slowest = float(s_own.max())
    s_attn = np.full(A, slowest)
    s_exp = variance.speeds(A, len(placed))  # [expert GPUs]
    key = steps_key(model, ge, placed, q, dep.expert_cap, host)
    points = []
    for w in doublings(1, b):
        wave = _wave_costs(model, dep, ga, ctx, host, links, share, w)
        groups = _GroupSizes(variance.jitter)
        for W in doublings(1, max(1, min(MAX_WAVES, kv_requests // w))):
            # [blocks, expert GPUs] at their speeds
            groups.add(W, grouped_steps(model, ge, placed, q, A * W * w, dep.expert_cap, host, key) * s_exp)
            point, attention_bound = _aep_point(groups, W, w, wave, s_own, s_attn, slowest)
            points.append(point)
            if attention_bound:
                break  # attention-bound on every rank: more waves only lengthen ITL
    return _operating_point(points, itl_slo_s)


@dataclass(frozen=True)
class _WaveCosts:
    """One wave of w rows: its attention-GPU seconds per iteration, its blocks' transfers, and its seconds per
    iteration on the busiest NIC."""

    attn_busy: float
    moves: float
    link: float


def _wave_costs(
    model: ModelProfile,
    dep: Deployment,
    ga: GpuProfile,
    ctx: int,
    host: HostOverhead,
    links: PoolLinks,
    share: np.ndarray,
    w: int,
) -> _WaveCosts:
    blocks, A, k = model.num_blocks, dep.num_attn, model.experts_per_token
    hottest = share.max(axis=1)  # [blocks] the busiest receiver of each block sets its transfers
    per_iteration = float(share.sum(axis=0).max())  # the busiest expert GPU's rows per token and iteration
    t_attn = cm.decode_attention_time(model, ga, w, ctx, host)
    t_head = cm.head_time(model, ga, w, host=host)
    # Each block's dispatch and combine: a wave's w · k row copies on the attention GPU's link, the A waves'
    # rows the hottest expert GPU gets on its own (with A > E that end is the slower).
    moves = float(np.sum(links.out_s(w * k, A * w * hottest) + links.back_s(w * k, A * w * hottest)))
    # A wave's seconds per iteration on the busiest NIC in its busier direction (bytes only: latencies
    # overlap): the expert GPU receiving and returning the most rows, or an attention GPU's own rows.
    link = max(
        A * w * per_iteration * max(links.expert_in, links.expert_out),
        blocks * w * k * max(links.attn_out, links.attn_in),
    )
    return _WaveCosts(attn_busy=blocks * t_attn + t_head, moves=moves, link=link)


@dataclass
class _GroupSizes:
    """Per group size m (a rank's waves that meet at every block's expert GPUs as one grouped step, with the other
    ranks' m waves): each expert GPU's seconds for one group's steps of an iteration at its speed, and the group's
    wait at each block's slowest expert GPU summed over the blocks — its expectation (jitter) is computed only for
    a size that could still be the best (`_best_group`; most of `amoe plan`'s time at 256 GPUs was expected_max).
    Filled as W doubles: m = W is the only new size, so the cached steps are asked exactly as often as before."""

    jitter: float
    sizes: list[int] = field(default_factory=list)
    steps_of: list[np.ndarray] = field(default_factory=list)  # [blocks, expert GPUs] per size
    works: list[np.ndarray] = field(default_factory=list)  # [expert GPUs] per size
    floors: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # nan until computed

    def add(self, size: int, steps: np.ndarray) -> None:
        self.sizes.append(size)
        self.steps_of.append(steps)
        self.works.append(steps.sum(axis=0))
        # expected_max is never below its largest lower end (the same operations: a lower bound to the bit).
        self.floors.append(float(np.sum((steps * (1 - self.jitter)).max(axis=1))))
        self.waits.append(math.nan)


def _aep_point(
    groups: _GroupSizes,
    W: int,
    w: int,
    wave: _WaveCosts,
    s_own: np.ndarray,
    s_attn: np.ndarray,
    slowest: float,
) -> tuple[Prediction, bool]:
    """AEP's point with W waves of w rows per attention GPU, at the group size that gives the most throughput; and
    whether it is attention-bound on every rank."""
    A = len(s_attn)
    m = np.array(groups.sizes)
    ok = np.flatnonzero(W % m == 0)  # groups of equal size (W a doubling: every smaller doubling)
    m = m[ok]
    per_gpu = (W // m)[:, None] * np.array(groups.works)[ok]  # [sizes, GPUs]: W / m groups' steps
    experts = per_gpu.max(axis=1)
    link = W * wave.link
    rest = np.maximum(W * wave.attn_busy * s_attn, np.maximum(experts, link)[:, None])  # [sizes, A]
    # Each rank's group's critical path but its wait: per block its m attention steps one after another
    # (and m heads), one wave's transfers each way (the earlier waves' rows move while the later waves'
    # attention runs); the wait is the grouped step over the m waves of every rank.
    base = wave.moves + m[:, None] * wave.attn_busy * s_attn  # [sizes, A]
    best = _best_group(W * w, base, rest, ok, groups.floors, groups.waits, groups.steps_of, groups.jitter)
    paths = base[best] + groups.waits[ok[best]]
    itls = np.maximum(paths, rest[best])
    group, experts, per_gpu = int(m[best]), float(experts[best]), per_gpu[best]
    path = float(paths.max())
    concurrency = A * W * w
    tps = float(np.sum(W * w / itls))
    attention = W * wave.attn_busy * slowest
    worst = float(itls.max())  # the slowest rank's bottleneck names the point
    side = {path: "critical path", attention: "attention", experts: "experts", link: "link"}[worst]
    point = Prediction(
        tokens_per_s=tps, itl_s=concurrency / tps, concurrency=concurrency, bottleneck=side,
        attention_tokens_per_s=float(np.sum(w / (wave.attn_busy * s_own))),
        expert_tokens_per_s=concurrency / experts,
        expert_skew=float(per_gpu.max() / per_gpu.mean()),
        extra={"waves": W, "wave_rows": w, "group_waves": group, "critical_path_s": path, "link_s": link},
    )  # fmt: skip
    return point, attention >= max(path, experts, link)


def _operating_point(points: list[Prediction], itl_slo_s: float | None) -> Prediction:
    """The least concurrency within 3 % of the most throughput any point reaches; under an ITL objective only the
    points that meet it (none: the best, which the planner then drops)."""
    points = [p for p in points if itl_slo_s is None or p.itl_s <= itl_slo_s] or points
    most = max(p.tokens_per_s for p in points)
    return min((p for p in points if p.tokens_per_s >= 0.97 * most), key=lambda p: (p.concurrency, p.itl_s))


def wave_group(extra: dict, attn_cap: int) -> int:
    """The runtime's `scheduler.wave_group` for an AEP bound (its `extra`): the bound's group is m waves of w rows
    of every rank, the runtime's waves have `attn_cap` rows (docs/scheduler.md "Wave size"), so a group is
    m · w / attn_cap of them (at least one)."""
    m, w = int(extra.get("group_waves", 1)), int(extra.get("wave_rows", attn_cap))
    return max(1, m * w // attn_cap)


def _best_group(
    rows: int, base: np.ndarray, rest: np.ndarray, ok: np.ndarray, floors: list[float], waits: list[float],
    steps_of: list[np.ndarray], jitter: float,
) -> int:  # fmt: skip
    """The group size (index into `ok`) with the most throughput Σ_r rows / max(base_r + wait, rest_r), the
    smallest of equals. A size's wait (expected_max over each block's expert GPUs, summed; cached in `waits`) is
    computed only while the size could still beat the best so far with its wait at its floor (never above it)."""
    ceilings = np.sum(rows / np.maximum(base + np.array(floors)[ok][:, None], rest), axis=1)  # [sizes]
    best, most = -1, -math.inf
    for i in np.argsort(-ceilings, kind="stable"):
        if ceilings[i] < most:
            break
        j = ok[i]
        if math.isnan(waits[j]):
            waits[j] = float(np.sum(expected_max(steps_of[j], jitter)))
        got = float(np.sum(rows / np.maximum(base[i] + waits[j], rest[i])))
        if got > most or (got == most and i < best):
            best, most = int(i), got
    return best


def _pingpong(
    model: ModelProfile, dep: Deployment, q: np.ndarray, ga: GpuProfile, ge: GpuProfile, placed: list[list[int]],
    b: int, ctx: int, host: HostOverhead, variance: StepVariance = SOURCED,
) -> Prediction:  # fmt: skip
    """Eq. 5's shape; with step-time variance each lock-step waits for the expected slowest attention GPU (its
    micro-batch) and the expected slowest expert GPU. Each block's two transfers take the slower end
    (`PoolLinks`), and the iteration is at least the busiest NIC's time for its m micro-batches' rows of every
    block ("link", extra["link_s"])."""
    m = max(1, dep.micro_batches)
    micro = max(1, b // m)
    s_attn = variance.speeds(0, dep.num_attn)
    s_exp = variance.speeds(dep.num_attn, len(placed))
    t_attn = expected_max(cm.decode_attention_time(model, ga, micro, ctx, host) * s_attn, variance.jitter)
    rows_in = dep.num_attn * micro  # one micro-batch of every attention GPU reaches the experts together
    # Each block's two transfers on both ends' links: a micro-batch's row copies leave (and come back to) each
    # attention GPU, the busiest expert GPU receives (and returns) its share of every attention GPU's rows.
    links, k = pool_links(model, dep), model.experts_per_token
    share = expert_shares(placed, q)  # [blocks, expert GPUs] rows received per token
    hottest = share.max(axis=1) * rows_in  # [blocks] rows into the busiest expert GPU
    moves = links.out_s(micro * k, hottest) + links.back_s(micro * k, hottest)  # [blocks]
    # The busiest NIC's seconds per iteration in its busier direction (bytes only: latencies overlap, and one
    # block's hot expert GPU returns while the next block's dispatch enters another): m micro-batches a block.
    link_s = m * max(
        model.num_blocks * micro * k * max(links.attn_out, links.attn_in),
        float(share.sum(axis=0).max()) * rows_in * max(links.expert_in, links.expert_out),
    )
    block_s, skew, shape_s = 0.0, [], 0.0
    table = block_steps(model, ge, placed, q, rows_in, host, vectorised=len(placed) > 16)
    # Every block's barrier in one call (row by row the same numbers: expected_max reduces each row on its own).
    t_exps = expected_max(table * s_exp, variance.jitter)  # [blocks]
    for blk in range(model.num_blocks):
        per_gpu = table[blk].tolist()
        t_exp = float(t_exps[blk])
        skew.append(max(per_gpu) / (sum(per_gpu) / len(per_gpu)))
        shape = max(m * t_attn, m * t_exp, t_attn + t_exp)
        shape_s += shape
        block_s += shape + moves[blk]  # Eq. 5's shape plus the two transfers
    shaped = block_s + expected_max(cm.head_time(model, ga, b, host=host) * s_attn, variance.jitter)
    # ... unless the busiest NIC cannot carry the iteration's transfers in that time.
    iteration = max(shaped, link_s)
    concurrency = dep.num_attn * micro * m
    tps = concurrency / iteration
    attn_bound = m * t_attn * model.num_blocks
    if link_s > shaped:
        side = "link"
    else:
        side = "attention" if attn_bound >= shape_s - 1e-12 else "experts"
    return Prediction(
        tokens_per_s=tps, itl_s=iteration, concurrency=concurrency, bottleneck=side,
        expert_skew=float(np.mean(skew)), extra={"link_s": link_s},
    )  # fmt: skip
