"""GPU and link profiles: the datasheet numbers the cost model uses for a GPU and the links between GPUs, each with
its source, and the calibrated fractions of them real kernels reach, from the active calibration
(amoe.perf.model.calibrations: one dated data file, every constant with its source and derivation).

Units are SI throughout (bytes, seconds, FLOP/s). "Datasheet" numbers are NVIDIA's published peaks (dense, no 2:4
sparsity); "assumed" numbers have no published figure in our sources and are marked so. docs/cost-model.md compares
the cost model's predictions with the AMoE paper (tests/test_emulation.py) and with DeepSeek's published kernels.
Model shapes are in `models`, host overheads in `hosts`.
"""

from __future__ import annotations

from dataclasses import dataclass

from amoe.errors import ConfigError
from amoe.perf.model import calibrations
from amoe.perf.model.calibrations import Calibration, ExchangeConstants, KernelConstants

GB = 1e9  # datasheets quote bandwidth in decimal GB/s
GIB = 2**30  # and memory sizes in binary GiB (nvidia-smi: 40960 MiB on an A100 40GB)
TFLOPS = 1e12
# Bytes per weight of each GEMM precision: BF16; FP8 (E4M3, its 128 x 128 block scales negligible); NVFP4 (4-bit
# E2M1 values with one FP8 E4M3 scale per 16: 4.5 bits; NVIDIA, "Introducing NVFP4 for Efficient and Accurate
# Low-Precision Inference", developer.nvidia.com/blog, 2025-06-24).
PRECISION_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5625}


@dataclass(frozen=True)
class LinkProfile:
    """A point-to-point path between two GPUs: one message costs latency + bytes / (bandwidth · efficiency)."""

    bandwidth: float  # bytes/s, one direction
    latency: float  # s, per message
    efficiency: float  # fraction of `bandwidth` a large NCCL send/recv reaches

    @property
    def usable_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency


@dataclass(frozen=True)
class GpuProfile:
    """One GPU model: datasheet peaks, its links, and the calibrated fractions of them its kernels reach."""

    name: str
    arch: str  # ampere | ada | hopper | blackwell: which calibrated kernel constants apply
    peak_flops: float  # dense BF16/FP16 tensor-core FLOP/s (no 2:4 sparsity)
    hbm_bandwidth: float  # bytes/s
    memory: float  # bytes
    nvlink: LinkProfile  # to another GPU of the same NVLink domain
    network: LinkProfile  # to a GPU of another node (this GPU's share of the node's NICs)
    compute_efficiency: float  # calibrated: fraction of peak_flops a large serving GEMM reaches
    memory_efficiency: float  # calibrated: fraction of hbm_bandwidth a weight-streaming kernel reaches
    launch_s: float  # calibrated: per kernel, the gap a step pays on top of its kernels
    memory_utilization: float  # fraction of memory the serving system may use (weights + KV + buffers)
    kernels: KernelConstants  # the calibration's constants of this architecture
    exchange: ExchangeConstants  # the calibration's EP exchange kernels (DeepEP's tables)
    fp8_flops: float = 0.0  # dense FP8 tensor-core FLOP/s (0: no FP8 tensor cores)
    fp4_flops: float = 0.0  # dense FP4 tensor-core FLOP/s (0: none)
    sms: int = 0  # streaming multiprocessors (0: not used)
    nvlink_domain: int = 8  # GPUs one NVLink (switch) domain joins

    @property
    def usable_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    @property
    def usable_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.memory_efficiency

    def peak_at(self, precision: str) -> float:
        """Dense tensor-core FLOP/s of GEMMs at `precision`. Weights of a precision the GPU has no tensor cores
        for are dequantised to the next wider one it has (FP4 on Hopper runs at FP8's rate, FP8 on Ampere at
        BF16's: weight-only quantisation, as Marlin-style kernels run it), keeping their bytes."""
        if precision == "fp4" and self.fp4_flops:
            return self.fp4_flops
        if precision in ("fp4", "fp8") and self.fp8_flops:
            return self.fp8_flops
        return self.peak_flops


# vLLM's default gpu_memory_utilization: the rest is the CUDA context, allocator slack and NCCL buffers.
MEMORY_UTILIZATION = 0.90
# Assumed: a few µs per small message through NCCL on NVLink.
NVLINK_LATENCY_S = 5e-6


def _links(cal: Calibration) -> dict[str, LinkProfile]:
    eff = cal.exchange.link_efficiency
    return {
        # A100 SXM4, NVIDIA A100 Tensor Core GPU datasheet (2021): NVLink 3 600 GB/s per GPU, 300 each way.
        "a100_nvlink": LinkProfile(300 * GB, NVLINK_LATENCY_S, eff),
        # H100 / H200 SXM datasheets: NVLink 4 900 GB/s per GPU (450 each way).
        "hopper_nvlink": LinkProfile(450 * GB, NVLINK_LATENCY_S, eff),
        # H800 SXM5 product brief: NVLink cut to 400 GB/s per GPU, 200 each way (DeepSeek-V3's report, arXiv
        # 2412.19437 §3.4, measures ~160 GB/s: the calibration's link efficiency).
        "h800_nvlink": LinkProfile(200 * GB, NVLINK_LATENCY_S, eff),
        # HGX B200 and GB200 NVL72 datasheets: NVLink 5 1.8 TB/s per GPU, 900 each way.
        "nvlink5": LinkProfile(900 * GB, NVLINK_LATENCY_S, eff),
        # AMoE Table 2 (AWS p4d): 4 x 100 Gbps EFA per 8-GPU node = 6.25 GB/s per GPU; latency assumed ~20 µs.
        "p4d_efa": LinkProfile(400e9 / 8 / 8, 20e-6, eff),
        # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU; latency assumed ~5 µs through NCCL.
        "hdr_ib": LinkProfile(200e9 / 8, 5e-6, eff),
        # DGX H100/H200, HGX B200, GB200 NVL72: one 400 Gb/s NDR / ConnectX-7 NIC per GPU; ~5 µs assumed.
        "ndr_ib": LinkProfile(400e9 / 8, 5e-6, eff),
        # PCIe 4.0 x16 (PCI-SIG base specification): 16 GT/s x 16 lanes, 128b/130b = 31.5 GB/s each way;
        # ~10 µs per copy assumed. The A5000's and the L40S's path to a peer (neither has an NVLink switch).
        "pcie4": LinkProfile(31.5 * GB, 10e-6, eff),
    }


# Expert offloading's links (MoE-Infinity's testbed, arXiv 2401.14361 §8.1: RTX A5000s, DDR4 host memory, NVMe in
# RAID0). PCIe 4.0 x16: 31.5 GB/s each way; a large pinned cudaMemcpy reaches ~80 % of it (assumed; MoE-Infinity §8.6
# measures a 33.5 MB Switch expert at 2 ms after its optimisations, i.e. 16.8 GB/s); ~10 µs per copy (assumed).
PCIE4_X16 = LinkProfile(bandwidth=31.5 * GB, latency=10e-6, efficiency=0.80)
# One PCIe 4.0 x4 NVMe SSD: 7 GB/s sequential read (Samsung 980 PRO datasheet: up to 7,000 MB/s; the paper names no
# drive), ~90 % of it on large direct reads and ~100 µs per read (assumed).
NVME_GEN4 = LinkProfile(bandwidth=7.0 * GB, latency=100e-6, efficiency=0.90)


@dataclass(frozen=True)
class _Sheet:
    """A GPU's datasheet numbers: TFLOPS dense (BF16, FP8, FP4), HBM GB/s, memory GiB, SMs, links, NVLink domain."""

    arch: str
    bf16: float
    hbm_gbps: float
    mem_gib: float
    nvlink: str
    network: str
    fp8: float = 0.0
    fp4: float = 0.0
    sms: int = 0
    domain: int = 8


SHEETS: dict[str, _Sheet] = {
    # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOPS dense; HBM2 1,555 GB/s (40GB), HBM2e 2,039 GB/s
    # (80GB); 108 SMs. The 40GB's network is the AMoE paper's p4d EFA; the 80GB's a DGX A100's HDR InfiniBand.
    "a100-40g": _Sheet("ampere", 312, 1555, 40, "a100_nvlink", "p4d_efa", sms=108),
    "a100-80g": _Sheet("ampere", 312, 2039, 80, "a100_nvlink", "hdr_ib", sms=108),
    # H100 SXM5 datasheet: BF16 989 TFLOPS dense (1,979 with sparsity), FP8 1,979 dense; HBM3 3.35 TB/s; 132 SMs.
    # H200 SXM datasheet: the same compute, HBM3e 141 GB at 4.8 TB/s.
    "h100": _Sheet("hopper", 989, 3350, 80, "hopper_nvlink", "ndr_ib", fp8=1979, sms=132),
    "h200": _Sheet("hopper", 989, 4800, 141, "hopper_nvlink", "ndr_ib", fp8=1979, sms=132),
    # H800 SXM5 (what DeepSeek and EPS-MoE ran on): the H100's compute and HBM3 with NVLink cut to 200 GB/s each way.
    "h800": _Sheet("hopper", 989, 3350, 80, "h800_nvlink", "ndr_ib", fp8=1979, sms=132),
    # H20 (the export Hopper; NVIDIA publishes no datasheet: the figures its OEM specification sheets quote, e.g.
    # willitrunai.com/gpus/h20-96gb): BF16 148 TFLOPS dense, FP8 296, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s,
    # 78 SMs.
    "h20": _Sheet("hopper", 148, 4000, 96, "hopper_nvlink", "ndr_ib", fp8=296, sms=78),
    # NVIDIA L40S datasheet (Ada): BF16 362.05 TFLOPS dense (733 with sparsity), FP8 733 dense, 48 GB GDDR6 at
    # 864 GB/s, PCIe Gen4 x16 (64 GB/s both ways), no NVLink: peers of its 8-GPU server over PCIe; 142 SMs. Its
    # servers' NIC (one 400 Gb/s per GPU) is assumed.
    "l40s": _Sheet("ada", 362.05, 864, 48, "pcie4", "ndr_ib", fp8=733, sms=142),
    # HGX B200 datasheet (per GPU, 1,000 W): BF16 2.25 PFLOPS dense (4.5 sparse), FP8 4.5, FP4 9; HBM3e 180 GB
    # (1,440 GB per 8) at 8 TB/s (64 per 8); NVLink 5 1.8 TB/s; 148 SMs; a ConnectX-7 400 Gb/s NIC per GPU.
    "b200": _Sheet("blackwell", 2250, 8000, 180, "nvlink5", "ndr_ib", fp8=4500, fp4=9000, sms=148),
    # GB200 NVL72 datasheet (per GPU, of the rack's 72): BF16 2.5 PFLOPS dense (360 PF sparse per rack), FP8 5,
    # FP4 10; HBM3e 186 GB (13.4 TB per rack) at 8 TB/s (576 per rack); one NVLink 5 domain of 72 GPUs at 1.8 TB/s
    # each; a 400 Gb/s NIC per GPU across racks.
    "gb200": _Sheet(
        "blackwell", 2500, 8000, 186, "nvlink5", "ndr_ib", fp8=5000, fp4=10000, sms=148, domain=72
    ),
    # NVIDIA RTX A5000 datasheet (2021): 24 GB GDDR6 at 768 GB/s; tensor 222.2 TFLOPS with sparsity, 111.1 dense
    # FP16; PCIe 4.0 x16. MoE-Infinity's GPU (§8.1); its peers talk over PCIe.
    "a5000": _Sheet("ampere", 111.1, 768, 24, "pcie4", "pcie4", sms=64),
}


def _gpu(name: str, sheet: _Sheet, cal: Calibration) -> GpuProfile:
    k = cal.for_arch(sheet.arch)
    links = _links(cal)
    nvlink = PCIE4_X16 if name == "a5000" else links[sheet.nvlink]
    network = PCIE4_X16 if name == "a5000" else links[sheet.network]
    return GpuProfile(
        name=name, arch=sheet.arch, peak_flops=sheet.bf16 * TFLOPS, hbm_bandwidth=sheet.hbm_gbps * GB,
        memory=sheet.mem_gib * GIB, nvlink=nvlink, network=network, compute_efficiency=k.compute_fraction,
        memory_efficiency=k.memory_fraction, launch_s=k.launch_s, memory_utilization=MEMORY_UTILIZATION,
        kernels=k, exchange=cal.exchange, fp8_flops=sheet.fp8 * TFLOPS, fp4_flops=sheet.fp4 * TFLOPS, sms=sheet.sms,
        nvlink_domain=sheet.domain,
    )  # fmt: skip


def build(cal: Calibration) -> dict[str, GpuProfile]:
    """Every GPU profile under calibration `cal`."""
    return {name: _gpu(name, sheet, cal) for name, sheet in SHEETS.items()}


# Rebuilt in place by apply_calibration (its users keep the same dict).
GPUS: dict[str, GpuProfile] = build(calibrations.load())


def apply_calibration(name: str) -> None:
    """Price every GPU with calibration `name` from now on (`--calibration NAME`: an old prediction again)."""
    GPUS.update(build(calibrations.load(name)))


def gpu_profile(name: str) -> GpuProfile:
    """The named GPU profile (a100-40g, a100-80g, h100, h200, h800, h20, l40s, b200, gb200, a5000)."""
    return lookup("GPU", GPUS, name)


def lookup(kind: str, table: dict, name: str):
    """`table[name]`, or a ConfigError naming the `kind` and the names there are (every profile table's lookup)."""
    if name not in table:
        raise ConfigError(f"unknown {kind} {name!r}; choose from {', '.join(table)}")
    return table[name]
