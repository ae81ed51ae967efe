"""EP as deployed for prefill (amoe.perf.model.ep_prefill): a device's batch of prompt tokens through the model,
each block's experts on the slowest device of the deployment's placement (EPLB's with redundant experts)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model import ep_prefill as pf
from amoe.perf.model.ep_scale import device_rows
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.models import ModelProfile
from amoe.perf.plan.bound_ep import ep_placements
from amoe.perf.plan.deployment import Deployment


@dataclass(frozen=True)
class PrefillStep:
    """A prefill step's time and its parts (seconds; the parts per layer, both micro-batches)."""

    step_s: float
    tokens_per_gpu: float
    per_layer: dict[str, float]

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_gpu / self.step_s


def prefill_step(
    model: ModelProfile, dep: Deployment, q: np.ndarray, tokens_per_gpu: float, prompt_len: int
) -> PrefillStep:
    """One prefill step of `tokens_per_gpu` prompt tokens per device (prompts of `prompt_len`) on EP `dep`
    (`two_batch_overlap`: two micro-batches of half the tokens), every block's experts on its slowest device."""
    gpu, overlap = gpu_profile(dep.attn_gpu), dep.two_batch_overlap
    halves = 2 if overlap else 1
    tokens = tokens_per_gpu / halves  # one micro-batch's
    share = pf.sm_share(gpu, overlap)
    attn = pf.attention_compute(model, gpu, tokens, prompt_len, share)
    launches = (cm.ATTENTION_KERNELS + cm.EXPERT_KERNELS) * gpu.launch_s
    dispatch, combine = pf.exchange(model, gpu, tokens, dep.num_attn, dep.gpus_per_node, overlap)
    seen: dict[tuple, tuple[float, float]] = {}
    step, experts, acts = 0.0, 0.0, 0.0
    for blk, placement in enumerate(ep_placements(model, dep, q)):
        slowest = (0.0, 0.0)
        for rows, ids in device_rows(placement, dep.num_attn * tokens * q[blk]):
            key = (tuple(np.round(rows, 6)), tuple(ids))
            if key not in seen:
                seen[key] = pf.experts_compute(model, gpu, rows, ids, share)
            slowest = max(slowest, seen[key], key=sum)
        compute = sum(attn.values()) + launches + sum(slowest)
        step += pf.layer_time(compute, dispatch, combine, gpu, overlap)
        experts, acts = experts + slowest[0], acts + slowest[1]
    prompts = tokens_per_gpu / prompt_len
    step += cm.head_time(model, gpu, max(1, round(prompts)))
    per_layer = {
        "gemm": attn["gemm"], "core": attn["core"], "elementwise": attn["elementwise"] + acts / model.num_blocks,
        "experts": experts / model.num_blocks, "launches": launches, "dispatch": dispatch, "combine": combine,
    }  # fmt: skip
    scale = halves * model.num_blocks / model.layers  # both micro-batches, the blocks' time over the layers
    return PrefillStep(step, tokens_per_gpu, {k: v * scale for k, v in per_layer.items()})
