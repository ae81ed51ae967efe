"""DeepSeek's expert-parallelism load balancer (EPLB), re-implemented in numpy: how many replicas each expert of a
layer gets and which device holds each, for a measured (or expected) load per expert.

Source: github.com/deepseek-ai/EPLB, `eplb.py` (`rebalance_experts`, commit d52c72d). The algorithm, per layer:

1. **Replicate**: the R - E redundant slots go one at a time to the expert with the most load per replica
   (`replica_counts`; DeepSeek's `replicate_experts`).
2. **Pack**: replicas, each carrying load / replicas of its expert, go heaviest first to the least-loaded device
   that still has a free slot (`balanced_packing`), ceil(R / D) slots a device.
3. **Hierarchical policy** (DeepSeek's `rebalance_experts_hierarchical`): when the experts' groups (group-limited
   routing) divide evenly over the nodes, groups are first packed onto nodes by their summed load, then steps 1-2
   run within each node over its own devices, so a token's routing groups stay within one node's fast links.
   Otherwise the **global policy** runs steps 1-2 over all devices as one node, as the original does.

Where this differs from the original, it generalises it: a device count that does not divide the replicas gives
every device ceil(R / D) slots (the last ones filled fill fewer); the original asserts divisibility. Ties are
broken deterministically: equal loads pack the higher expert id first, equal devices take the lowest index first,
equal experts get a replica in ascending id — the order amoe's cost model has always used (amoe.perf.model.ep_scale),
which shares this one implementation with the serving product.

Numpy only: the coordinator plans placements with it and never loads torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from amoe.errors import ConfigError


def replica_counts(load: Sequence[float], num_replicas: int, most: int | None = None) -> np.ndarray:
    """int64 [E]: replicas of each expert, R in all, each extra one to the expert with the most load per replica
    (ties: the lowest id) among those with fewer than `most` (None: no limit)."""
    load = np.asarray(load, dtype=np.float64)
    if num_replicas < len(load):
        raise ConfigError(f"{num_replicas} replicas cannot hold {len(load)} experts")
    if most is not None and num_replicas > most * len(load):
        raise ConfigError(f"{num_replicas} replicas exceed {most} of each of {len(load)} experts")
    counts = np.ones(len(load), dtype=np.int64)
    for _ in range(num_replicas - len(load)):
        per = load / counts
        if most is not None:
            per[counts >= most] = -np.inf
        counts[int(np.argmax(per))] += 1  # argmax: the first of equals
    return counts


def balanced_packing(
    weights: Sequence[float], ids: Sequence[int], num_packs: int, capacity: int, distinct: bool = False
) -> list[list[int]]:
    """Item indices per pack, in the order they were placed: items heaviest first (equal weights: the higher id
    first), each to the lightest pack with fewer than `capacity` items (equal packs: the lowest index) — with
    `distinct`, the lightest of those holding no item of the same id, where there is one."""
    if num_packs < 1 or num_packs * capacity < len(weights):
        raise ConfigError(f"{len(weights)} items do not fit {num_packs} packs of {capacity}")
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], -ids[i]))
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    free = [(0.0, p) for p in range(num_packs)]  # (load so far, pack) of the packs with room: a heap
    for i in order:
        total, p = heapq.heappop(free)
        skipped = []
        while distinct and free and any(ids[j] == ids[i] for j in packs[p]):
            skipped.append((total, p))
            total, p = heapq.heappop(free)
        for entry in skipped:
            heapq.heappush(free, entry)
        packs[p].append(i)
        if len(packs[p]) < capacity:
            heapq.heappush(free, (total + weights[i], p))
    return packs


def place_layer(
    load: Sequence[float], num_replicas: int, num_devices: int, distinct: bool = False
) -> tuple[np.ndarray, list[list[int]]]:
    """The global policy for one layer: (replicas per expert [E], the expert of each replica per device, in the
    order packed). `distinct`: no device holds two replicas of one expert (amoe's runtimes would merge them into
    one queue), so an expert gets at most one replica a device."""
    counts = replica_counts(load, num_replicas, num_devices if distinct else None)
    experts = [e for e in range(len(counts)) for _ in range(counts[e])]
    weights = [float(load[e]) / counts[e] for e in experts]
    capacity = math.ceil(num_replicas / num_devices)
    packs = balanced_packing(weights, experts, num_devices, capacity, distinct)
    return counts, [[experts[i] for i in pack] for pack in packs]


def rebalance_experts(
    load: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_devices: int,
    distinct: bool = False,
) -> list[list[list[int]]]:
    """Per layer, per device (devices of node n are n·D/N .. (n+1)·D/N - 1), the expert ids of its replicas:
    `load` [layers, E] (tokens per expert), R = `num_replicas` per layer. Hierarchical when `num_groups` contiguous
    expert groups divide over `num_nodes` nodes (and the devices and replicas over the nodes), else global.
    `distinct`: as place_layer's (the original does not ask it)."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or not np.all(np.isfinite(load)) or np.any(load < 0):
        raise ConfigError("expert load must be a finite, non-negative [layers, experts] array")
    if num_devices < 1:
        raise ConfigError(f"a placement needs at least one device; got {num_devices}")
    num_experts = load.shape[1]
    hierarchical = (
        num_nodes > 1
        and num_groups % num_nodes == 0
        and num_experts % num_groups == 0
        and num_devices % num_nodes == 0
        and num_replicas % num_nodes == 0
    )
    if not hierarchical:
        return [place_layer(row, num_replicas, num_devices, distinct)[1] for row in load]
    return [_hierarchical(row, num_replicas, num_groups, num_nodes, num_devices, distinct) for row in load]


def _hierarchical(
    load: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_devices: int, distinct: bool
) -> list[list[int]]:
    """One layer: groups onto nodes by summed load, then replicate and pack within each node."""
    size = len(load) // num_groups
    group_load = [float(load[g * size : (g + 1) * size].sum()) for g in range(num_groups)]
    nodes = balanced_packing(group_load, list(range(num_groups)), num_nodes, num_groups // num_nodes)
    per_node = num_devices // num_nodes
    out: list[list[int]] = []
    for groups in nodes:
        experts = [g * size + i for g in groups for i in range(size)]
        _, packs = place_layer(load[experts], num_replicas // num_nodes, per_node, distinct)
        out += [[experts[j] for j in pack] for pack in packs]
    return out


def balancedness(device_load: Sequence[float]) -> float:
    """vLLM's balancedness of one layer: mean / max of the devices' loads (1: perfectly even; 1 when idle)."""
    loads = np.asarray(device_load, dtype=np.float64)
    top = float(loads.max()) if loads.size else 0.0
    return float(loads.mean()) / top if top > 0 else 1.0


def device_loads(load: Sequence[float], packs: list[list[int]]) -> list[float]:
    """Each device's load when an expert's tokens split evenly over its replicas (`packs`: experts per device)."""
    copies = np.zeros(len(load), dtype=np.int64)
    for pack in packs:
        for e in pack:
            copies[e] += 1
    return [sum(float(load[e]) / copies[e] for e in pack) for pack in packs]
