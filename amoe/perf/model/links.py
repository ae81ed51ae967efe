"""Emulated links between runtimes: the node each runtime's GPU sits on, and the hold the receiving communicator
puts on a message from each peer (NVLink within a node, the network across nodes). See docs/emulation.md, "Links".
Also the time of EP's dispatch or combine all-to-all among the devices of a group, NVLink within a node and
DeepEP's measured RDMA bandwidth across nodes (docs/cost-model.md "EP as deployed at scale").

The communicator (`ZmqCommunicator.set_link_delays`) applies the holds; this module only prices them. Pure functions.
"""

from __future__ import annotations

import math

import numpy as np

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


# ---- the EP exchange (docs/cost-model.md "EP's exchange", constants from the calibration's DeepEP tables)

KINDS = ("dispatch", "combine")


def all_to_all_time(
    model: ModelProfile, gpu: GpuProfile, rows: float, devices: int, gpus_per_node: int, kind: str = "combine"
) -> float:
    """One dispatch (or combine) of an EP step: every device sends its `rows` rows to each of their top-k experts
    (the dispatch at model.dispatch_bytes per element, the combine at BF16 back). Within one NVLink domain: the
    calibration's fixed cost per collective + the bytes leaving for the node's other devices at NVLink's usable
    bandwidth. Across nodes, DeepEP's low-latency kernels (what EP serving systems decode with): every row copy's
    bytes at the bandwidth DeepEP's table measured at that EP size for that kind (log-linear between its sizes),
    scaled by this GPU's NIC against the table's 400 Gb/s, + the calibration's fixed cost."""
    if devices <= 1 or rows <= 0:
        return 0.0
    if kind not in KINDS:
        raise ValueError(f"all_to_all_time: kind must be one of {KINDS}; got {kind!r}")
    width = model.dispatch_bytes if kind == "dispatch" else model.bytes_per_activation
    copies = rows * model.experts_per_token * model.hidden_size * width
    ex = gpu.exchange
    node = devices if gpus_per_node <= 0 else min(gpus_per_node, devices)
    if node == devices:
        return ex.nvlink_fixed_s + copies * (node - 1) / node / gpu.nvlink.usable_bandwidth
    table = ex.ll_dispatch_gbps if kind == "dispatch" else ex.ll_combine_gbps
    nic = gpu.network.bandwidth / (ex.measured_nic_gbps * 1e9)
    return ex.ll_fixed_s + copies / (table_at(table, devices) * 1e9 * nic)


def table_at(table: tuple[tuple[int, float], ...], devices: float) -> float:
    """A DeepEP table's bandwidth at `devices`, log-linear between its EP sizes, its ends beyond them."""
    sizes = [s for s, _ in table]
    values = [v for _, v in table]
    return float(np.interp(math.log2(max(devices, 1)), np.log2(sizes), values))


def normal_exchange_time(
    model: ModelProfile, gpu: GpuProfile, tokens: float, devices: int, gpus_per_node: int, kind: str
) -> float:
    """One dispatch (or combine) of a prefill step by DeepEP's normal kernels (tokens forwarded once per node over
    RDMA, then over NVLink): across nodes, the RDMA bytes as DeepEP's test counts them (each token once per node its
    experts touch, amoe.perf.model.routing_nodes) at its table's bandwidth for the EP size; within one NVLink
    domain, the token copies leaving each device at the table's NVLink bandwidth. No overlap slowdown: the
    unit-test time."""
    if devices <= 1 or tokens <= 0:
        return 0.0
    width = model.dispatch_bytes if kind == "dispatch" else model.bytes_per_activation
    ex = gpu.exchange
    node = devices if gpus_per_node <= 0 else min(gpus_per_node, devices)
    if node == devices:
        gbps = ex.normal_nvlink_dispatch_gbps if kind == "dispatch" else ex.normal_nvlink_combine_gbps
        copies = tokens * model.experts_per_token * (node - 1) / node
        return copies * model.hidden_size * width / (gbps * gpu.nvlink.bandwidth / H800_NVLINK_GBPS)
    nodes = devices / node
    touched = nodes_touched(model, nodes)
    table = ex.normal_dispatch_gbps if kind == "dispatch" else ex.normal_combine_gbps
    nic = gpu.network.bandwidth / (ex.measured_nic_gbps * 1e9)
    return tokens * touched * model.hidden_size * width / (table_at(table, devices) * 1e9 * nic)


# What DeepEP's intranode figures ran on: the H800's NVLink, 200 GB/s each way (H800 product brief); another GPU's
# NVLink scales them.
H800_NVLINK_GBPS = 200.0


def nodes_touched(model: ModelProfile, nodes: float) -> float:
    """Expected nodes a token's routed experts lie on, experts spread evenly over `nodes` and picked uniformly:
    with group-limited routing (n_group groups, topk_group of them picked) a node holding whole groups is touched
    when one of its groups is picked; a group spread over several nodes is touched on each with its share of the
    token's experts; without it, top-k of E experts at random."""
    k = model.top_k
    if nodes <= 1:
        return 1.0
    if model.n_group and model.topk_group:
        g, t = model.n_group, model.topk_group
        if nodes == int(nodes) and g % int(nodes) == 0:
            per = g // int(nodes)
            return nodes * (1 - math.comb(g - per, t) / math.comb(g, t))
        if nodes == int(nodes) and int(nodes) % g == 0:
            spread = int(nodes) // g  # nodes per group
            per_group = k / t
            return t * spread * (1 - (1 - 1 / spread) ** per_group)
    e = model.num_experts
    per = e / nodes
    return nodes * (1 - math.comb(e - round(per), k) / math.comb(e, k))
