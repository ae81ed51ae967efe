"""The expert GEMMs' kernel curves (EPS-MoE, arXiv 2410.12247; docs/eps.md "Kernel curves"): expert
GEMM efficiency per kernel (grouped or dense) as a function of tokens per expert m, and each GPU's curves.

A GEMM phase of an expert layer costs max(FLOPs / (peak · eff(m)), bytes / HBM) — the roofline with a compute
efficiency that depends on the kernel and the load: dense (one cuBLAS GEMM per expert) eff(m) = a · m / (m + h);
grouped (one cutlass grouped GEMM over a device's experts) the same with its own (a, h), times 1 / (1 + m / s):
grouped GEMMs fall behind on large per-expert problems (the paper's Fig. 5a). The grouped kernel (cutlass: one
compiled tile, a persistent scheduler) also pays wave quantisation: its 128 x 128 output tiles over all its experts
run in whole waves over the SMs it has, so a chunk of one or two experts, or a GEMM capped at 116 SMs, may leave
SMs idle in its last wave; cuBLAS picks its tile per shape, so dense GEMMs do not. On the h800 the constants are
fitted to the PN 1 rows of the paper's Table II (`eps_paper.fit_table2`); a GPU without a curve keeps the roofline
at its profile's compute efficiency for both kernels (what the cost model priced before), and a curve measured on a
GPU at hand replaces it (`CURVES`).

The pipeline these kernels run in is amoe.perf.model.eps; the paper's tables and the fits to them live in
amoe.perf.studies.eps_paper. Times in seconds of GPU time; pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from amoe.perf.model.cost_model import EXPERT_KERNELS
from amoe.perf.model.gpus import GpuProfile

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
    # The GPU profile's HBM fraction and launch gap the curves were fitted with (None: the GPU's calibrated
    # ones): a fit keeps pricing with what it was fitted against (`fitted`).
    memory_efficiency: float | None = None
    launch_s: float | None = None

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


def fitted(gpu: GpuProfile, curves: EpsCurves) -> GpuProfile:
    """`gpu` as `curves` were fitted against it: its HBM fraction and launch gap those of the fit."""
    change = {}
    if curves.memory_efficiency is not None:
        change["memory_efficiency"] = curves.memory_efficiency
    if curves.launch_s is not None:
        change["launch_s"] = curves.launch_s
    return replace(gpu, **change) if change else gpu


def best_kernel(
    gpu: GpuProfile, curves: EpsCurves, rows: Sequence[float], hidden: int, inter: int, sms: int | None = None
) -> str:
    """The load-aware choice: the kernel the curves predict faster for these tokens per expert (grouped on a tie)."""
    gpu = fitted(gpu, curves)
    times = {k: experts_time(gpu, curves.curve(k), k, rows, hidden, inter, sms=sms) for k in KERNELS}
    return min(KERNELS, key=lambda k: (times[k], k != "grouped"))


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
        # What the fit priced the H800 with (the profile before the 2026-11-29 kernel calibration): HBM at 0.85
        # of its peak, 4 µs a kernel launch (amoe's runtime, no CUDA graphs).
        memory_efficiency=0.85,
        launch_s=4e-6,
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
