"""EP as deployed for prefill: a device's batch of prompt tokens through every layer, with DeepEP's normal kernels
and two-batch overlap as DeepSeek's prefill runs them (github.com/deepseek-ai/profile-data, "Prefilling").

Per layer and micro-batch (half the device's tokens with two-batch overlap, all of them without) the compute
stream runs the attention side's GEMMs (the un-absorbed MLA projections, the shared expert, the dense MLPs'
share), attention's causal core over each prompt, the device's experts as one grouped GEMM per SwiGLU phase over
their rows, and the elementwise kernels; the dispatch and combine move each token once per node its experts lie
on (DeepEP's normal kernels: RDMA, then NVLink forwarding). DeepSeek's schedule overlaps the two micro-batches so
that the compute stream and the communication stream each run back to back: with the overlap a layer takes the
longer of the two streams, without it their sum. Three measured mechanisms, each from DeepSeek's prefill profile
(constants in the calibration): while overlapped, the exchange kernels hold `prefill_comm_sms` of the SMs (the
profile's schedule: 108 compute + 24 communication SMs), so compute-bound kernels run on the rest; they run
`prefill_comm_slowdown` times their unit-test time (DeepEP's table); the compute stream idles
`prefill_stream_bubble` of its busy time. A layer's experts are the slowest device's (EPLB's placement).

Times in seconds of GPU time; pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import GpuProfile
from amoe.perf.model.links import normal_exchange_time
from amoe.perf.model.models import ModelProfile


def sm_share(gpu: GpuProfile, overlap: bool) -> float:
    """The share of the SMs compute kernels have while the exchange kernels overlap them (1 without overlap)."""
    comm = gpu.kernels.prefill_comm_sms
    if not overlap or not gpu.sms or not comm:
        return 1.0
    return (gpu.sms - comm) / gpu.sms


def attention_compute(
    model: ModelProfile, gpu: GpuProfile, tokens: float, prompt_len: int, share: float
) -> dict:
    """One micro-batch's attention side: its GEMMs (in and out of the core) and the causal core over its prompts
    (tokens / prompt_len of them, each attending L (L + 1) / 2 context tokens), at the prefill constants."""
    k, ba, h = gpu.kernels, model.bytes_per_activation, model.hidden_size
    bp, prec, slow = model.attn_bytes_per_param, model.attn_precision, k.prefill_dense_slowdown
    gemm = sum(
        cm.gemm_time(gpu, tokens, 2 * tokens * p, p * bp + 2 * tokens * h * ba, prec, slow, share)
        for p in (model.attn_in, model.attn_params - model.attn_in)
    )
    prompts = tokens / prompt_len
    attended = prompts * prompt_len * (prompt_len + 1) / 2
    rate = gpu.peak_flops * k.attention_prefill_compute_fraction * share
    core = attended * model.prefill_flops_per_context_token / rate
    elementwise = cm.elementwise_passes(model, gpu) * tokens * h * ba / gpu.usable_bandwidth
    return {"gemm": gemm, "core": core, "elementwise": elementwise}


def experts_compute(
    model: ModelProfile, gpu: GpuProfile, rows: Sequence[float], experts: Sequence[int], share: float
) -> tuple[float, float]:
    """(GEMMs, SiLU·mul) of one device's experts, `rows` tokens each (one grouped GEMM per phase, contiguous
    layout), at the prefill constants."""
    busy = [(r, e) for r, e in zip(rows, experts) if r > 0]
    if not busy:
        return 0.0, 0.0
    phases = np.zeros((3, 2))
    for r, e in busy:
        phases += np.asarray(cm._swiglu_phases(model, gpu, r, model.intermediate_of(e)))
    mean_rows = sum(r for r, _ in busy) / len(busy)
    act = phases[1][1] / gpu.usable_bandwidth
    slow = gpu.kernels.prefill_grouped_slowdown
    total = cm.swiglu_gemms_time(gpu, model.expert_precision, phases, mean_rows, True, slow, share)
    return float(total) - act, act


def exchange(
    model: ModelProfile, gpu: GpuProfile, tokens: float, devices: int, gpus_per_node: int, overlap: bool
) -> tuple[float, float]:
    """(dispatch, combine) of one micro-batch by DeepEP's normal kernels, slowed while they overlap compute."""
    slow = gpu.kernels.prefill_comm_slowdown if overlap else 1.0
    return tuple(
        slow * normal_exchange_time(model, gpu, tokens, devices, gpus_per_node, kind)
        for kind in ("dispatch", "combine")
    )


def layer_time(compute: float, dispatch: float, combine: float, gpu: GpuProfile, overlap: bool) -> float:
    """One layer from one micro-batch's compute and exchange: with the overlap the longer of two alike
    micro-batches' compute stream (idling its measured bubble) and communication stream, without it their sum."""
    if not overlap:
        return compute + dispatch + combine
    return max(2 * compute * (1 + gpu.kernels.prefill_stream_bubble), 2 * (dispatch + combine))
