"""Emulated links between runtimes: the node each runtime's GPU sits on, and the hold the receiving communicator
puts on a message from each peer (NVLink within a node, the network across nodes). See docs/emulation.md, "Links".
Also the time of EP's dispatch or combine all-to-all among the devices of a group, NVLink within a node and
DeepEP's measured RDMA bandwidth across nodes (docs/cost-model.md "EP as deployed at scale").

The communicator (`ZmqCommunicator.set_link_delays`) applies the holds; this module only prices them. Pure functions.
"""

from __future__ import annotations

import math

from amoe.errors import ConfigError
from amoe.perf.model.gpus import GpuProfile, LinkProfile
from amoe.perf.model.models import ModelProfile


def runtime_nodes(mode: str, num_attn: int, num_expert: int, gpus_per_node: int) -> list[int]:
    """The node of each runtime, indexed by runtime id; gpus_per_node 0 puts every runtime on node 0.

    ep: runtime r (an attention rank with its experts) is on node r // gpus_per_node. aep / pingpong: attention
    runtimes 0..A-1, then expert runtimes A..A+E-1, each role spread evenly over the nodes (attention i on node
    i * nodes // A, expert j on node j * nodes // E, nodes = ceil((A + E) / gpus_per_node)), so every node holds
    both roles as a real disaggregated deployment would. When a role does not divide evenly a node may hold
    more than gpus_per_node runtimes.
    """
    if gpus_per_node < 0:
        raise ConfigError(f"gpus_per_node must be >= 0; got {gpus_per_node}")
    if mode == "ep":
        return [r // gpus_per_node if gpus_per_node else 0 for r in range(num_attn)]
    if not gpus_per_node:
        return [0] * (num_attn + num_expert)
    nodes = math.ceil((num_attn + num_expert) / gpus_per_node)
    attn = [i * nodes // num_attn for i in range(num_attn)]
    experts = [j * nodes // num_expert for j in range(num_expert)]
    return attn + experts


def link_delays(
    gpu: GpuProfile, model: ModelProfile, nodes: list[int], rank: int, time_scale: float
) -> tuple[list[float], list[float]]:
    """(latency_s, seconds_per_row) per source runtime of the links into `rank`, in wall seconds.

    A row is one hidden state of the emulated model (hidden_size × bytes_per_activation bytes), whatever the
    width of the placeholder rows really on the wire; a runtime's messages to itself are never held (zeros).
    """
    row_bytes = model.hidden_size * model.bytes_per_activation
    latency, per_row = [], []
    for src, node in enumerate(nodes):
        if src == rank:
            latency.append(0.0)
            per_row.append(0.0)
            continue
        link = gpu.nvlink if node == nodes[rank] else gpu.network
        latency.append(link.latency * time_scale)
        per_row.append(row_bytes / link.usable_bandwidth * time_scale)
    return latency, per_row


def weights_copy_time(link: LinkProfile, num_bytes: int) -> float:
    """Seconds to copy `num_bytes` of expert weights from a peer GPU over `link`: one message's latency plus the
    bytes at the link's usable bandwidth (a rebalance's move in a lock-step engine, docs/rebalancing.md)."""
    return link.latency + num_bytes / link.usable_bandwidth if num_bytes > 0 else 0.0


# ---- the EP exchange's latency (docs/simulation.md "Bounds", EP, with sources)

# Assumed, within the "tens of µs" of an NCCL all-to-all of small messages among the 8 GPUs of an NVLink
# node: a fixed cost per collective on top of its bytes at NVLink speed.
A2A_FIXED_NVLINK_S = 20e-6
# DeepEP (github.com/deepseek-ai/DeepEP README, "Low-latency kernels with pure RDMA": H800, one CX7 400 Gb/s NIC
# (~50 GB/s) per GPU, 128 tokens, hidden 7168, top-8, FP8 dispatch / BF16 combine): dispatch 77 / 118 / 155 / 173 /
# 192 / 194 µs at EP 8 / 16 / 32 / 64 / 128 / 256, i.e. 98 / 63 / 48 / 43 / 39 / 39 GB/s per GPU. Across hosts
# an all-to-all therefore reaches this fraction of the NIC's bandwidth at each EP size (EP 8 beats the NIC: its
# peers share a node), and its fixed cost is small against the bytes at that size.
DEEPEP_RDMA_GBPS = {8: 98, 16: 63, 32: 48, 64: 43, 128: 39, 256: 39}
DEEPEP_NIC_GBPS = 50.0
# Assumed: the fixed part of a cross-host all-to-all (NCCL or DeepEP's normal kernels: one RDMA round trip plus the
# kernel), what remains of DeepEP's latencies once their bytes are paid.
A2A_FIXED_NETWORK_S = 30e-6


def all_to_all_time(
    model: ModelProfile,
    gpu: GpuProfile,
    rows: float,
    devices: int,
    gpus_per_node: int,
    bytes_per_element: int | None = None,
) -> float:
    """One dispatch (or combine) all-to-all of an EP step: every device sends `rows` × top-k hidden rows spread
    evenly over the `devices` (its own share stays). Peers on its node go over NVLink, the others over the NIC at
    DeepEP's measured fraction of it; the slower of the two paths sets the time. `bytes_per_element`: the rows'
    precision (default the model's activations; an FP8 dispatch passes model.dispatch_bytes)."""
    if devices <= 1 or rows <= 0:
        return 0.0
    width = bytes_per_element or model.bytes_per_activation
    per_peer = rows * model.experts_per_token * model.hidden_size * width / devices
    node = devices if gpus_per_node <= 0 else min(gpus_per_node, devices)
    local = per_peer * (node - 1) / gpu.nvlink.usable_bandwidth
    if node == devices:
        return A2A_FIXED_NVLINK_S + local
    remote_fraction = _deepep_fraction(devices)
    remote = per_peer * (devices - node) / (gpu.network.bandwidth * remote_fraction)
    return A2A_FIXED_NETWORK_S + max(local, remote)


def _deepep_fraction(devices: int) -> float:
    sizes = sorted(DEEPEP_RDMA_GBPS)
    size = next((s for s in sizes if s >= devices), sizes[-1])
    return min(1.0, DEEPEP_RDMA_GBPS[size] / DEEPEP_NIC_GBPS)
