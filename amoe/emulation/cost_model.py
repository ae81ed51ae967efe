"""The cost model: how long a layer step, a transfer or a decode iteration takes on an emulated GPU.

Every kernel phase costs max(FLOPs / usable compute, bytes / usable HBM bandwidth) (the roofline); a step adds a
launch gap per kernel and the host overhead of the serving system being emulated. Pure functions of the shapes in
`profiles`; all times in seconds of emulated (GPU) time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from amoe.emulation.profiles import HOSTS, GpuProfile, HostOverhead, LinkProfile, ModelProfile

NO_HOST = HOSTS["none"]

# Kernels per step, counted from the torch layers in amoe/model (one fused MoE expert as in vLLM/SGLang):
# expert: gate_up GEMM, SiLU·mul, down GEMM, scale by top-k weight.
EXPERT_KERNELS = 4
# attention: top-k merge, RMSNorm, QKV GEMM, RoPE, KV write, paged attention, O GEMM, residual add, RMSNorm,
# router GEMM, softmax + top-k, top-k renormalise.
ATTENTION_KERNELS = 12
# head: top-k merge, RMSNorm, lm_head GEMM, sampler (softmax/argmax + gather).
HEAD_KERNELS = 4
# Activation traffic of an attention step's elementwise kernels, in rows of [hidden] (norms, RoPE, adds, merge).
ATTENTION_ELEMENTWISE_PASSES = 8


def roofline(gpu: GpuProfile, flops: float, num_bytes: float) -> float:
    """One kernel phase: bound by compute or by memory traffic, whichever is slower."""
    return max(flops / gpu.usable_flops, num_bytes / gpu.usable_bandwidth)


def expert_layer_time(model: ModelProfile, gpu: GpuProfile, rows: int, host: HostOverhead = NO_HOST) -> float:
    """One expert layer (SwiGLU) on `rows` tokens: weights streamed once, FLOPs linear in rows."""
    if rows <= 0:
        return 0.0
    gpu_s = _swiglu_time(model, gpu, rows, model.expert_intermediate) + EXPERT_KERNELS * gpu.launch_s
    return gpu_s + host.expert_step_s + rows * host.expert_row_s


def attention_layer_time(
    model: ModelProfile,
    gpu: GpuProfile,
    chunk_lens: Sequence[int] | np.ndarray,
    context_lens: Sequence[int] | np.ndarray,
    host: HostOverhead = NO_HOST,
) -> float:
    """One attention layer over R chunks: chunk r has chunk_lens[r] new rows and context_lens[r] tokens after it.

    Decode rows are chunks of 1; a prefill chunk of L rows attends causally (row i sees context - L + 1 + i tokens).
    The layer also runs the router and the model's shared experts (they see every token).
    """
    chunk = np.asarray(chunk_lens, dtype=np.float64)
    ctx = np.asarray(context_lens, dtype=np.float64)
    rows = float(chunk.sum())
    if rows <= 0:
        return 0.0
    ba = model.bytes_per_activation
    h = model.hidden_size
    proj = roofline(
        gpu, 2 * rows * model.attn_params, model.attn_params * model.bytes_per_param + 4 * rows * h * ba
    )
    kv_bytes = float(ctx.sum()) * model.kv_bytes_per_token + rows * model.kv_bytes_per_token  # read + write
    attended = float((chunk * (ctx - (chunk - 1) / 2)).sum())  # context tokens summed over query rows
    core = roofline(gpu, attended * model.attn_flops_per_context_token, kv_bytes)
    elementwise = (ATTENTION_ELEMENTWISE_PASSES + model.top_k) * rows * h * ba / gpu.usable_bandwidth
    shared = _shared_experts_time(model, gpu, int(rows))
    launches = (ATTENTION_KERNELS + (EXPERT_KERNELS if model.num_shared_experts else 0)) * gpu.launch_s
    return proj + core + elementwise + shared + launches + host.attn_step_s + rows * host.attn_row_s


def decode_attention_time(
    model: ModelProfile, gpu: GpuProfile, rows: int, context: int, host: HostOverhead = NO_HOST
) -> float:
    """An attention layer of `rows` decode rows (one per request), each with `context` tokens of KV."""
    return attention_layer_time(model, gpu, np.ones(rows), np.full(rows, context), host)


def head_time(
    model: ModelProfile,
    gpu: GpuProfile,
    num_chunks: int,
    rows: int | None = None,
    host: HostOverhead = NO_HOST,
) -> float:
    """Final merge + norm + lm_head + sampler: logits only for the last row of each of `num_chunks` chunks."""
    if num_chunks <= 0:
        return 0.0
    rows = num_chunks if rows is None else rows
    h, v = model.hidden_size, model.vocab_size
    merge = (model.top_k + 2) * rows * h * model.bytes_per_activation / gpu.usable_bandwidth
    lm_head = roofline(gpu, 2 * num_chunks * h * v, h * v * model.bytes_per_param + 2 * num_chunks * v * 4)
    return merge + lm_head + HEAD_KERNELS * gpu.launch_s + host.head_step_s + num_chunks * host.head_row_s


def transfer_time(num_bytes: float, link: LinkProfile) -> float:
    """One message over a link: its latency plus its bytes at the link's usable bandwidth."""
    if num_bytes <= 0:
        return 0.0
    return link.latency + num_bytes / link.usable_bandwidth


def hidden_bytes(model: ModelProfile, rows: int) -> int:
    """Bytes of `rows` hidden-state rows on the wire (what attention sends to an expert and back)."""
    return rows * model.hidden_size * model.bytes_per_activation


def attention_rank_weight_bytes(model: ModelProfile) -> int:
    """Weights an attention rank holds: every block's attention, router and shared experts, embedding, lm_head."""
    per_block = model.attn_params + model.shared_params + 2 * model.hidden_size  # + two RMSNorm weights
    embed_and_head = 2 * model.vocab_size * model.hidden_size + model.hidden_size
    return (model.num_blocks * per_block + embed_and_head) * model.bytes_per_param


def expert_rank_weight_bytes(model: ModelProfile, num_local_experts: int) -> int:
    """Weights an expert rank holds: `num_local_experts` experts in every block (AMoE §3.3 placement)."""
    return num_local_experts * model.num_blocks * model.expert_params * model.bytes_per_param


def kv_capacity_tokens(gpu: GpuProfile, model: ModelProfile, weight_bytes: float) -> int:
    """Tokens of KV cache (all blocks) that fit beside `weight_bytes` of weights; 0 if the weights don't fit."""
    free = gpu.memory * gpu.memory_utilization - weight_bytes
    return max(0, int(free // (model.kv_bytes_per_token * model.num_blocks)))


def expert_knee_rows(model: ModelProfile, gpu: GpuProfile) -> int:
    """The smallest batch at which an expert layer's GEMMs turn compute-bound (Figure 3's knee)."""
    lo, hi = 1, 1 << 16
    while lo < hi:
        mid = (lo + hi) // 2
        if _swiglu_is_compute_bound(model, gpu, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def mean_decode_context(input_range: tuple[int, int], output_range: tuple[int, int]) -> float:
    """Mean context of a decode row when prompt and output lengths are uniform on the given inclusive ranges.

    A request with output length o contributes o decode rows whose generated part is uniform on [0, o), so a
    random row's context is E[input] + E[o^2] / (2 E[o]) (length-biased sampling).
    """
    inp = np.arange(input_range[0], input_range[1] + 1, dtype=np.float64)
    out = np.arange(output_range[0], output_range[1] + 1, dtype=np.float64)
    return float(inp.mean() + (out**2).mean() / (2 * out.mean()))


@dataclass(frozen=True)
class UpperBound:
    """Decode throughput with every GPU busy at its most efficient batch and KV capacity respected."""

    tokens_per_s: float
    attention_tokens_per_s: float  # if the experts were free
    expert_tokens_per_s: float  # if attention were free (perfectly balanced experts)
    attention_batch: int  # rows per attention step on each attention GPU
    expert_batch: int  # rows per expert step
    kv_tokens_per_gpu: int
    bottleneck: str  # "attention" or "experts"


def upper_bound_throughput(
    model: ModelProfile,
    gpu: GpuProfile,
    *,
    num_attn_gpus: int,
    num_expert_gpus: int,
    mean_context: float,
    host: HostOverhead = NO_HOST,
    max_attn_batch: int = 4096,
    max_expert_batch: int = 4096,
) -> UpperBound:
    """Decode tokens/s no schedule can beat: ignores skew, queueing and transfers (assumed overlapped).

    Attention GPUs hold as many requests as their KV cache fits (up to max_attn_batch) and run every block on
    that whole batch; experts see that concurrency times top-k over the experts as their per-step batch.
    """
    experts_per_gpu = math.ceil(model.num_experts / num_expert_gpus)
    kv_tokens = kv_capacity_tokens(gpu, model, attention_rank_weight_bytes(model))
    attn_batch = min(max_attn_batch, int(kv_tokens // max(mean_context, 1.0)))
    if (
        attn_batch < 1
        or expert_rank_weight_bytes(model, experts_per_gpu) > gpu.memory * gpu.memory_utilization
    ):
        return UpperBound(0.0, 0.0, 0.0, max(attn_batch, 0), 0, kv_tokens, "memory")
    ctx = int(round(mean_context))
    iteration = model.num_blocks * decode_attention_time(model, gpu, attn_batch, ctx, host)
    iteration += head_time(model, gpu, attn_batch, host=host)
    attn_tps = num_attn_gpus * attn_batch / iteration
    concurrency = num_attn_gpus * attn_batch
    expert_batch = max(1, min(max_expert_batch, concurrency * model.top_k // model.num_experts))
    rows_per_s = expert_batch / expert_layer_time(model, gpu, expert_batch, host)
    busy_gpus = min(num_expert_gpus, model.num_experts)  # no replication: extra expert GPUs idle
    expert_tps = busy_gpus * rows_per_s / (model.num_blocks * model.top_k)
    bottleneck = "attention" if attn_tps <= expert_tps else "experts"
    return UpperBound(
        min(attn_tps, expert_tps), attn_tps, expert_tps, attn_batch, expert_batch, kv_tokens, bottleneck
    )


def ep_upper_bound_throughput(
    model: ModelProfile,
    gpu: GpuProfile,
    popularity: np.ndarray,
    *,
    num_devices: int,
    mean_context: float,
    host: HostOverhead = NO_HOST,
    max_batch: int = 4096,
) -> float:
    """Decode tokens/s of barrier-synchronised EP at its best: every device runs a full batch (its KV or
    max_batch), transfers and host time between steps are free, and routing is its expectation (sampling noise
    only adds stalls). Per block each device runs attention on its batch, then the barrier waits for the device
    whose experts (e mod num_devices) got the most rows — num_devices · batch · top_k · popularity[block, e] —
    then the head. popularity [num_blocks, num_experts]: the routing override's per-block expert shares."""
    local = [list(range(d, model.num_experts, num_devices)) for d in range(num_devices)]
    weights = attention_rank_weight_bytes(model) + expert_rank_weight_bytes(model, max(map(len, local)))
    batch = min(max_batch, int(kv_capacity_tokens(gpu, model, weights) // max(mean_context, 1.0)))
    if batch < 1:
        return 0.0
    ctx = int(round(mean_context))
    tokens = num_devices * batch * model.top_k
    iteration = head_time(model, gpu, batch, host=host)
    for shares in popularity:
        slowest = max(
            sum(expert_layer_time(model, gpu, max(1, round(tokens * shares[e])), host) for e in experts)
            for experts in local
            if experts
        )
        iteration += decode_attention_time(model, gpu, batch, ctx, host) + slowest
    return num_devices * batch / iteration


def _swiglu_phases(model: ModelProfile, gpu: GpuProfile, rows: int, inter: int) -> list[tuple[float, float]]:
    """(FLOPs, bytes) of gate_up GEMM, SiLU·mul and down GEMM for one SwiGLU of width `inter`."""
    h, bp, ba = model.hidden_size, model.bytes_per_param, model.bytes_per_activation
    return [
        (2 * rows * h * 2 * inter, 2 * h * inter * bp + rows * (h + 2 * inter) * ba),
        (0.0, rows * 3 * inter * ba),
        (2 * rows * inter * h, inter * h * bp + rows * (inter + h) * ba),
    ]


def _swiglu_time(model: ModelProfile, gpu: GpuProfile, rows: int, inter: int) -> float:
    return sum(roofline(gpu, f, b) for f, b in _swiglu_phases(model, gpu, rows, inter))


def _swiglu_is_compute_bound(model: ModelProfile, gpu: GpuProfile, rows: int) -> bool:
    gate_up = _swiglu_phases(model, gpu, rows, model.expert_intermediate)[0]
    return gate_up[0] / gpu.usable_flops >= gate_up[1] / gpu.usable_bandwidth


def _shared_experts_time(model: ModelProfile, gpu: GpuProfile, rows: int) -> float:
    if not model.num_shared_experts:
        return 0.0
    return _swiglu_time(model, gpu, rows, model.shared_intermediate * model.num_shared_experts)
