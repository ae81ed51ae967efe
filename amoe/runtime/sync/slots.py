"""Physical expert slots of the synchronous modes, as vLLM's EPLB keeps them (`logical_to_physical_map`): each expert
device holds a fixed number of slots, the barrier exchange routes by slot, and a placement decides which expert of
each block sits in which slot. A rebalance rewrites the table, never the slots, so the exchange that routes by them
stays as it was built (docs/rebalancing.md, "The stop-the-world baseline").

The rule for a row of an expert with several replicas: an expert's copies in one dispatch go to its replicas in
turn, in the batch's row order (vLLM draws a replica at random per copy; a turn is its deterministic even split).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from amoe.errors import ConfigError
from amoe.expert_map import ExpertMap


class SlotMap:
    """Slot s lives on device `devices[s // per_device]`; `table[b, s]` is the expert in it at block b (-1: empty)."""

    def __init__(self, devices: Sequence[int], per_device: int, expert_map: ExpertMap) -> None:
        self.devices, self.per_device, self.map = tuple(devices), per_device, expert_map
        num_slots = len(self.devices) * per_device
        self.table = np.full((expert_map.num_blocks, num_slots), -1, dtype=np.int64)  # [B, S]
        for b, row in enumerate(expert_map.replicas):
            for i, d in enumerate(self.devices):
                hosted = sorted(e for e, where in enumerate(row) if d in where)
                if len(hosted) > per_device:
                    raise ConfigError(
                        f"device {d} would hold {len(hosted)} experts of block {b} in {per_device} slots"
                    )
                self.table[b, i * per_device : i * per_device + len(hosted)] = hosted
        if set(expert_map.runtimes()) - set(self.devices):
            raise ConfigError(f"the expert map names devices outside {self.devices}")
        replicas = int(expert_map.counts().max())
        # [B, E, max replicas]: the slots of each expert, ascending; count[b, e] of them are real.
        self._slots = np.zeros((expert_map.num_blocks, expert_map.num_experts, replicas), dtype=np.int64)
        self._count = expert_map.counts()  # [B, E]
        for b in range(expert_map.num_blocks):
            for e in range(expert_map.num_experts):
                where = np.flatnonzero(self.table[b] == e)
                self._slots[b, e, : len(where)] = where

    @classmethod
    def start(cls, devices: Sequence[int], expert_map: ExpertMap, num_redundant: int) -> SlotMap:
        """Enough slots a device for the start-up map and for any EPLB map of E + num_redundant replicas a block
        (ceil((E + N) / D) each, EPLB's own capacity)."""
        per_block = max(sum(1 for where in row if d in where) for row in expert_map.replicas for d in devices)
        need = math.ceil((expert_map.num_experts + num_redundant) / len(devices))
        return cls(devices, max(need, per_block), expert_map)

    @property
    def expert_device(self) -> list[int]:
        """The device of each slot: what the barrier exchange is built with."""
        return [d for d in self.devices for _ in range(self.per_device)]

    def with_map(self, expert_map: ExpertMap) -> SlotMap:
        """The same slots holding another placement."""
        return SlotMap(self.devices, self.per_device, expert_map)

    def logical(self, block: int, slot: int) -> int:
        """The expert in `slot` at `block`."""
        return int(self.table[block, slot])

    def physical(self, block: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """[N, K] expert ids → [N, K] slot ids: an expert's copies go to its replicas in turn (the module's rule)."""
        flat = topk_ids.reshape(-1).numpy()
        count = self._count[block][flat]
        turn = np.zeros_like(flat)
        if flat.size and count.max() > 1:
            order = np.argsort(flat, kind="stable")
            ordered = flat[order]
            starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
            first = np.repeat(starts, np.diff(np.r_[starts, flat.size]))
            turn[order] = np.arange(flat.size) - first
        slots = self._slots[block][flat, turn % count]
        return torch.from_numpy(slots.reshape(tuple(topk_ids.shape)))
