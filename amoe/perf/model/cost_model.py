"""The cost model: how long a layer step, a transfer or a decode iteration takes on an emulated GPU.

Every kernel phase costs max(FLOPs / usable compute, bytes / usable HBM bandwidth) (the roofline), with the
fractions of the datasheet peaks the active calibration measured for the GPU's architecture (GpuProfile.kernels):
a GEMM of M rows reaches compute_fraction · M / (M + half_rows) of its precision's peak, pays a fixed cost per
kernel, and in a serving step runs a measured slowdown times its micro-benchmark; attention's core has its own
fractions; elementwise kernels stream a calibrated number of hidden rows per token. A step adds a launch gap per
kernel and the host overhead of the serving system being emulated. Pure functions of the shapes in `models`; all
times in seconds of emulated (GPU) time.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from amoe.perf.model.gpus import GpuProfile, LinkProfile
from amoe.perf.model.hosts import HOSTS, HostOverhead
from amoe.perf.model.models import ModelProfile

NO_HOST = HOSTS["none"]

# Kernels per step, counted from the torch layers in amoe/model (one fused MoE expert as in vLLM/SGLang):
# expert: gate_up GEMM, SiLU·mul, down GEMM, scale by top-k weight.
EXPERT_KERNELS = 4
# attention: top-k merge, RMSNorm, QKV GEMM, RoPE, KV write, paged attention, O GEMM, residual add, RMSNorm,
# router GEMM, softmax + top-k, top-k renormalise.
ATTENTION_KERNELS = 12
# head: top-k merge, RMSNorm, lm_head GEMM, sampler (softmax/argmax + gather).
HEAD_KERNELS = 4


def roofline(gpu: GpuProfile, flops: float, num_bytes: float) -> float:
    """One kernel phase at the GPU's large-GEMM BF16 compute fraction: bound by compute or by memory traffic."""
    return max(flops / gpu.usable_flops, num_bytes / gpu.usable_bandwidth)


def gemm_rate(gpu: GpuProfile, rows, precision: str):
    """FLOP/s a GEMM of `rows` rows (array or scalar) reaches at `precision`: the precision's peak × the
    calibration's compute fraction × rows / (rows + half_rows)."""
    k = gpu.kernels
    rate = gpu.peak_at(precision) * k.compute_fraction
    if not k.half_rows:
        return rate
    rows = np.maximum(rows, 1.0)
    return rate * rows / (rows + k.half_rows)


def gemm_time(
    gpu: GpuProfile, rows: float, flops: float, num_bytes: float, precision: str, slowdown: float = 1.0,
    sm_share: float = 1.0,
) -> float:  # fmt: skip
    """One GEMM kernel: slowdown · (the calibration's fixed cost + max(FLOPs / rate(rows), bytes / HBM)); with
    `sm_share` < 1 it computes on that share of the SMs (the rest held by exchange kernels beside it)."""
    if flops <= 0 and num_bytes <= 0:
        return 0.0
    compute = flops / (gemm_rate(gpu, rows, precision) * sm_share)
    return slowdown * (gpu.kernels.gemm_fixed_s + max(compute, num_bytes / gpu.usable_bandwidth))


def swiglu_gemms_time(
    gpu: GpuProfile, precision: str, phases, mean_rows, busy, slowdown: float = 1.0, sm_share: float = 1.0
):
    """A SwiGLU's gate_up GEMM, SiLU·mul and down GEMM over (FLOPs, bytes) `phases` (each a scalar or an array, e.g.
    summed over a GPU's experts: one grouped kernel each), at `mean_rows` rows per expert; 0 where not `busy`;
    `sm_share` as gemm_time's."""
    (gu_f, gu_b), (_, act_b), (dn_f, dn_b) = phases
    rate = gemm_rate(gpu, mean_rows, precision) * sm_share
    bw, fixed = gpu.usable_bandwidth, gpu.kernels.gemm_fixed_s
    gemms = 2 * fixed + np.maximum(gu_f / rate, gu_b / bw) + np.maximum(dn_f / rate, dn_b / bw)
    return np.where(busy, slowdown * gemms + act_b / bw, 0.0)


def elementwise_passes(model: ModelProfile, gpu: GpuProfile) -> float:
    """Hidden rows an attention step's elementwise kernels stream per token (norms, RoPE, residual adds, casts,
    the merge of the experts' outputs), as the calibration counts them."""
    k = gpu.kernels
    return k.elementwise_passes + k.elementwise_passes_per_expert * model.experts_per_token


def expert_layer_time(
    model: ModelProfile, gpu: GpuProfile, rows: int, host: HostOverhead = NO_HOST, expert: int = 0
) -> float:
    """One expert layer (SwiGLU) on `rows` tokens: weights streamed once, FLOPs linear in rows. `expert`: its id
    (the shared expert, id num_experts, has its own width)."""
    if rows <= 0:
        return 0.0
    gpu_s = _swiglu_time(model, gpu, rows, model.intermediate_of(expert)) + EXPERT_KERNELS * gpu.launch_s
    return float(gpu_s) + host.expert_step_s + rows * host.expert_row_s


def grouped_expert_time(
    model: ModelProfile,
    gpu: GpuProfile,
    rows_per_expert: Sequence[float],
    host: HostOverhead = NO_HOST,
    experts: Sequence[int] | None = None,
) -> float:
    """A device's local experts in one grouped GEMM (what EP serving systems run): FLOPs and weight bytes of every
    expert with rows, in one kernel sequence and one host step. `experts`: their ids (default: routed ones)."""
    ids = experts if experts is not None else [0] * len(rows_per_expert)
    busy = [(r, e) for r, e in zip(rows_per_expert, ids) if r > 0]
    if not busy:
        return 0.0
    rows = [r for r, _ in busy]
    whole = [max(1, round(r)) for r in rows]
    phases = np.zeros((3, 2))
    for r, (_, e) in zip(whole, busy):
        phases += np.asarray(_swiglu_phases(model, gpu, r, model.intermediate_of(e)))
    slow = gpu.kernels.decode_grouped_slowdown
    gemms = swiglu_gemms_time(gpu, model.expert_precision, phases, sum(whole) / len(whole), True, slow)
    gpu_s = float(gemms) + EXPERT_KERNELS * gpu.launch_s
    return float(gpu_s + host.expert_step_s + sum(rows) * host.expert_row_s)


def attention_layer_time(
    model: ModelProfile,
    gpu: GpuProfile,
    chunk_lens: Sequence[int] | np.ndarray,
    context_lens: Sequence[int] | np.ndarray,
    host: HostOverhead = NO_HOST,
) -> float:
    """One attention layer over R chunks: chunk r has chunk_lens[r] new rows and context_lens[r] tokens after it.

    Decode rows are chunks of 1; a prefill chunk of L rows attends causally (row i sees context - L + 1 + i tokens).
    The layer also runs the router (the shared expert is an expert layer: expert_layer_time).
    """
    return sum(attention_parts(model, gpu, chunk_lens, context_lens, host).values())


def attention_parts(
    model: ModelProfile,
    gpu: GpuProfile,
    chunk_lens: Sequence[int] | np.ndarray,
    context_lens: Sequence[int] | np.ndarray,
    host: HostOverhead = NO_HOST,
) -> dict[str, float]:
    """attention_layer_time's terms: the GEMMs before the core (`gemm_in`: the projections in, and on profiles that
    fold them into the attention step the shared expert and dense MLPs) and after it (`gemm_out`), the core, the
    elementwise kernels, the launch gaps and the host's step. A profile without attn_in_params runs its
    projections as one GEMM, its time split evenly between the two."""
    chunk = np.asarray(chunk_lens, dtype=np.float64)
    ctx = np.asarray(context_lens, dtype=np.float64)
    rows = float(chunk.sum())
    if rows <= 0:
        return dict.fromkeys(ATTENTION_PARTS, 0.0)
    ba, h, k = model.bytes_per_activation, model.hidden_size, gpu.kernels
    bp, prec, slow = model.attn_bytes_per_param, model.attn_precision, k.decode_dense_slowdown

    def proj(params: float, act_rows: int) -> float:
        return gemm_time(gpu, rows, 2 * rows * params, params * bp + act_rows * rows * h * ba, prec, slow)

    if model.attn_in_params is None:
        gemm_in = gemm_out = proj(model.attn_params, 4) / 2
    else:
        gemm_in, gemm_out = proj(model.attn_in, 2), proj(model.attn_params - model.attn_in, 2)
    kv_bytes = float(ctx.sum()) * model.kv_bytes_per_token + rows * model.kv_bytes_per_token  # read + write
    attended = float((chunk * (ctx - (chunk - 1) / 2)).sum())  # context tokens summed over query rows
    core = max(
        attended
        * model.attn_flops_per_context_token
        / (gpu.peak_flops * k.attention_decode_compute_fraction),
        kv_bytes / (gpu.hbm_bandwidth * k.attention_decode_memory_fraction),
    )
    elementwise = elementwise_passes(model, gpu) * rows * h * ba / gpu.usable_bandwidth
    return {
        "gemm_in": gemm_in, "gemm_out": gemm_out, "core": core, "elementwise": elementwise,
        "launches": ATTENTION_KERNELS * gpu.launch_s, "host": host.attn_step_s + rows * host.attn_row_s,
    }  # fmt: skip


ATTENTION_PARTS = ("gemm_in", "gemm_out", "core", "elementwise", "launches", "host")


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
    """Final merge + norm + lm_head + sampler: logits only for the last row of each of `num_chunks` chunks. A
    truncated profile pays its share of it (ModelProfile.head_share), so its iterations keep the model's
    proportions."""
    if num_chunks <= 0:
        return 0.0
    rows = num_chunks if rows is None else rows
    h, v = model.hidden_size, model.vocab_size
    merge = (model.experts_per_token + 2) * rows * h * model.bytes_per_activation / gpu.usable_bandwidth
    lm_head = gemm_time(
        gpu, num_chunks, 2 * num_chunks * h * v, h * v * model.head_bytes + 2 * num_chunks * v * 4, "bf16",
        gpu.kernels.decode_dense_slowdown,
    )  # fmt: skip
    full = merge + lm_head + HEAD_KERNELS * gpu.launch_s + host.head_step_s + num_chunks * host.head_row_s
    return full * model.head_share


def transfer_time(num_bytes: float, link: LinkProfile) -> float:
    """One message over a link: its latency plus its bytes at the link's usable bandwidth."""
    if num_bytes <= 0:
        return 0.0
    return link.latency + num_bytes / link.usable_bandwidth


def hidden_bytes(model: ModelProfile, rows: int) -> int:
    """Bytes of `rows` hidden-state rows on the wire (what attention sends to an expert and back)."""
    return rows * model.hidden_size * model.bytes_per_activation


def attention_rank_weight_bytes(model: ModelProfile) -> float:
    """Weights an attention rank holds: every block's attention and router, embedding, lm_head."""
    per_block = model.attn_params + 2 * model.hidden_size  # + two RMSNorm weights
    embed_and_head = 2 * model.vocab_size * model.hidden_size + model.hidden_size
    return model.num_blocks * per_block * model.attn_bytes_per_param + embed_and_head * model.head_bytes


def expert_rank_weight_bytes(model: ModelProfile, experts: int | Sequence[int]) -> float:
    """Weights an expert rank holds: its experts (ids, or a count of routed ones) in every block (AMoE §3.3)."""
    ids = range(experts) if isinstance(experts, int) else experts
    return sum(model.params_of(e) for e in ids) * model.num_blocks * model.bytes_per_param


def kv_capacity_tokens(gpu: GpuProfile, model: ModelProfile, weight_bytes: float) -> int:
    """Tokens of KV cache (all blocks) that fit beside `weight_bytes` of weights; 0 if the weights don't fit."""
    free = gpu.memory * gpu.memory_utilization - weight_bytes
    return max(0, int(free // (model.kv_bytes_per_token * model.num_blocks)))


def attention_batch(
    model: ModelProfile, gpu: GpuProfile, cap: int, weights: float, mean_context: float
) -> int:
    """Rows an attention GPU batches: its cap, or fewer where its KV cache (beside `weights` bytes) holds fewer
    requests of `mean_context` tokens."""
    kv = kv_capacity_tokens(gpu, model, weights)
    return max(0, min(cap, int(kv // max(mean_context, 1.0))))


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


def _swiglu_phases(model: ModelProfile, gpu: GpuProfile, rows: int, inter: int) -> list[tuple[float, float]]:
    """(FLOPs, bytes) of gate_up GEMM, SiLU·mul and down GEMM for one SwiGLU of width `inter`."""
    h, bp, ba = model.hidden_size, model.bytes_per_param, model.bytes_per_activation
    return [
        (2 * rows * h * 2 * inter, 2 * h * inter * bp + rows * (h + 2 * inter) * ba),
        (0.0, rows * 3 * inter * ba),
        (2 * rows * inter * h, inter * h * bp + rows * (inter + h) * ba),
    ]


def _swiglu_time(model: ModelProfile, gpu: GpuProfile, rows: int, inter: int) -> float:
    """One expert's SwiGLU: an expert kernel like a grouped step's (the grouped GEMMs' measured slowdown)."""
    phases = _swiglu_phases(model, gpu, rows, inter)
    return swiglu_gemms_time(
        gpu, model.expert_precision, phases, rows, True, gpu.kernels.decode_grouped_slowdown
    )


def _swiglu_is_compute_bound(model: ModelProfile, gpu: GpuProfile, rows: int) -> bool:
    flops, num_bytes = _swiglu_phases(model, gpu, rows, model.expert_intermediate)[0]
    return flops / gemm_rate(gpu, rows, model.expert_precision) >= num_bytes / gpu.usable_bandwidth
