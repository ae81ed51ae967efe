"""GPU and link profiles: every number the cost model uses for a GPU and the links between GPUs, with its source.

Units are SI throughout (bytes, seconds, FLOP/s). "Datasheet" numbers are NVIDIA's published peaks; "calibrated"
numbers were fitted to the AMoE paper (papers/004, §2.1 Figure 3 and §5.4 Figure 13); "assumed" numbers have no
published figure in our sources and are marked so. docs/cost-model.md derives the calibration and compares the
cost model's predictions with the paper (the table is checked by tests/test_emulation.py). Model shapes are in
`models`, host overheads in `hosts`, the paper's calibration points in `calibration`.
"""

from __future__ import annotations

from dataclasses import dataclass

from amoe.errors import ConfigError

GB = 1e9  # datasheets quote bandwidth in decimal GB/s
GIB = 2**30  # and memory sizes in binary GiB (nvidia-smi: 40960 MiB on an A100 40GB)
TFLOPS = 1e12


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
    """One GPU model: datasheet peaks, the fractions of them real kernels reach, and its links."""

    name: str
    peak_flops: float  # dense BF16/FP16 tensor-core FLOP/s (no 2:4 sparsity)
    hbm_bandwidth: float  # bytes/s
    memory: float  # bytes
    nvlink: LinkProfile  # to another GPU of the same node
    network: LinkProfile  # to a GPU of another node (this GPU's share of the node's NICs)
    compute_efficiency: float  # calibrated: fraction of peak_flops a serving GEMM reaches
    memory_efficiency: float  # fraction of hbm_bandwidth a weight-streaming kernel reaches
    launch_s: float  # per kernel: launch gap a step pays on top of its roofline time
    memory_utilization: float  # fraction of memory the serving system may use (weights + KV + buffers)

    @property
    def usable_flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    @property
    def usable_bandwidth(self) -> float:
        return self.hbm_bandwidth * self.memory_efficiency


# Calibrated, not measured by us, jointly to two figures of the AMoE paper (derivation in docs/cost-model.md):
# - Figure 3: a Mixtral 8x7B expert layer on an A100 40GB gains throughput almost linearly with batch "until the
#   batch size of 128". Under the roofline the knee sits at ≈ usable_flops / usable_bandwidth rows (2 FLOPs and
#   2 bytes per weight); read at powers of two, the figure puts it between 128 and 256.
# - §5.4: an expert step takes 0.8 ms at the ~420-row batch derived for the medium workload on an A100 80GB,
#   which needs ≥ ~190 TFLOPS usable once host overhead is taken out.
# 0.60 of peak (187 TFLOPS) with 85 % of HBM bandwidth puts the A100 40GB knee at 148 rows (rows/s at 128 is 1.94x
# that at 64; at 256 only 1.17x that at 128) and the §5.4 expert step at 1.2x the paper. The datasheet ratio alone
# (312 T / 1555 GB/s) would put the knee at 200 rows. We assume the same fractions on Hopper: our sources publish
# no Hopper equivalent of Figure 3.
COMPUTE_EFFICIENCY = 0.60
# Assumed: weight-streaming GEMV/GEMM kernels reach 80–90 % of HBM peak (STREAM-like copies reach ~90 % on A100).
MEMORY_EFFICIENCY = 0.85
# Assumed: a CUDA kernel launch costs ~3–5 µs when the GPU has to wait for it (small kernels, no CUDA graph).
LAUNCH_S = 4e-6
# vLLM's default gpu_memory_utilization: the rest is the CUDA context, allocator slack and NCCL buffers.
MEMORY_UTILIZATION = 0.90
# Assumed: NCCL send/recv reaches ~80 % of the link's peak on large messages; a few µs per small message.
LINK_EFFICIENCY = 0.80
NVLINK_LATENCY_S = 5e-6

# A100 SXM4, NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOPS dense; HBM2 1,555 GB/s (40GB) and
# HBM2e 2,039 GB/s (80GB); NVLink 3 600 GB/s per GPU, i.e. 300 GB/s each way. AMoE Table 2/3: NVSwitch, 600 GB/s.
_A100_NVLINK = LinkProfile(bandwidth=300 * GB, latency=NVLINK_LATENCY_S, efficiency=LINK_EFFICIENCY)
# H100 SXM5 datasheet: BF16 989 TFLOPS dense (1,979 with sparsity); HBM3 3.35 TB/s; NVLink 4 900 GB/s (450 each
# way). H200 SXM datasheet: the same compute and NVLink; HBM3e 141 GB at 4.8 TB/s.
_HOPPER_NVLINK = LinkProfile(bandwidth=450 * GB, latency=NVLINK_LATENCY_S, efficiency=LINK_EFFICIENCY)
# H800 SXM5 (the export variant DeepSeek and EPS-MoE ran on): the H100's compute and HBM3 (80 GB, 3.35 TB/s) with
# NVLink cut to 400 GB/s per GPU, 200 each way (NVIDIA H800 product brief). DeepSeek-V3's report (arXiv 2412.19437,
# §3.4) measures ~160 GB/s NVLink and 50 GB/s of IB per GPU on its H800 nodes: 0.80 of 200 is that 160.
_H800_NVLINK = LinkProfile(bandwidth=200 * GB, latency=NVLINK_LATENCY_S, efficiency=LINK_EFFICIENCY)
# AMoE Table 2 (AWS p4d, the paper's multi-node setup): 4 x 100 Gbps EFA per 8-GPU node = 6.25 GB/s per GPU.
# Latency assumed ~20 µs (EFA's SRD is slower per message than InfiniBand).
_P4D_EFA = LinkProfile(bandwidth=400e9 / 8 / 8, latency=20e-6, efficiency=LINK_EFFICIENCY)
# DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU = 25 GB/s; latency assumed ~5 µs through NCCL.
# (The paper's Lambda A100 80GB cluster had ~10 Gbps networking and was not used across nodes, its §5 footnote.)
_HDR_IB = LinkProfile(bandwidth=200e9 / 8, latency=5e-6, efficiency=LINK_EFFICIENCY)
# DGX H100/H200: one 400 Gb/s NDR InfiniBand NIC per GPU = 50 GB/s; latency assumed ~5 µs through NCCL.
_NDR_IB = LinkProfile(bandwidth=400e9 / 8, latency=5e-6, efficiency=LINK_EFFICIENCY)


# Expert offloading's links (MoE-Infinity's testbed, arXiv 2401.14361 §8.1: RTX A5000s, DDR4 host memory, NVMe in
# RAID0). PCIe 4.0 x16 (PCI-SIG PCIe 4.0 base specification): 16 GT/s x 16 lanes with 128b/130b coding = 31.5 GB/s
# each way; a large pinned cudaMemcpy reaches ~80 % of it (assumed, LINK_EFFICIENCY; MoE-Infinity §8.6 measures a
# 33.5 MB Switch expert at 2 ms after its optimisations, i.e. 16.8 GB/s); ~10 µs per copy (assumed).
PCIE4_X16 = LinkProfile(bandwidth=31.5 * GB, latency=10e-6, efficiency=LINK_EFFICIENCY)
# One PCIe 4.0 x4 NVMe SSD: 7 GB/s sequential read (Samsung 980 PRO datasheet: up to 7,000 MB/s; the paper names no
# drive), ~90 % of it on large direct reads and ~100 µs per read (assumed).
NVME_GEN4 = LinkProfile(bandwidth=7.0 * GB, latency=100e-6, efficiency=0.90)


def _gpu(name: str, tflops: float, hbm_gbps: float, mem_gib: float, nvlink: LinkProfile, net: LinkProfile):
    return GpuProfile(
        name=name,
        peak_flops=tflops * TFLOPS,
        hbm_bandwidth=hbm_gbps * GB,
        memory=mem_gib * GIB,
        nvlink=nvlink,
        network=net,
        compute_efficiency=COMPUTE_EFFICIENCY,
        memory_efficiency=MEMORY_EFFICIENCY,
        launch_s=LAUNCH_S,
        memory_utilization=MEMORY_UTILIZATION,
    )


GPUS: dict[str, GpuProfile] = {
    "a100-40g": _gpu("a100-40g", 312, 1555, 40, _A100_NVLINK, _P4D_EFA),
    "a100-80g": _gpu("a100-80g", 312, 2039, 80, _A100_NVLINK, _HDR_IB),
    "h100": _gpu("h100", 989, 3350, 80, _HOPPER_NVLINK, _NDR_IB),
    "h200": _gpu("h200", 989, 4800, 141, _HOPPER_NVLINK, _NDR_IB),
    "h800": _gpu("h800", 989, 3350, 80, _H800_NVLINK, _NDR_IB),
    # NVIDIA RTX A5000 datasheet (2021): 24 GB GDDR6 at 768 GB/s; tensor 222.2 TFLOPS with sparsity, i.e. 111.1
    # dense FP16; PCIe 4.0 x16. MoE-Infinity's GPU (§8.1). Its peers talk over PCIe (the NVLink bridge joins only
    # pairs), so both links are PCIE4_X16.
    "a5000": _gpu("a5000", 111.1, 768, 24, PCIE4_X16, PCIE4_X16),
}


def gpu_profile(name: str) -> GpuProfile:
    """The named GPU profile (a100-40g, a100-80g, h100, h200, h800, a5000)."""
    return lookup("GPU", GPUS, name)


def lookup(kind: str, table: dict, name: str):
    """`table[name]`, or a ConfigError naming the `kind` and the names there are (every profile table's lookup)."""
    if name not in table:
        raise ConfigError(f"unknown {kind} {name!r}; choose from {', '.join(table)}")
    return table[name]
