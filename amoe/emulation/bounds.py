"""What a deployment can do at best on emulated GPUs: decode throughput and inter-token latency of AEP, EP and
ping-pong, from the cost model's step times (docs/emulation.md "Bounds"; `amoe plan` searches over these).

Every bound is at the profile's full depth (a truncated `NAME:N` profile is a benchmark device, not a model), with
the expected load of each expert taken from the exact probability that it is among a token's top-k picks
(`routing.inclusion_probabilities`), per block:

* **AEP**: each attention GPU keeps W waves of w rows in flight (KV and the batch cap permitting); a rank's waves
  meet the expert GPUs in groups of m (m a doubling dividing W) that travel together, and a group's iteration is
  its critical path, per block its m attention steps + transfer + the hottest expert GPU's grouped step over the
  block's rows of every attention GPU's group + transfer back, plus the heads; expert GPU g runs W / m grouped
  steps a block, so ITL = max(path_m, W · attention work, W / m · g's work, link), with the best m, and
  throughput = A · W · w / ITL (as ping-pong's bound, without its lock-step). The hottest expert GPU over all
  blocks, not the mean, sets the expert side's rate: with skew it carries more than its share.
* **EP**: every device runs attention on b rows, then a dispatch all-to-all, one grouped GEMM over its local
  experts (one host step, not one per expert), a combine all-to-all, and waits at the barrier for the slowest
  device, block after block.
* **Ping-pong** (MegaScale-Infer): attention and expert pools as AEP, each attention batch split into m
  micro-batches that alternate between the pools block by block; a block takes the slower pool's m steps plus the
  two transfers that the alternation cannot hide.

Transfers between AEP's and ping-pong's pools (issue 35, the incast; `PoolLinks`) take the slower of the sender's
and the receiver's link: an expert GPU receives the rows of every attention GPU whose wave or micro-batch reached
it (A / E times what one attention GPU sends when A > E, more on a hot one), and the busiest such GPU sets each
block's transfers. Each GPU's NIC (full duplex) is also a throughput limit, bottleneck "link": per iteration it
moves its rows in and out, whatever the waves or micro-batches.

ITL follows from Little's law: concurrency / throughput (each of the C requests decoding at once gets one token per
C / T seconds).

Step-time variance (amoe.emulation.variance; sourced by default, `variance=OFF` for none): every GPU runs at its own
fixed speed (GPU i of the deployment: attention GPUs first, then expert GPUs; EP: device i) and each step jitters. A
barrier pays the slowest: EP's blocks and ping-pong's micro-batch steps wait for `expected_max` over the devices, and
so does an AEP wave's critical path at the expert GPUs of a block. A queue does not: each AEP GPU works at its own
speed and the slowest expert GPU sets the expert side's rate; but attention GPUs whose waves meet at every block's
expert step go at the slowest one's pace (`_aep`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model import ep_block
from amoe.perf.model.gpus import GpuProfile, gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.links import all_to_all_time
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.variance import SOURCED, StepVariance, expected_max

# ---- transfers between the attention and expert pools (AEP, ping-pong): both ends' links (issue 35, incast)


def pool_link(gpu: GpuProfile, dep: Deployment):
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

    def out_s(self, attn_rows, expert_rows):
        """The dispatch: `attn_rows` leave each attention GPU, `expert_rows` reach the busiest expert GPU."""
        return self.latency + np.maximum(attn_rows * self.attn_out, expert_rows * self.expert_in)

    def back_s(self, attn_rows, expert_rows):
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


def expert_shares(placed: list[list[int]], q: np.ndarray) -> np.ndarray:
    """[blocks, expert GPUs]: the rows each expert GPU receives per token of a block (Σ of its experts' inclusion
    probabilities; the GPU hosting the shared expert gets every token)."""
    where = np.zeros((q.shape[1], len(placed)))
    for g, experts in enumerate(placed):
        where[experts, g] = 1.0
    return q @ where


# ---- deployments and predictions


@dataclass(frozen=True)
class Deployment:
    """A candidate deployment: which mode, how many GPUs of which type in which role, the batch caps."""

    mode: str  # aep | ep | pingpong
    attn_gpu: str
    num_attn: int  # ep: the devices of one EP group
    expert_gpu: str = ""
    num_expert: int = 0
    attn_cap: int = 256  # rows per attention step (ep / pingpong: a device's batch)
    expert_cap: int = 512  # rows per expert step (aep)
    micro_batches: int = 1  # pingpong's m
    replicas: int = 1  # independent copies of the deployment serving side by side (behind one load balancer)
    expert_map: tuple[int, ...] | None = None  # expert -> expert GPU (aep / pingpong); None: e mod num_expert
    gpus_per_node: int = 8  # which transfers cross hosts
    # ep: EPS-MoE's expert pipeline (amoe.emulation.eps): PN (0: auto, the runtime's choice) and the kernel
    # (grouped | dense | auto); 1 and "": EP's one grouped step between two all-to-alls, as before.
    ep_pipelines: int = 1
    ep_kernel: str = ""

    @property
    def pipelined(self) -> bool:
        return self.mode == "ep" and (self.ep_pipelines != 1 or bool(self.ep_kernel))

    # EP as deployed at scale (issue 35, amoe.emulation.ep_at_scale): redundant expert copies placed by EPLB per
    # layer, and two-batch overlap of the exchange with compute.
    redundant_experts: int = 0
    two_batch_overlap: bool = False

    @property
    def num_gpus(self) -> int:
        return self.replicas * (self.num_attn + self.num_expert)

    def gpus(self) -> dict[str, int]:
        """GPUs used, by type."""
        used = {self.attn_gpu: self.replicas * self.num_attn}
        if self.num_expert:
            used[self.expert_gpu] = used.get(self.expert_gpu, 0) + self.replicas * self.num_expert
        return used

    def experts_on(self, num_experts: int) -> list[list[int]]:
        """Experts of each expert GPU (ep: of each device)."""
        hosts = self.num_attn if self.mode == "ep" else self.num_expert
        where = self.expert_map or tuple(e % hosts for e in range(num_experts))
        return [[e for e in range(num_experts) if where[e] == g] for g in range(hosts)]


@dataclass(frozen=True)
class Prediction:
    """A deployment's best decode throughput and the ITL it comes with."""

    tokens_per_s: float
    itl_s: float
    concurrency: int  # requests decoding at once
    bottleneck: str  # attention | experts | critical path | link | barrier | memory
    attention_tokens_per_s: float = 0.0
    expert_tokens_per_s: float = 0.0
    expert_skew: float = (
        1.0  # the busiest expert GPU's load over the mean (aep / pingpong; ep: per block, mean)
    )
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


MEMORY = Prediction(0.0, math.inf, 0, "memory")


def full_depth(model: ModelProfile) -> ModelProfile:
    """The profile at its model's full depth (a `NAME:N` benchmark profile keeps N blocks; its bounds are the full
    model's × N / depth, since the head is scaled too, so ratios do not depend on the truncation)."""
    if model.full_blocks is None:
        return model
    return replace(model, name=model.name.partition(":")[0], num_blocks=model.full_blocks, full_blocks=None)


def predict(
    model: ModelProfile,
    dep: Deployment,
    inclusion: np.ndarray,
    mean_context: float,
    host: HostOverhead,
    itl_slo_s: float | None = None,
    variance: StepVariance = SOURCED,
) -> Prediction:
    """The bound of `dep` (module docstring) for a model at full depth and per-block inclusion probabilities.
    Replicas multiply throughput and concurrency; ITL is one copy's. With `itl_slo_s` AEP's operating point is the
    best whose ITL meets it (EP's and ping-pong's are set by the batch cap and micro-batches the search varies).
    `variance`: the GPUs' step-time variance (module docstring)."""
    one = replace(dep, replicas=1)
    pred = (
        _ep(model, one, inclusion, mean_context, host, variance)
        if dep.mode == "ep"
        else _disaggregated(model, one, inclusion, mean_context, host, itl_slo_s, variance)
    )
    if dep.replicas == 1 or pred.tokens_per_s <= 0:
        return pred
    return replace(
        pred, tokens_per_s=pred.tokens_per_s * dep.replicas, concurrency=pred.concurrency * dep.replicas,
        attention_tokens_per_s=pred.attention_tokens_per_s * dep.replicas,
        expert_tokens_per_s=pred.expert_tokens_per_s * dep.replicas,
    )  # fmt: skip


def _attention_batch(
    model: ModelProfile, gpu: GpuProfile, cap: int, weights: float, mean_context: float
) -> int:
    kv = cm.kv_capacity_tokens(gpu, model, weights)
    return max(0, min(cap, int(kv // max(mean_context, 1.0))))


def _disaggregated(
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
    b = _attention_batch(model, ga, dep.attn_cap, cm.attention_rank_weight_bytes(model), mean_context)
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


def _doublings(start: int, stop: int):
    c = start
    while c < stop:
        yield c
        c *= 2
    yield stop


# Waves in flight per attention GPU the AEP bound considers at most (in doublings): past the point where the
# attention side is busy all the time more waves only lengthen ITL, and the search stops there well before this.
MAX_WAVES = 64


def _aep(
    model, dep, q, ga, ge, placed, b, ctx, host, kv_requests, itl_slo_s=None, variance=SOURCED
) -> Prediction:
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
    groups with the same m at every block are a restriction of the search (docs/emulation.md "Bounds": where it
    is a model); extra["group_waves"] is the chosen m.

    With step-time variance each attention GPU r and expert GPU g has its speed s (a slowdown). A group waits at
    each block for the expected slowest of the expert GPUs it reached (jitter included), and — since every rank's
    group meets at each block's expert step — for the slowest attention GPU's steps: ranks whose waves share every
    expert step cannot run at different speeds, so all go at the slowest rank's pace (lock-step, as ping-pong's
    micro-batches; a rank kept apart would run at its own speed but pay its own expert steps, docs/emulation.md
    "Merged ranks move at the slowest rank's pace"): ITL = max(path at s_max, W · attention work · s_max, the
    slowest expert GPU's work, link).

    Links (issue 35): each block's transfers take the slower end (`PoolLinks`; the hottest expert GPU receives A · w
    times its share of a token's rows), and ITL is at least the busiest NIC's time for the W waves' rows of an
    iteration ("link": the expert GPU with the most rows over the blocks, or an attention GPU's own w · k per
    block), extra["link_s"]."""
    blocks, A, k = model.num_blocks, dep.num_attn, model.experts_per_token
    links = pool_links(model, dep)
    share = expert_shares(placed, q)  # [blocks, expert GPUs] rows received per token
    hottest = share.max(axis=1)  # [blocks] the busiest receiver of each block sets its transfers
    per_iteration = float(share.sum(axis=0).max())  # the busiest expert GPU's rows per token and iteration
    s_own = variance.speeds(0, A)  # [A] each attention GPU's own speed
    # Every rank at the slowest one's: the ranks' groups meet at every block's expert step (the docstring), so the
    # step waits for the slowest rank's attention and the others idle the difference. The per-rank arrays stay
    # (alike) so the search below reads as the per-rank sum it is.
    slowest = float(s_own.max())
    s_attn = np.full(A, slowest)
    s_exp = variance.speeds(A, len(placed))  # [expert GPUs]
    key = steps_key(model, ge, placed, q, dep.expert_cap, host)
    points = []
    for w in _doublings(1, b):
        t_attn = cm.decode_attention_time(model, ga, w, ctx, host)
        t_head = cm.head_time(model, ga, w, host=host)
        # Each block's dispatch and combine: a wave's w · k row copies on the attention GPU's link, the A waves'
        # rows the hottest expert GPU gets on its own (issue 35: with A > E that end is the slower).
        moves = float(np.sum(links.out_s(w * k, A * w * hottest) + links.back_s(w * k, A * w * hottest)))
        attn_busy = blocks * t_attn + t_head  # one wave's attention-GPU seconds per iteration
        # A wave's seconds per iteration on the busiest NIC in its busier direction (bytes only: latencies
        # overlap): the expert GPU receiving and returning the most rows, or an attention GPU's own rows.
        link_1 = max(
            A * w * per_iteration * max(links.expert_in, links.expert_out),
            blocks * w * k * max(links.attn_out, links.attn_in),
        )
        # Per group size m (a rank's waves that meet at every block's expert GPUs as one grouped step, with the
        # other ranks' m waves): each expert GPU's seconds for one group's steps of an iteration at its speed, and
        # the group's wait at each block's slowest expert GPU summed over the blocks — its expectation (jitter) is
        # computed only for a size that could still be the best (`_best_group`; most of `amoe plan`'s time at 256
        # GPUs was expected_max, issue 35). Filled as W doubles: m = W is the only new size, so the cached steps
        # are asked exactly as often as before.
        sizes, steps_of, works, floors, waits = [], [], [], [], []
        for W in _doublings(1, max(1, min(MAX_WAVES, kv_requests // w))):
            # [blocks, expert GPUs] at their speeds
            steps = _grouped_steps(model, ge, placed, q, A * W * w, dep.expert_cap, host, key) * s_exp
            sizes.append(W)
            steps_of.append(steps)
            works.append(steps.sum(axis=0))
            # expected_max is never below its largest lower end (the same operations: a lower bound to the bit).
            floors.append(float(np.sum((steps * (1 - variance.jitter)).max(axis=1))))
            waits.append(math.nan)
            m = np.array(sizes)
            ok = np.flatnonzero(W % m == 0)  # groups of equal size (W a doubling: every smaller doubling)
            m = m[ok]
            per_gpu = (W // m)[:, None] * np.array(works)[ok]  # [sizes, GPUs]: W / m groups' steps
            experts = per_gpu.max(axis=1)
            link = W * link_1
            rest = np.maximum(W * attn_busy * s_attn, np.maximum(experts, link)[:, None])  # [sizes, A]
            # Each rank's group's critical path but its wait: per block its m attention steps one after another
            # (and m heads), one wave's transfers each way (the earlier waves' rows move while the later waves'
            # attention runs); the wait is the grouped step over the m waves of every rank.
            base = moves + m[:, None] * attn_busy * s_attn  # [sizes, A]
            best = _best_group(W * w, base, rest, ok, floors, waits, steps_of, variance.jitter)
            paths = base[best] + waits[ok[best]]
            itls = np.maximum(paths, rest[best])
            group, experts, per_gpu = int(m[best]), float(experts[best]), per_gpu[best]
            path = float(paths.max())
            concurrency = A * W * w
            tps = float(np.sum(W * w / itls))
            itl = concurrency / tps
            worst = float(itls.max())  # the slowest rank's bottleneck names the point
            side = {
                path: "critical path",
                W * attn_busy * slowest: "attention",
                experts: "experts",
                link: "link",
            }[worst]
            points.append(
                Prediction(
                    tokens_per_s=tps, itl_s=itl, concurrency=concurrency, bottleneck=side,
                    attention_tokens_per_s=float(np.sum(w / (attn_busy * s_own))),
                    expert_tokens_per_s=concurrency / experts,
                    expert_skew=float(per_gpu.max() / per_gpu.mean()),
                    extra={"waves": W, "wave_rows": w, "group_waves": group, "critical_path_s": path,
                           "link_s": link},
                )
            )  # fmt: skip
            if W * attn_busy * slowest >= max(path, experts, link):
                break  # attention-bound on every rank: more waves only lengthen ITL
    # Under an ITL objective only the points that meet it (none: the best, which the planner then drops).
    points = [p for p in points if itl_slo_s is None or p.itl_s <= itl_slo_s] or points
    most = max(p.tokens_per_s for p in points)
    return min((p for p in points if p.tokens_per_s >= 0.97 * most), key=lambda p: (p.concurrency, p.itl_s))


def wave_group(extra: dict, attn_cap: int) -> int:
    """The runtime's `scheduler.wave_group` for an AEP bound (its `extra`): the bound's group is m waves of w rows
    of every rank, the runtime's waves have `attn_cap` rows (docs/engine.md "The waves rule" item 1), so a group is
    m · w / attn_cap of them (at least one)."""
    m, w = int(extra.get("group_waves", 1)), int(extra.get("wave_rows", attn_cap))
    return max(1, m * w // attn_cap)


def _best_group(rows, base, rest, ok, floors: list, waits: list, steps_of: list, jitter: float) -> int:
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


# _grouped_steps' answers, keyed by everything they depend on: the planner asks the same (placement, rows) for every
# attention cap and split that shares it (a 256-GPU DeepSeek-V3 pool has 8,000 AEP candidates, issue 35).
_STEPS_CACHE: dict = {}
_STEPS_CACHE_MAX = 8192


def steps_key(model, gpu, placed, q, cap: int, host) -> int:
    """`_grouped_steps`' cache key but its rows: hashing the model, host and placement was half of AEP's bound's
    time at 256 GPUs, so a caller asking for many row counts computes it once (64 bits, as q's hash already was)."""
    return hash((model, gpu.name, tuple(map(tuple, placed)), q.shape, hash(q.tobytes()), cap, host))


def _grouped_steps(
    model, gpu, placed, q, rows_in: float, cap: int, host, key: int | None = None
) -> np.ndarray:
    """[blocks, expert GPUs]: each expert GPU's grouped step(s) over its experts' share of `rows_in` rows of a
    block (an expert over the cap takes several steps): cost_model.grouped_expert_time for every (block, GPU) at
    once (the planner asks this for every candidate and wave count). `key`: `steps_key` of the other arguments."""
    key = (steps_key(model, gpu, placed, q, cap, host) if key is None else key, rows_in)
    if key not in _STEPS_CACHE:
        if len(_STEPS_CACHE) >= _STEPS_CACHE_MAX:
            _STEPS_CACHE.clear()
        _STEPS_CACHE[key] = _grouped_steps_uncached(model, gpu, placed, q, rows_in, cap, host)
    return _STEPS_CACHE[key]


def _grouped_steps_uncached(model, gpu, placed, q, rows_in: float, cap: int, host) -> np.ndarray:
    num_ids = q.shape[1]
    where = np.zeros((num_ids, len(placed)))
    for g, experts in enumerate(placed):
        where[experts, g] = 1.0
    gpu_of = where.argmax(axis=1)
    inter = np.array([model.intermediate_of(e) for e in range(num_ids)], dtype=float)
    rows = rows_in * q  # [blocks, ids]
    # Each GPU's most loaded expert per block, by a segmented max over the experts sorted by GPU (a [blocks, ids,
    # GPUs] product was most of the planner's time at 256 GPUs, issue 35); GPUs without experts take 0.
    order = np.argsort(gpu_of, kind="stable")
    firsts = np.searchsorted(gpu_of[order], np.arange(len(placed)))
    hosting = np.bincount(gpu_of, minlength=len(placed)) > 0
    most = np.zeros((rows.shape[0], len(placed)))
    if hosting.any():
        most[:, hosting] = np.maximum.reduceat(rows[:, order], firsts[hosting], axis=1)
    steps = np.maximum(1.0, np.ceil(most / cap))  # [blocks, GPUs]
    per_step = rows / steps[:, gpu_of]
    busy = per_step > 0
    r = np.where(busy, np.maximum(1.0, np.round(per_step)), 0.0)  # whole rows, as grouped_expert_time rounds
    h, bp, ba = model.hidden_size, model.bytes_per_param, model.bytes_per_activation
    weights = np.where(busy, h * inter * bp, 0.0)  # read once per step by each expert with rows
    gate_up_f, gate_up_b = (4 * r * h * inter) @ where, (2 * weights + r * (h + 2 * inter) * ba) @ where
    act_b = (r * 3 * inter * ba) @ where
    down_f, down_b = (2 * r * inter * h) @ where, (weights + r * (inter + h) * ba) @ where
    # FP8 GEMMs (issue 35); a speed-up of 1.0 leaves BF16 profiles as they were.
    flops = gpu.usable_flops * model.gemm_speedup
    gpu_s = (
        np.maximum(gate_up_f / flops, gate_up_b / gpu.usable_bandwidth)
        + act_b / gpu.usable_bandwidth
        + np.maximum(down_f / flops, down_b / gpu.usable_bandwidth)
    )
    any_busy = (busy.astype(float) @ where) > 0
    fixed = np.where(any_busy, cm.EXPERT_KERNELS * gpu.launch_s + host.expert_step_s, 0.0)
    return steps * (gpu_s + fixed + (per_step @ where) * host.expert_row_s)


# Expert ids a block past which a bound's steps are costed all at once (`_block_steps`): the frontier profiles
# (DeepSeek-V3's 257, Qwen3's 128), where one grouped_expert_time per (block, GPU) was most of `amoe plan`'s time
# on 256 GPUs (2.7 M calls for ping-pong's splits alone).
VECTORISED_MIN_EXPERTS = 65


def _block_steps(model, gpu, placed, q, rows_in: float, host, vectorised: bool = False) -> np.ndarray:
    """[blocks, GPUs]: each GPU's grouped step over its experts' share of `rows_in` rows of each block, with no cap.
    Vectorised (`_grouped_steps`, cached) for frontier profiles or when asked: grouped_expert_time's formula in
    another summation order, within 2 ulp of it (4.4e-16 relative, measured on DeepSeek-V3 and Mixtral tables);
    else one grouped_expert_time per (block, GPU), the same numbers to the last bit as before."""
    if vectorised or q.shape[1] >= VECTORISED_MIN_EXPERTS:
        return _grouped_steps(model, gpu, placed, q, rows_in, 1 << 30, host)
    return np.array([
        [cm.grouped_expert_time(model, gpu, [rows_in * q[blk, e] for e in es], host, es) for es in placed]
        for blk in range(model.num_blocks)
    ])  # fmt: skip


def _pingpong(model, dep, q, ga, ge, placed, b, ctx, host, variance=SOURCED) -> Prediction:
    """Eq. 5's shape; with step-time variance each lock-step waits for the expected slowest attention GPU (its
    micro-batch) and the expected slowest expert GPU. Each block's two transfers take the slower end
    (`PoolLinks`), and the iteration is at least the busiest NIC's time for its m micro-batches' rows of every
    block ("link", extra["link_s"]; issue 35)."""
    m = max(1, dep.micro_batches)
    micro = max(1, b // m)
    s_attn = variance.speeds(0, dep.num_attn)
    s_exp = variance.speeds(dep.num_attn, len(placed))
    t_attn = expected_max(cm.decode_attention_time(model, ga, micro, ctx, host) * s_attn, variance.jitter)
    rows_in = dep.num_attn * micro  # one micro-batch of every attention GPU reaches the experts together
    # Each block's two transfers on both ends' links: a micro-batch's row copies leave (and come back to) each
    # attention GPU, the busiest expert GPU receives (and returns) its share of every attention GPU's (issue 35).
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
    table = _block_steps(model, ge, placed, q, rows_in, host, vectorised=len(placed) > 16)
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


def _ep(
    model: ModelProfile,
    dep: Deployment,
    q: np.ndarray,
    mean_context: float,
    host: HostOverhead,
    variance: StepVariance = SOURCED,
) -> Prediction:
    """EP's bound; with step-time variance each block's two barriers (the dispatch after attention, the combine
    after the experts) wait for the expected slowest device, and each iteration's head for the slowest too."""
    gpu, n = gpu_profile(dep.attn_gpu), dep.num_attn
    local = dep.experts_on(model.num_expert_ids)
    heaviest = max(cm.expert_rank_weight_bytes(model, es) for es in local)
    if dep.redundant_experts:
        slots = math.ceil((model.num_expert_ids + dep.redundant_experts) / n)
        heaviest = cm.expert_rank_weight_bytes(model, [0] * slots)
    weights = cm.attention_rank_weight_bytes(model) + heaviest
    b = _attention_batch(model, gpu, dep.attn_cap, weights, mean_context)
    if b < 1:
        return MEMORY
    if dep.redundant_experts or dep.two_batch_overlap:
        return _ep_at_scale(model, dep, q, gpu, b, mean_context, host)
    ctx = int(round(mean_context))
    a2a = all_to_all_time(model, gpu, b, n, dep.gpus_per_node, model.dispatch_bytes) + all_to_all_time(
        model, gpu, b, n, dep.gpus_per_node
    )
    speeds, jitter = variance.speeds(0, n), variance.jitter
    attn_1 = cm.decode_attention_time(model, gpu, b, ctx, host)
    attn = expected_max(attn_1 * speeds, jitter)
    tokens = n * b
    head = expected_max(cm.head_time(model, gpu, b, host=host) * speeds, jitter)
    iteration, stall, skew = head, 0.0, []
    stall += attn - attn_1 * float(speeds.mean())  # per block: the dispatch waits for the slowest attention
    stall *= model.num_blocks
    pn = ep_block.ep_pipelines_for(dep.ep_pipelines, model, gpu, n, tokens, host, q) if dep.pipelined else 1
    table = _block_steps(model, gpu, local, q, tokens, host)
    slowests = expected_max(table * speeds, jitter)  # [blocks]: every block's barrier in one call
    for blk in range(model.num_blocks):
        per_device = table[blk]
        slowest = float(slowests[blk])
        stall += slowest - float((per_device * speeds).mean())
        skew.append(float(per_device.max() / per_device.mean()))
        if dep.pipelined:  # the all-to-alls and experts as PN chunks (the barrier stall as computed above)
            rows = [[tokens * q[blk, e] for e in es] for es in local]
            iteration += attn + ep_block.ep_block_moe_time(
                model, gpu, host, rows, local, b, pn, dep.ep_kernel
            )
            continue
        iteration += attn + a2a + slowest
    tps = tokens / iteration
    return Prediction(
        tokens_per_s=tps, itl_s=iteration, concurrency=tokens, bottleneck="barrier",
        expert_skew=float(np.mean(skew)),
        extra={"all_to_all_s_per_block": a2a, "barrier_stall_fraction": stall / iteration, "ep_pipelines": pn},
    )  # fmt: skip


def ep_placements(model: ModelProfile, dep: Deployment, q: np.ndarray) -> list[list[list[tuple[int, float]]]]:
    """Per block, per device, its (expert id, share) copies: EPLB's per-layer placement with redundant experts,
    else the deployment's own placement (each expert whole on one device)."""
    from amoe.perf.model.ep_scale import eplb_placement

    if dep.redundant_experts:
        return [
            eplb_placement(q[blk], dep.num_attn, dep.redundant_experts) for blk in range(model.num_blocks)
        ]
    local = [[(e, 1.0) for e in es] for es in dep.experts_on(model.num_expert_ids)]
    return [local] * model.num_blocks


def ep_exchange_time(model: ModelProfile, gpu: GpuProfile, rows: float, dep: Deployment) -> float:
    """An EP block's dispatch (model.dispatch_bytes per element: FP8 where the model serves it) and combine."""
    n, per_node = dep.num_attn, dep.gpus_per_node
    return all_to_all_time(model, gpu, rows, n, per_node, model.dispatch_bytes) + all_to_all_time(
        model, gpu, rows, n, per_node
    )


def _ep_at_scale(model, dep, q, gpu, b, mean_context, host) -> Prediction:
    """EP with EPLB and/or two-batch overlap (amoe.emulation.ep_at_scale): per block the slowest device of the
    expected loads, with the exchange overlapped by the other micro-batch's compute when TBO is on."""
    from amoe.perf.model import ep_scale as scale

    ctx, n = int(round(mean_context)), dep.num_attn
    rows = b / 2 if dep.two_batch_overlap else b  # one micro-batch's rows per device
    attn = cm.decode_attention_time(model, gpu, max(1, round(rows)), ctx, host)
    exchange = ep_exchange_time(model, gpu, rows, dep)
    iteration, stall, skew = cm.head_time(model, gpu, b, host=host), 0.0, []
    for blk, placement in enumerate(ep_placements(model, dep, q)):
        slowest, mean = scale.slowest_device(
            model, gpu, scale.device_rows(placement, n * rows * q[blk]), host
        )
        stall += slowest - mean
        skew.append(slowest / mean)
        iteration += scale.block_time(attn, slowest, exchange, dep.two_batch_overlap)
    tokens = n * b
    return Prediction(
        tokens_per_s=tokens / iteration, itl_s=iteration, concurrency=tokens, bottleneck="barrier",
        expert_skew=float(np.mean(skew)),
        extra={"exchange_s_per_block": exchange, "barrier_stall_fraction": stall / iteration},
    )  # fmt: skip
