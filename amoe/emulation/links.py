"""Emulated links between runtimes: the node each runtime's GPU sits on, and the hold the receiving communicator
puts on a message from each peer (NVLink within a node, the network across nodes). See docs/emulation.md, "Links".

The communicator (`ZmqCommunicator.set_link_delays`) applies them; this module only prices them. Pure functions.
"""

from __future__ import annotations

import math

from amoe.emulation.profiles import GpuProfile, ModelProfile
from amoe.errors import ConfigError


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
