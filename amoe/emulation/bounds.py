"""What a deployment can do at best on emulated GPUs: decode throughput and inter-token latency of AEP, EP and
ping-pong, from the cost model's step times (docs/emulation.md "Bounds"; `amoe plan` searches over these).

Every bound is at the profile's full depth (a truncated `NAME:N` profile is a benchmark device, not a model), with
the expected load of each expert taken from the exact probability that it is among a token's top-k picks
(`routing.inclusion_probabilities`), per block:

* **AEP**: each attention GPU runs every block on its batch b (KV and the batch cap permitting); expert GPU g
  serves its experts of every block asynchronously, so what limits it is its *total* work per token,
  Σ_blocks Σ_{e on g} q[blk, e] · (step time / rows at that expert's batch). The hottest GPU, not the mean,
  sets the expert side's rate: with skew it carries more than its share.
* **EP**: every device runs attention on b rows, then a dispatch all-to-all, one grouped GEMM over its local
  experts (one host step, not one per expert), a combine all-to-all, and waits at the barrier for the slowest
  device, block after block.
* **Ping-pong** (MegaScale-Infer): attention and expert pools as AEP, each attention batch split into m
  micro-batches that alternate between the pools block by block; a block takes the slower pool's m steps plus the
  two transfers that the alternation cannot hide.

ITL follows from Little's law: concurrency / throughput (each of the C requests decoding at once gets one token per
C / T seconds).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from amoe.emulation import cost_model as cm
from amoe.emulation.profiles import GpuProfile, HostOverhead, ModelProfile, gpu_profile
from amoe.emulation.routing import RouterOverride, RoutingSpec, inclusion_probabilities

# ---- the EP exchange's latency (docs/emulation.md "EP's all-to-all", with sources)

# Assumed, within the "tens of µs" for an NCCL all-to-all of small messages among the 8 GPUs of an NVLink
# node: a fixed cost per collective on top of its bytes at NVLink speed.
A2A_FIXED_NVLINK_S = 20e-6
# DeepEP (github.com/deepseek-ai/DeepEP README, "Low-latency kernels with pure RDMA": H800, one CX7 400 Gb/s NIC
# (~50 GB/s) per GPU, 128 tokens, hidden 7168, top-8, FP8 dispatch / BF16 combine): dispatch 77 / 118 / 155 / 173 /
# 192 / 194 µs at EP 8 / 16 / 32 / 64 / 128 / 256, i.e. 98 / 63 / 48 / 43 / 39 / 39 GB/s per GPU. Across hosts
# an all-to-all therefore reaches this fraction of the NIC's bandwidth at each EP size (EP 8 beats the NIC: its
# peers share a node), and its fixed cost is small against the bytes at that size.
DEEPEP_RDMA_GBPS = {8: 98, 16: 63, 32: 48, 64: 43, 128: 39, 256: 39}
DEEPEP_NIC_GBPS = 50.0
# Assumed: the fixed part of a cross-host all-to-all (NCCL or DeepEP's normal kernels: one RDMA round trip plus the
# kernel), what remains of DeepEP's latencies once their bytes are paid.
A2A_FIXED_NETWORK_S = 30e-6


def all_to_all_time(
    model: ModelProfile, gpu: GpuProfile, rows: float, devices: int, gpus_per_node: int
) -> float:
    """One dispatch (or combine) all-to-all of an EP step: every device sends `rows` × top-k hidden rows spread
    evenly over the `devices` (its own share stays). Peers on its node go over NVLink, the others over the NIC at
    DeepEP's measured fraction of it; the slower of the two paths sets the time."""
    if devices <= 1 or rows <= 0:
        return 0.0
    per_peer = rows * model.experts_per_token * model.hidden_size * model.bytes_per_activation / devices
    node = devices if gpus_per_node <= 0 else min(gpus_per_node, devices)
    local = per_peer * (node - 1) / gpu.nvlink.usable_bandwidth
    if node == devices:
        return A2A_FIXED_NVLINK_S + local
    remote_fraction = _deepep_fraction(devices)
    remote = per_peer * (devices - node) / (gpu.network.bandwidth * remote_fraction)
    return A2A_FIXED_NETWORK_S + max(local, remote)


def _deepep_fraction(devices: int) -> float:
    sizes = sorted(DEEPEP_RDMA_GBPS)
    size = next((s for s in sizes if s >= devices), sizes[-1])
    return min(1.0, DEEPEP_RDMA_GBPS[size] / DEEPEP_NIC_GBPS)


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
    bottleneck: str  # attention | experts | barrier | memory
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


def routing_inclusion(model: ModelProfile, routing: str, seed: int = 0) -> np.ndarray:
    """q [blocks, expert ids]: each expert's probability of being among a token's top-k, per block, under the
    routing override `routing` (seeded as the emulated runtimes seed it), and 1 for the shared expert. Request
    affinity does not change it."""
    spec = RoutingSpec.parse(routing)
    if not spec.is_override:
        spec = RoutingSpec("uniform")
    router = RouterOverride(spec, model.num_experts, model.top_k, model.num_blocks, seed)
    q = inclusion_probabilities(router.popularity, model.top_k)
    return np.concatenate([q, np.ones((model.num_blocks, model.num_shared_experts))], axis=1)


def predict(
    model: ModelProfile, dep: Deployment, inclusion: np.ndarray, mean_context: float, host: HostOverhead
) -> Prediction:
    """The bound of `dep` (module docstring) for a model at full depth and per-block inclusion probabilities.
    Replicas multiply throughput and concurrency; ITL is one copy's."""
    one = replace(dep, replicas=1)
    pred = (
        _ep(model, one, inclusion, mean_context, host)
        if dep.mode == "ep"
        else _disaggregated(model, one, inclusion, mean_context, host)
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
    model: ModelProfile, dep: Deployment, q: np.ndarray, mean_context: float, host: HostOverhead
) -> Prediction:
    ga, ge = gpu_profile(dep.attn_gpu), gpu_profile(dep.expert_gpu)
    placed = dep.experts_on(model.num_expert_ids)
    b = _attention_batch(model, ga, dep.attn_cap, cm.attention_rank_weight_bytes(model), mean_context)
    heaviest = max(cm.expert_rank_weight_bytes(model, experts) for experts in placed)
    if b < 1 or heaviest > ge.memory * ge.memory_utilization:
        return MEMORY
    ctx = int(round(mean_context))
    if dep.mode == "pingpong":
        return _pingpong(model, dep, q, ga, ge, placed, b, ctx, host)
    # An AEP attention GPU holds as many requests as its KV cache does, spread over its blocks; the cap bounds the
    # rows of one step, and the experts batch what all of those requests bring them. The operating point is the
    # least concurrency within 3 % of the most the deployment can do: more only lengthens ITL (Little's law).
    kv_requests = int(
        cm.kv_capacity_tokens(ga, model, cm.attention_rank_weight_bytes(model)) // max(mean_context, 1)
    )
    points = [
        _aep_at(model, dep, q, ga, ge, placed, b, ctx, host, c)
        for c in _doublings(dep.num_attn * b, dep.num_attn * max(b, kv_requests))
    ]
    most = max(p.tokens_per_s for p in points)
    return next(p for p in points if p.tokens_per_s >= 0.97 * most)


def _doublings(start: int, stop: int):
    c = start
    while c < stop:
        yield c
        c *= 2
    yield stop


def _aep_at(model, dep, q, ga, ge, placed, b, ctx, host, concurrency) -> Prediction:
    """AEP with `concurrency` requests decoding, attention steps of `b` rows."""
    blocks = model.num_blocks
    iteration = blocks * cm.decode_attention_time(model, ga, b, ctx, host) + cm.head_time(
        model, ga, b, host=host
    )
    attn_tps = dep.num_attn * b / iteration
    # Expert seconds per token through the system, per expert GPU: every block's experts on it, each at the batch
    # its arrivals allow (concurrency · q rows wait for it at most, the cap at most).
    load = np.zeros(len(placed))
    for g, experts in enumerate(placed):
        for blk in range(blocks):
            for e in experts:
                rows = round(max(1.0, min(dep.expert_cap, concurrency * q[blk, e])))
                load[g] += q[blk, e] * _expert_row_s(model, ge, rows, host, e >= model.num_experts)
    expert_tps = 1.0 / load.max()
    tps = min(attn_tps, expert_tps)
    return Prediction(
        tokens_per_s=tps, itl_s=concurrency / tps, concurrency=concurrency,
        bottleneck="attention" if attn_tps <= expert_tps else "experts", attention_tokens_per_s=attn_tps,
        expert_tokens_per_s=expert_tps, expert_skew=float(load.max() / load.mean()),
    )  # fmt: skip


@functools.lru_cache(maxsize=1 << 16)
def _expert_row_s(model: ModelProfile, gpu: GpuProfile, rows: int, host: HostOverhead, shared: bool) -> float:
    """Seconds per row of a (routed or shared) expert step of `rows` rows (cached: the planner asks for the same
    few thousand)."""
    return cm.expert_layer_time(model, gpu, rows, host, model.num_experts if shared else 0) / rows


def _pingpong(model, dep, q, ga, ge, placed, b, ctx, host) -> Prediction:
    m = max(1, dep.micro_batches)
    micro = max(1, b // m)
    t_attn = cm.decode_attention_time(model, ga, micro, ctx, host)
    rows_in = dep.num_attn * micro  # one micro-batch of every attention GPU reaches the experts together
    link = ga.nvlink if dep.num_attn + dep.num_expert <= dep.gpus_per_node else ga.network
    t_move = cm.transfer_time(cm.hidden_bytes(model, micro * model.experts_per_token), link)
    block_s, skew = 0.0, []
    for blk in range(model.num_blocks):
        per_gpu = [
            cm.grouped_expert_time(model, ge, [rows_in * q[blk, e] for e in es], host, es) for es in placed
        ]
        t_exp = max(per_gpu)
        skew.append(t_exp / (sum(per_gpu) / len(per_gpu)))
        block_s += max(m * t_attn, m * t_exp, t_attn + t_exp) + 2 * t_move
    iteration = block_s + cm.head_time(model, ga, b, host=host)
    concurrency = dep.num_attn * micro * m
    tps = concurrency / iteration
    attn_bound = m * t_attn * model.num_blocks
    return Prediction(
        tokens_per_s=tps, itl_s=iteration, concurrency=concurrency,
        bottleneck="attention" if attn_bound >= block_s - 2 * t_move * model.num_blocks - 1e-12 else "experts",
        expert_skew=float(np.mean(skew)),
    )  # fmt: skip


def _ep(
    model: ModelProfile, dep: Deployment, q: np.ndarray, mean_context: float, host: HostOverhead
) -> Prediction:
    gpu, n = gpu_profile(dep.attn_gpu), dep.num_attn
    local = dep.experts_on(model.num_expert_ids)
    heaviest = max(cm.expert_rank_weight_bytes(model, es) for es in local)
    weights = cm.attention_rank_weight_bytes(model) + heaviest
    b = _attention_batch(model, gpu, dep.attn_cap, weights, mean_context)
    if b < 1:
        return MEMORY
    ctx = int(round(mean_context))
    a2a = 2 * all_to_all_time(model, gpu, b, n, dep.gpus_per_node)
    attn = cm.decode_attention_time(model, gpu, b, ctx, host)
    tokens = n * b
    iteration, stall, skew = cm.head_time(model, gpu, b, host=host), 0.0, []
    for blk in range(model.num_blocks):
        per_device = [
            cm.grouped_expert_time(model, gpu, [tokens * q[blk, e] for e in es], host, es) for es in local
        ]
        slowest = max(per_device)
        stall += slowest - sum(per_device) / len(per_device)
        skew.append(slowest / (sum(per_device) / len(per_device)))
        iteration += attn + a2a + slowest
    tps = tokens / iteration
    return Prediction(
        tokens_per_s=tps, itl_s=iteration, concurrency=tokens, bottleneck="barrier",
        expert_skew=float(np.mean(skew)),
        extra={"all_to_all_s_per_block": a2a, "barrier_stall_fraction": stall / iteration},
    )  # fmt: skip
