"""EPS-MoE's expert pipeline (arXiv 2410.12247; docs/eps.md "The cost model"): the all-to-all of an EP
layer, and the time of a layer whose experts run as PN chunks (Algorithm 1) with communication overlapping compute.

Chunk p carries the tokens of the p-th group of every device's local experts: its dispatch and combine all-to-all
move 1/PN of the bytes and each pays the collective's fixed cost (the per-chunk overhead k N + b of the paper's
§IV-D, k = 2 · the fixed cost + the chunk's kernel launches); the compute stream runs chunk p's experts once its
dispatch is in; the communication stream runs the all-to-alls in Algorithm 1's issue order. While an all-to-all
runs beside a GEMM that holds every SM, both run 1 / (1 + I) as fast (§IV-E: the collective is scheduled late, the
GEMM loses SMs); I is fitted to Table IV's 132 / 116 SM ratios alone (`eps_paper.fit_interference`); capping the
GEMM's SMs (the paper's 116 of 132) removes it. The per-layer b fitted to the PN 1 rows is communication's fixed
overhead (§V-A) and rides the collectives, so a pipeline hides part of it.

The experts' GEMMs are priced by the kernel curves (amoe.perf.model.kernels); an EP block as the bounds, the
simulation and the runtime's `auto` price it is amoe.perf.model.ep_block; the paper's tables and the fits to them
live in amoe.perf.studies.eps_paper.

Times in seconds of GPU time; pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from amoe.perf.model.cost_model import EXPERT_KERNELS
from amoe.perf.model.gpus import GpuProfile
from amoe.perf.model.kernels import (
    COMM_SMS,
    GPU_SMS,
    INTERFERENCE,
    EpsCurves,
    best_kernel,
    experts_time,
    fitted,
)
from amoe.perf.model.models import ModelProfile

# ---- the pipeline (Algorithm 1 on two streams)


@dataclass(frozen=True)
class PipelineChunk:
    """One pipeline chunk's dispatch, expert compute and combine, in seconds (compute on every SM)."""

    dispatch_s: float
    compute_s: float
    combine_s: float


def pipeline_time(
    chunks: Sequence[PipelineChunk],
    overlap: bool = True,
    interference: float = INTERFERENCE,
    before_s: float = 0.0,
    after_s: float = 0.0,
) -> float:
    """The layer's time from its first dispatch to its last combine. Without overlap the chunks run one after
    another. With it, two streams: the communication stream runs dispatch(0), then per p = 1..PN dispatch(p),
    combine(p − 2), then the last combines (Algorithm 1's issue order), a combine waiting for its chunk's compute;
    the compute stream runs `before_s` (the shared experts, beside dispatch(0)), compute(p) once dispatch(p) is in,
    then `after_s` (the local reduction, beside the last combine). While both streams are busy each runs
    1 / (1 + `interference`) as fast: the paper's §IV-E — a GEMM holding every SM delays the collective's
    scheduling, and the collective's SMs slow the GEMM."""
    if not overlap:
        return before_s + sum(c.dispatch_s + c.compute_s + c.combine_s for c in chunks) + after_s
    n = len(chunks)
    # (work, the op of the other stream it waits for; -1: none). Compute op 0 is before_s, op p + 1 chunk p's.
    comm: list[tuple[float, int]] = [(chunks[0].dispatch_s, -1)]
    for p in range(1, n + 1):
        if p < n:
            comm.append((chunks[p].dispatch_s, -1))
        if p >= 2:
            comm.append((chunks[p - 2].combine_s, p - 1))
    comm.append((chunks[n - 1].combine_s, n))
    dispatch_op = [i for i, (_, dep) in enumerate(comm) if dep == -1]  # comm op of dispatch(p)
    compute: list[tuple[float, int]] = [(before_s, -1)]  # (work, the comm op it waits for)
    compute += [(c.compute_s, dispatch_op[p]) for p, c in enumerate(chunks)]
    compute.append((after_s, -1))
    return _two_streams(comm, compute, interference)


def _two_streams(comm: list[tuple[float, int]], compute: list[tuple[float, int]], interference: float):
    """When the last op of two in-order streams ends: op (work, dep) starts when the stream's previous op and op
    `dep` of the other stream (-1: none) are done, and runs at rate 1 / (1 + interference) while the other stream
    runs an op too (1 otherwise)."""
    streams = (comm, compute)
    done: tuple[list[float], list[float]] = ([], [])  # end time of each finished op, per stream
    left = [comm[0][0] if comm else 0.0, compute[0][0] if compute else 0.0]
    t = 0.0
    while len(done[0]) < len(comm) or len(done[1]) < len(compute):
        active = []
        for s in (0, 1):
            i = len(done[s])
            if i == len(streams[s]):
                continue
            dep = streams[s][i][1]
            if dep < 0 or len(done[1 - s]) > dep:
                active.append(s)
        if not active:
            # a combine waiting on a compute that waits on it: a bug in the issue order, not an input
            raise RuntimeError("pipeline schedule deadlocked")
        rate = 1.0 / (1.0 + interference) if len(active) == 2 else 1.0
        step = min(left[s] / rate for s in active)
        t += step
        for s in active:
            left[s] -= step * rate
            if left[s] <= 1e-15:
                done[s].append(t)
                i = len(done[s])
                left[s] = streams[s][i][0] if i < len(streams[s]) else 0.0
    return max(done[0][-1] if done[0] else 0.0, done[1][-1] if done[1] else 0.0)


# ---- an EP MoE layer: all-to-all sizes and the chunks of a pipeline


@dataclass(frozen=True)
class EpLayer:
    """An EP MoE layer on one device: its tokens, where they go, the experts it computes."""

    hidden: int
    inter: int
    devices: int
    local_experts: int
    top_k: int
    tokens: float  # the tokens this device brings (each sent to top_k experts)
    rows_per_expert: float  # the tokens each local expert computes (from every device)
    bytes_per_activation: int = 2


def a2a_time(curves: EpsCurves, layer: EpLayer, fraction: float, fp8: bool = False) -> float:
    """One all-to-all of `fraction` of the layer's copies: the fixed cost plus the bytes that leave the device."""
    remote = layer.tokens * layer.top_k * fraction * (layer.devices - 1) / layer.devices
    num_bytes = remote * layer.hidden * layer.bytes_per_activation * (curves.fp8_bytes if fp8 else 1.0)
    return curves.a2a_fixed_s + num_bytes / curves.a2a_bandwidth


def layer_chunks(
    gpu: GpuProfile, curves: EpsCurves, layer: EpLayer, pipelines: int, kernel: str, fp8=False, sms=None
) -> list[PipelineChunk]:
    """The PN chunks of an EP layer: chunk p's experts are the p-th group of the local ones (split as evenly as
    whole experts allow), its all-to-alls carry the copies bound for them. kernel "auto": per chunk. `fp8`: both
    all-to-alls move FP8 (Table II's footnote 2: "the communication datatype"); `sms`: the GEMMs' SM cap."""
    gpu = fitted(gpu, curves)
    sizes = [len(g) for g in np.array_split(np.arange(layer.local_experts), pipelines)]
    chunks = []
    for size in sizes:
        frac = size / layer.local_experts
        rows = [layer.rows_per_expert] * size
        k = best_kernel(gpu, curves, rows, layer.hidden, layer.inter, sms) if kernel == "auto" else kernel
        compute = experts_time(gpu, curves.curve(k), k, rows, layer.hidden, layer.inter, sms=sms)
        fixed = curves.layer_fixed_s * frac / 2
        a2a = a2a_time(curves, layer, frac, fp8) + fixed
        chunks.append(PipelineChunk(a2a, compute, a2a))
    return chunks


def layer_time(
    gpu: GpuProfile,
    curves: EpsCurves,
    layer: EpLayer,
    pipelines: int,
    kernel: str,
    overlap: bool,
    fp8: bool = False,
    sms: int | None = None,
    before_s: float = 0.0,
    after_s: float = 0.0,
) -> float:
    """An EP MoE layer with PN chunks; `sms` <= 116: the GEMM capped, so no interference from the collectives (the
    paper's "perfect overlap"; Conclusion 3: a GEMM keeps its speed on fewer SMs)."""
    capped = sms is not None and sms <= GPU_SMS - COMM_SMS
    chunks = layer_chunks(gpu, curves, layer, min(pipelines, layer.local_experts), kernel, fp8, sms)
    interference = 0.0 if capped else curves.interference
    return pipeline_time(chunks, overlap, interference, before_s, after_s)


# ---- the pipeline number: closed form and search


def chunk_overhead(gpu: GpuProfile, curves: EpsCurves, layer: EpLayer, kernel: str) -> float:
    """k of the paper's R(N) = k N + b: what one more chunk costs — two more collectives' fixed cost and one more
    chunk's kernel launches (per expert for dense GEMMs, once for a grouped one)."""
    launches = EXPERT_KERNELS * fitted(gpu, curves).launch_s
    per_chunk = launches if kernel == "grouped" else 0.0  # dense launches per expert whatever the chunking
    return 2 * curves.a2a_fixed_s + per_chunk


def closed_form_pipelines(gpu: GpuProfile, curves: EpsCurves, layer: EpLayer, kernel: str) -> float:
    """The paper's N* = √(C / k), C = min(communication, compute) of the layer without a pipeline."""
    (one,) = layer_chunks(gpu, curves, layer, 1, kernel)
    c = min(one.dispatch_s + one.combine_s, one.compute_s)
    return math.sqrt(c / chunk_overhead(gpu, curves, layer, kernel))


def search_pipelines(
    gpu: GpuProfile, curves: EpsCurves, layer: EpLayer, kernel: str, max_pipelines: int | None = None
) -> tuple[int, float]:
    """(PN, time) minimising the simulated layer over 1..local experts."""
    top = max_pipelines or layer.local_experts
    times = {n: layer_time(gpu, curves, layer, n, kernel, True) for n in range(1, top + 1)}
    best = min(times, key=lambda n: (times[n], n))
    return best, times[best]


def model_layer(model: ModelProfile, devices: int, tokens_per_device: float) -> EpLayer:
    """An EP MoE layer of `model` over `devices` devices, uniform routing, each bringing `tokens_per_device`."""
    local = model.num_experts // devices
    rows = devices * tokens_per_device * model.top_k / model.num_experts
    return EpLayer(
        model.hidden_size,
        model.expert_intermediate,
        devices,
        local,
        model.top_k,
        tokens_per_device,
        rows,
        model.bytes_per_activation,
    )
