"""EP's bound (amoe.perf.plan.bounds' docstring): a barrier per block, the all-to-alls, the slowest device's grouped
GEMM; with EPS-MoE's expert pipeline, and as deployed at scale (EPLB's redundant experts, two-batch overlap)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from amoe.perf.model import cost_model as cm
from amoe.perf.model import ep_block, ep_scale
from amoe.perf.model.gpus import GpuProfile, gpu_profile
from amoe.perf.model.hosts import HostOverhead
from amoe.perf.model.links import all_to_all_time
from amoe.perf.model.models import ModelProfile
from amoe.perf.model.variance import SOURCED, StepVariance, expected_max
from amoe.perf.plan.deployment import Deployment
from amoe.perf.plan.expert_steps import block_steps
from amoe.perf.plan.prediction import MEMORY, Prediction


def ep_bound(
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
    b = cm.attention_batch(model, gpu, dep.attn_cap, weights, mean_context)
    if b < 1:
        return MEMORY
    if dep.redundant_experts or dep.two_batch_overlap:
        return _ep_at_scale(model, dep, q, gpu, b, mean_context, host)
    ctx = int(round(mean_context))
    a2a = ep_exchange_time(model, gpu, b, dep)
    speeds, jitter = variance.speeds(0, n), variance.jitter
    attn_1 = cm.decode_attention_time(model, gpu, b, ctx, host)
    attn = expected_max(attn_1 * speeds, jitter)
    tokens = n * b
    head = expected_max(cm.head_time(model, gpu, b, host=host) * speeds, jitter)
    iteration, stall, skew = head, 0.0, []
    stall += attn - attn_1 * float(speeds.mean())  # per block: the dispatch waits for the slowest attention
    stall *= model.num_blocks
    pn = ep_block.ep_pipelines_for(dep.ep_pipelines, model, gpu, n, tokens, host, q) if dep.pipelined else 1
    table = block_steps(model, gpu, local, q, tokens, host)
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
    return sum(ep_exchange_parts(model, gpu, rows, dep))


def ep_exchange_parts(
    model: ModelProfile, gpu: GpuProfile, rows: float, dep: Deployment
) -> tuple[float, float]:
    """(dispatch, combine) of an EP block of `rows` rows per device (links.all_to_all_time)."""
    n, per_node = dep.num_attn, dep.gpus_per_node
    return (
        all_to_all_time(model, gpu, rows, n, per_node, "dispatch"),
        all_to_all_time(model, gpu, rows, n, per_node, "combine"),
    )


def ep_micro_batch(
    model: ModelProfile,
    gpu: GpuProfile,
    rows: float,
    ctx: int,
    dep: Deployment,
    host: HostOverhead,
    queries: int = 1,
) -> ep_scale.MicroBatch:
    """One micro-batch's attention stages and exchange (its experts 0: the caller's slowest device) for `rows` rows
    per device, `queries` rows a request (1 + an MTP draft's tokens), each with `ctx` tokens of KV."""
    requests = max(1, round(rows / queries))
    parts = cm.attention_parts(model, gpu, np.full(requests, queries), np.full(requests, ctx), host)
    stage_in, stage_out = ep_scale.attention_stages(parts)
    dispatch, combine = ep_exchange_parts(model, gpu, requests * queries, dep)
    return ep_scale.MicroBatch(stage_in, stage_out, 0.0, dispatch, combine)


def _ep_at_scale(
    model: ModelProfile, dep: Deployment, q: np.ndarray, gpu: GpuProfile, b: int, mean_context: float,
    host: HostOverhead,
) -> Prediction:  # fmt: skip
    """EP with EPLB and/or two-batch overlap (amoe.perf.model.ep_scale): per block the slowest device of the
    expected loads, with the exchange hidden behind the other micro-batch's stages when TBO is on."""
    ctx, n, queries = int(round(mean_context)), dep.num_attn, 1 + dep.draft_tokens
    rows = b * queries / (2 if dep.two_batch_overlap else 1)  # one micro-batch's rows per device
    mb = ep_micro_batch(model, gpu, max(queries, round(rows)), ctx, dep, host, queries)
    blocks, stall, skew = 0.0, 0.0, []
    for blk, placement in enumerate(ep_placements(model, dep, q)):
        slowest, mean = ep_scale.slowest_device(
            model, gpu, ep_scale.device_rows(placement, n * rows * q[blk]), host
        )
        stall += slowest - mean
        skew.append(slowest / mean)
        blocks += ep_scale.block_time(replace(mb, experts=slowest), dep.two_batch_overlap)
    # the MTP module: one more layer a draft token (the blocks' mean layer)
    iteration = blocks * (1 + dep.draft_tokens / model.layers) + cm.head_time(
        model, gpu, b * queries, host=host
    )
    tokens = n * b * dep.tokens_per_request_step
    return Prediction(
        tokens_per_s=tokens / iteration, itl_s=iteration / dep.tokens_per_request_step, concurrency=n * b,
        bottleneck="barrier", expert_skew=float(np.mean(skew)),
        extra={"exchange_s_per_block": mb.dispatch + mb.combine, "barrier_stall_fraction": stall / iteration},
    )  # fmt: skip
