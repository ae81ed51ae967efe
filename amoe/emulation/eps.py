"""EPS-MoE's cost model (arXiv 2410.12247; docs/emulation.md "The expert pipeline"): expert GEMM efficiency per
kernel (grouped or dense) as a function of tokens per expert m, the all-to-all of an EP layer, and the time of a
layer whose experts run as PN chunks (Algorithm 1) with communication overlapping compute.

* **Kernel curves.** A GEMM phase of an expert layer costs max(FLOPs / (peak · eff(m)), bytes / HBM) — the
  roofline with a compute efficiency that depends on the kernel and the load: dense (one cuBLAS GEMM per expert)
  eff(m) = a · m / (m + h); grouped (one cutlass grouped GEMM over a device's experts) the same with its own (a, h),
  times 1 / (1 + m / s): grouped GEMMs fall behind on large per-expert problems (the paper's Fig. 5a). The grouped
  kernel (cutlass: one compiled tile, a persistent scheduler) also pays wave quantisation: its 128 x 128 output
  tiles over all its experts run in whole waves over the SMs it has, so a chunk of one or two experts, or a GEMM
  capped at 116 SMs, may leave SMs idle in its last wave; cuBLAS picks its tile per shape, so dense GEMMs do not.
  On the h800 the constants are fitted to the PN 1 rows of the paper's Table II (`eps_paper.fit_table2`); a GPU
  without a curve keeps the roofline at its profile's compute efficiency for both kernels (what the cost model
  priced before), and a curve measured on a GPU at hand replaces it (`CURVES`).
* **The pipeline.** Chunk p carries the tokens of the p-th group of every device's local experts: its dispatch and
  combine all-to-all move 1/PN of the bytes and each pays the collective's fixed cost (the per-chunk overhead
  k N + b of the paper's §IV-D, k = 2 · the fixed cost + the chunk's kernel launches); the compute stream runs
  chunk p's experts once its dispatch is in; the communication stream runs the all-to-alls in Algorithm 1's issue
  order. While an all-to-all runs beside a GEMM that holds every SM, both run 1 / (1 + I) as fast (§IV-E: the
  collective is scheduled late, the GEMM loses SMs); I is fitted to Table IV's 132 / 116 SM ratios alone
  (`eps_paper.fit_interference`); capping the GEMM's SMs (the paper's 116 of 132) removes it. The per-layer b
  fitted to the PN 1 rows is communication's fixed overhead (§V-A) and rides the collectives, so a pipeline hides
  part of it.

The paper's tables and the fits to them live in amoe.emulation.eps_paper.

Times in seconds of GPU time; pure functions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from amoe.emulation.cost_model import EXPERT_KERNELS
from amoe.emulation.profiles import GpuProfile, ModelProfile

KERNELS = ("grouped", "dense")
# FP8 communication (Table II's footnote 2: "the communication datatype is FP8", so dispatch and combine alike):
# one byte per element plus a float32 scale per 128 (DeepSeek-V3's block scales) of BF16's two; the cast is taken
# as fused into the collective (as DeepEP's is), not priced as a kernel of its own.
FP8_BYTES = (1 + 4 / 128) / 2
# The fixed cost of one collective: bounds.A2A_FIXED_NVLINK_S, the project's assumed NCCL all-to-all latency in an
# NVLink node. Table II's PN 1 rows cannot tell it from the per-layer b (both are paid once there), so it is not
# fitted.
A2A_FIXED_S = 20e-6

# The paper's §IV-E: a communication kernel is given 16 of the H800's 132 SMs (GEMMs capped at 116). When the
# GEMM is not capped the collective takes its SMs anyway: the GEMM runs on 116 of 132 while the two overlap.
COMM_SMS, GPU_SMS = 16, 132
# Without a fit (GPUs other than the h800): the SMs the collective takes, as a slowdown of both streams (13.8 %).
INTERFERENCE = COMM_SMS / (GPU_SMS - COMM_SMS)


# A GEMM's output tile (rows x columns), the unit a CTA computes and the GPU schedules in waves over its SMs: 128 x
# 128, the common BF16 tile of Hopper's warpgroup MMA kernels (cutlass's SM90 grouped GEMMs, cuBLAS at these
# sizes). An assumption: the paper names neither kernel's tile.
TILE_M, TILE_N = 128, 128


def wave_utilisation(tiles: int, sms: int) -> float:
    """The fraction of `sms` SMs busy over a kernel of `tiles` output tiles: tiles run in ceil(tiles / sms) waves,
    the last one partly empty (1 with sms 0: not modelled)."""
    if sms <= 0 or tiles <= 0:
        return 1.0
    return tiles / (math.ceil(tiles / sms) * sms)


@dataclass(frozen=True)
class KernelCurve:
    """Fraction of the GPU's peak FLOP/s an expert GEMM reaches with m tokens per expert on full waves:
    peak_fraction · m / (m + half_m) / (1 + m / fall_m) (fall_m 0: no fall); `sms` > 0: times the wave
    utilisation of its 128 x 128 tiles over that many SMs (one kernel per expert for dense GEMMs, one over every
    expert of the call for a grouped one, whose persistent scheduler deals all groups' tiles to the SMs)."""

    peak_fraction: float
    half_m: float
    fall_m: float = 0.0
    sms: int = 0

    def efficiency(self, m: float) -> float:
        if m <= 0:
            return self.peak_fraction
        eff = self.peak_fraction * m / (m + self.half_m)
        return eff / (1.0 + m / self.fall_m) if self.fall_m > 0 else eff


@dataclass(frozen=True)
class EpsCurves:
    """One GPU's kernel curves and EP all-to-all: fixed cost per collective, the bandwidth it reaches per GPU, and
    the bytes FP8 communication keeps (a fraction of BF16's)."""

    gpu: str
    grouped: KernelCurve
    dense: KernelCurve
    a2a_fixed_s: float
    a2a_bandwidth: float  # bytes/s a device's all-to-all moves
    # b: the layer's fixed communication overhead (the paper's §V-A "fixed overhead in communication", R(N) =
    # kN + b of §IV-D). It rides the communication stream, half with the dispatch and half with the combine,
    # each chunk's collectives carrying their share of the bytes; Table II's PN 1 rows pay it whole and serially.
    layer_fixed_s: float = 0.0
    fp8_bytes: float = FP8_BYTES
    source: str = ""
    # Two-sided slowdown while a collective overlaps a GEMM on every SM (pipeline_time);
    # `eps_paper.fit_interference`.
    interference: float = INTERFERENCE

    def curve(self, kernel: str) -> KernelCurve:
        return self.grouped if kernel == "grouped" else self.dense


# ---- expert GEMMs


def _phases(h: int, inter: int, rows: float, bp: int, ba: int) -> list[tuple[float, float]]:
    """(FLOPs, bytes) of gate_up GEMM, SiLU·mul and down GEMM of one SwiGLU expert (cost_model._swiglu_phases)."""
    return [
        (2 * rows * h * 2 * inter, 2 * h * inter * bp + rows * (h + 2 * inter) * ba),
        (0.0, rows * 3 * inter * ba),
        (2 * rows * inter * h, inter * h * bp + rows * (inter + h) * ba),
    ]


def _tiles(h: int, inter: int, rows: float) -> tuple[int, int, int]:
    """Output tiles of the three phases for one expert: gate_up [rows, 2 inter], none, down [rows, h]."""
    m = math.ceil(rows / TILE_M)
    return (m * math.ceil(2 * inter / TILE_N), 0, m * math.ceil(h / TILE_N))


def experts_time(
    gpu: GpuProfile,
    curve: KernelCurve | None,
    kernel: str,
    rows: Sequence[float],
    hidden: int,
    inter: int,
    bytes_per_param: int = 2,
    bytes_per_activation: int = 2,
    sms: int | None = None,
) -> float:
    """A device's experts on `rows` tokens each, as one grouped GEMM sequence or one GEMM sequence per expert.
    Without a curve: the roofline at the profile's compute efficiency (cost_model.grouped_expert_time's GPU part).
    `sms`: the SMs the GEMMs run on (a cap below the curve's; None: the curve's own)."""
    busy = [r for r in rows if r > 0]
    if not busy:
        return 0.0
    bp, ba = bytes_per_param, bytes_per_activation
    waves_over = (sms or curve.sms) if curve is not None else 0

    def rate(m: float, tiles: int) -> float:
        if curve is None:
            return gpu.usable_flops
        return gpu.peak_flops * curve.efficiency(m) * wave_utilisation(tiles, waves_over)

    if kernel == "dense":
        total = 0.0
        for r in busy:
            phases = zip(_phases(hidden, inter, r, bp, ba), _tiles(hidden, inter, r))
            total += sum(max(f / rate(r, n), b / gpu.usable_bandwidth) for (f, b), n in phases)
            total += EXPERT_KERNELS * gpu.launch_s
        return total
    phases = np.zeros((3, 2))
    tiles = [0, 0, 0]
    for r in busy:
        phases += np.asarray(_phases(hidden, inter, r, bp, ba))
        tiles = [a + b for a, b in zip(tiles, _tiles(hidden, inter, r))]
    m = sum(busy) / len(busy)
    gemm = sum(max(f / rate(m, n), b / gpu.usable_bandwidth) for (f, b), n in zip(phases, tiles))
    return float(gemm + EXPERT_KERNELS * gpu.launch_s)


def best_kernel(
    gpu: GpuProfile, curves: EpsCurves, rows: Sequence[float], hidden: int, inter: int, sms: int | None = None
) -> str:
    """The load-aware choice: the kernel the curves predict faster for these tokens per expert (grouped on a tie)."""
    times = {k: experts_time(gpu, curves.curve(k), k, rows, hidden, inter, sms=sms) for k in KERNELS}
    return min(KERNELS, key=lambda k: (times[k], k != "grouped"))


# ---- the pipeline (Algorithm 1 on two streams)


@dataclass(frozen=True)
class Chunk:
    """One pipeline chunk's dispatch, expert compute and combine, in seconds (compute on every SM)."""

    dispatch_s: float
    compute_s: float
    combine_s: float


def pipeline_time(
    chunks: Sequence[Chunk],
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
) -> list[Chunk]:
    """The PN chunks of an EP layer: chunk p's experts are the p-th group of the local ones (split as evenly as
    whole experts allow), its all-to-alls carry the copies bound for them. kernel "auto": per chunk. `fp8`: both
    all-to-alls move FP8 (Table II's footnote 2: "the communication datatype"); `sms`: the GEMMs' SM cap."""
    sizes = [len(g) for g in np.array_split(np.arange(layer.local_experts), pipelines)]
    chunks = []
    for size in sizes:
        frac = size / layer.local_experts
        rows = [layer.rows_per_expert] * size
        k = best_kernel(gpu, curves, rows, layer.hidden, layer.inter, sms) if kernel == "auto" else kernel
        compute = experts_time(gpu, curves.curve(k), k, rows, layer.hidden, layer.inter, sms=sms)
        fixed = curves.layer_fixed_s * frac / 2
        a2a = a2a_time(curves, layer, frac, fp8) + fixed
        chunks.append(Chunk(a2a, compute, a2a))
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
    launches = EXPERT_KERNELS * gpu.launch_s
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


# Per GPU: the curves the cost model uses (h800: `eps_paper.fit_table2`'s result, rounded; regenerate with
# `amoe bench eps --fit`). A GPU missing here has no curve: both kernels cost the roofline.
CURVES: dict[str, EpsCurves] = {
    "h800": EpsCurves(
        gpu="h800",
        grouped=KernelCurve(peak_fraction=0.722, half_m=0.0, fall_m=4260.0, sms=GPU_SMS),
        dense=KernelCurve(peak_fraction=0.650, half_m=0.0),
        a2a_fixed_s=A2A_FIXED_S,
        a2a_bandwidth=165e9,
        layer_fixed_s=588e-6,
        source="fitted to Table II's PN 1 rows (EPS-MoE, 4 x H800): amoe bench eps --fit; interference to Table IV",
        interference=0.231,  # fit_interference: Table IV's 132 / 116 SM ratios, nothing else
    ),
}


def curves_for(gpu: GpuProfile) -> EpsCurves:
    """The GPU's curves; without a fitted or measured one, both kernels at the profile's compute efficiency (the
    roofline the cost model prices everywhere else) and the all-to-all at NVLink's usable bandwidth."""
    if gpu.name in CURVES:
        return CURVES[gpu.name]
    flat = KernelCurve(gpu.compute_efficiency, 0.0)
    return EpsCurves(gpu.name, flat, flat, A2A_FIXED_S, gpu.nvlink.usable_bandwidth, source="roofline")


def with_curves(gpu: str, curves: EpsCurves) -> EpsCurves:
    """`curves` for another GPU name (a curve measured on a GPU at hand, registered in CURVES)."""
    return replace(curves, gpu=gpu)


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


# ---- the runtime's `auto` (amoe.runtime.sync.eps.ExpertPipeline)

# The CPU one device of amoe's EP runtime spends on one more pipeline chunk of a block: the split of its copies,
# one message per peer each way, the expert step's bookkeeping, the gather — a fixed part and a part per token the
# device brings (the split scans every copy once per chunk). Measured with bench/eps_chunk_cost.py (8 devices in one
# process, CPU time; 2026-11-26 on this project's 2-core host): 146 µs per chunk at 1,024 tokens per device, 326 µs
# at 4,096. Unlike the GPU's holds it is real time, which the emulated runtime's clock divides by the time scale.
CHUNK_HOST_CPU_S = 86e-6
CHUNK_HOST_CPU_PER_TOKEN_S = 59e-9


def chunk_host_s(tokens_per_device: float, contention: float = 1.0, time_scale: float = 1.0) -> float:
    """Seconds (of the runtime's clock) one more chunk costs a device's host: CHUNK_HOST_CPU_S and its per-token part,
    times `contention` (how many devices' host work shares one core: devices over cores, at least 1), over the
    emulated clock's `time_scale` (1 for real GPUs)."""
    cpu = CHUNK_HOST_CPU_S + CHUNK_HOST_CPU_PER_TOKEN_S * tokens_per_device
    return cpu * max(1.0, contention) / time_scale


# Blocks of a routing's inclusion `auto` prices for every PN (evenly spaced, first and last included): the hot
# experts differ from block to block, and the choice must not cost what the bound of every fixed PN costs.
CHOOSER_BLOCKS = 8
# The PNs whose price on those blocks is within this fraction of the best are priced again on every distinct block
# and the choice made there: 8 of 48 skewed blocks misjudge a close call by a few % (Qwen3-30B-A3B on 8 h800s,
# skew-exp:0.4, cap 1,024: PN 1 picked, PN 2 best by 2.5 %), and a close call is cheap to settle (a few PNs).
CHOOSER_REFINE = 0.05


def pipeline_chooser(
    model: ModelProfile,
    gpu: GpuProfile,
    devices: int,
    max_pipelines: int,
    host=None,
    chunk_host=None,
    inclusion=None,
):
    """total rows of an iteration over all devices → the PN with which an EP block (ep_block_moe_time, the bounds'
    and the simulation's model, with the host's step per chunk) is fastest; memoised, an iteration's rows repeat.
    `inclusion` (q [blocks, expert ids], bounds.routing_inclusion): the routing's rows per expert, priced on
    CHOOSER_BLOCKS of its distinct blocks for every PN, then on all of them for the PNs within CHOOSER_REFINE of
    the best, experts placed e mod devices as EP places them — a skewed routing makes each chunk wait for its own
    slowest device, which uniform rows hide; None: uniform routing over the routed experts.
    `chunk_host(tokens per device)`: the runtime's own host seconds per chunk (`chunk_host_s`), paid in series
    with the block; None: none (the bounds' choice). PNs whose floor (their collectives' fixed costs, their host
    steps, their chunks' host cost) is above the close calls' margin are not priced: the same choice, in a few ms
    of CPU per new total instead of ~60 (every device's process asks it)."""
    from amoe.emulation.cost_model import NO_HOST

    host = host or NO_HOST
    if inclusion is None:
        ids = model.num_experts
        q = np.full((1, ids), model.top_k / model.num_experts)
    else:
        q = np.asarray(inclusion, dtype=float)
        ids = q.shape[1]
    sampled = q[np.unique(np.linspace(0, len(q) - 1, min(len(q), CHOOSER_BLOCKS)).round().astype(int))]
    distinct, counts = np.unique(q, axis=0, return_counts=True)  # uniform routing: one block
    experts = tuple(tuple(e for e in range(ids) if e % devices == d) for d in range(devices))
    fewest = min((len(es) for es in experts if es), default=1)
    # No block with n chunks is faster than its communication stream's 2 n collectives (each pays the fixed cost)
    # or, when every expert gets rows, its compute stream's n host steps: PNs above that bound are not priced.
    curves = curves_for(gpu)
    step_s = host.expert_step_s if bool((q > 0).all()) else 0.0

    def floor(n: int, per_chunk: float) -> float:
        m = min(n, fewest)  # the block caps its chunks at the fewest hosted experts
        return max(2 * m * curves.a2a_fixed_s, m * step_s) + n * per_chunk

    @functools.lru_cache(maxsize=4096)
    def choose(total_rows: int) -> int:
        total = max(1, total_rows)
        tokens = total / devices
        per_chunk = chunk_host(tokens) if chunk_host is not None else 0.0

        def block_rows(shares: np.ndarray) -> list[tuple]:
            return [tuple(tuple(float(total * s[e]) for e in es) for es in experts) for s in shares]

        def mean_block(n: int, rows: list[tuple], weights) -> float:
            t = sum(
                w * _ep_block_moe_time(model, gpu, host, r, experts, float(tokens), n, "auto")
                for r, w in zip(rows, weights)
            )
            return t / sum(weights) + n * per_chunk

        rows = block_rows(sampled)
        times: dict[int, float] = {}
        for n in range(1, max_pipelines + 1):
            # floor(n) grows with n: once it is above the close calls' margin, no larger PN is picked or refined
            if times and floor(n, per_chunk) > min(times.values()) * (1 + CHOOSER_REFINE):
                break
            times[n] = mean_block(n, rows, [1] * len(sampled))
        best = min(times.values())
        close = [n for n in times if times[n] <= best * (1 + CHOOSER_REFINE)]
        if len(close) > 1 and len(distinct) > len(sampled):  # a close call: settle it on every distinct block
            every = block_rows(distinct)
            times = {n: mean_block(n, every, counts) for n in close}
        return min(times, key=lambda n: (times[n], n))

    return choose


def kernel_chooser(model: ModelProfile, gpu: GpuProfile):
    """rows per expert of a chunk → grouped or dense, whichever the curves price lower."""
    curves = curves_for(gpu)

    def choose(rows: Sequence[int]) -> str:
        return best_kernel(gpu, curves, rows, model.hidden_size, model.expert_intermediate)

    return choose


# ---- an EP block of the bounds and the simulation (bounds._ep, simulate._simulate_ep)


def ep_block_moe_time(
    model: ModelProfile,
    gpu: GpuProfile,
    host,
    rows: Sequence[Sequence[float]],
    experts: Sequence[Sequence[int]],
    tokens_per_device: float,
    pipelines: int,
    kernel: str,
) -> float:
    """Dispatch, experts and combine of one EP block, pipelined: device d's local experts experts[d] have rows[d]
    tokens each; each of the PN chunks (the p-th group of every device's experts, as amoe.runtime.sync.eps splits
    them) waits at its combine for the slowest device's compute, and pays one host step per device. kernel
    "auto": per chunk and device, by load; "": the grouped step. The fitted per-layer b of Table II (the fixed
    overhead of the paper's collectives) is left out: the all-to-all's fixed cost per collective prices amoe's.
    Memoised: the bounds ask for the same block at every layer under uniform routing and for every PN searched."""
    return _ep_block_moe_time(
        model, gpu, host, tuple(tuple(float(r) for r in rs) for rs in rows), tuple(tuple(es) for es in experts),
        float(tokens_per_device), int(pipelines), kernel,
    )  # fmt: skip


@functools.lru_cache(maxsize=1 << 16)
def _ep_block_moe_time(model, gpu, host, rows, experts, tokens_per_device, pipelines, kernel) -> float:
    curves = curves_for(gpu)
    devices = len(experts)
    pn = max(1, min(pipelines, min((len(es) for es in experts if es), default=1)))
    layer = EpLayer(
        model.hidden_size, model.expert_intermediate, devices, 1, model.experts_per_token, tokens_per_device, 0.0,
        model.bytes_per_activation,
    )  # fmt: skip
    chunks = []
    seen: dict[tuple, float] = {}  # this block's distinct chunks (hashing the profiles per lookup costs more)
    for p in range(pn):
        slowest, sent = 0.0, 0.0
        for es, rs in zip(experts, rows):
            if not es:  # a device without experts (more devices than experts): attention only
                continue
            group = _chunk_members(len(es), pn)[p]
            work = tuple((es[i] >= model.num_experts, model.intermediate_of(es[i]), rs[i]) for i in group)
            if work not in seen:
                seen[work] = _chunk_compute(model, gpu, host, work, kernel)
            slowest = max(slowest, seen[work])
            sent += len(group) / len(es) / devices
        a2a = a2a_time(curves, layer, sent)
        chunks.append(Chunk(a2a, slowest, a2a))
    return pipeline_time(chunks, overlap=pn > 1, interference=curves.interference)


@functools.lru_cache(maxsize=1024)
def _chunk_members(hosted: int, pipelines: int) -> tuple[tuple[int, ...], ...]:
    """The positions among a device's `hosted` experts that each of the PN chunks holds (as
    amoe.runtime.sync.eps.expert_groups cuts them)."""
    return tuple(tuple(i for i in range(hosted) if i * pipelines // hosted == p) for p in range(pipelines))


# Memoised apart from the block: the devices of a uniform routing, and the chunks of equal size, carry the same
# experts' rows, so a block prices a handful of distinct chunks (the runtime's `auto` prices every PN of every new
# row total an iteration brings: 60 ms of CPU each without this, 8 devices' processes on 2 cores).
@functools.lru_cache(maxsize=1 << 16)
def _chunk_compute(model, gpu, host, work: tuple[tuple[bool, int, float], ...], kernel: str) -> float:
    """One device's compute for one chunk: `work` (shared?, SwiGLU width, rows) of each expert in it, its kernel
    ("auto": by load, per width; "": the grouped step, shared experts in it) and one host step. With a kernel a
    shared expert is a GEMM of its own (dense), as the runtime runs it (EmulatedExpertExecutor.run_experts)."""
    curves = curves_for(gpu)
    t = 0.0
    by_gemm: dict[tuple[bool, int], list[float]] = {}
    for shared, inter, r in work:
        by_gemm.setdefault((shared and bool(kernel), inter), []).append(r)
    for (alone, inter), r in by_gemm.items():
        k = "dense" if alone else kernel or "grouped"
        if k == "auto":
            k = best_kernel(gpu, curves, r, model.hidden_size, inter)
        t += experts_time(gpu, curves.curve(k), k, r, model.hidden_size, inter)
    busy = sum(r for _, _, r in work)
    if busy:
        t += host.expert_step_s + busy * host.expert_row_s
    return t


def ep_pipelines_for(
    fixed: int, model: ModelProfile, gpu: GpuProfile, devices: int, tokens: int, host=None, inclusion=None
) -> int:
    """A deployment's PN: its own `fixed` one, or (0, auto) what the runtime's `auto` picks for `tokens` rows in all
    under the routing's `inclusion` (None: uniform)."""
    if fixed:
        return fixed
    most = model.num_expert_ids // devices
    return pipeline_chooser(model, gpu, devices, max(1, most), host, inclusion=inclusion)(int(tokens))
