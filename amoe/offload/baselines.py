"""The prefetch baselines of MoE-Infinity's prefetching evaluation (arXiv 2401.14361 §8.3), as policies.

- **TOPK** (ZeRO-Infinity's): after a block's router, prefetch the top-K experts *by expert id* of the next block.
- **TRACED-TOPK** (BrainStorm's): trace how often each expert ran and prefetch the K most used experts of the next
  block (ties to the lower id).

Both look one block ahead only; that is what §8.3 contrasts with the activation-aware prefetcher, which queues every
later block. The paper tunes K for each ("autotuned", "empirically optimized ... we only report its best
performance"); amoe bench offload-replay sweeps K and reports the best recall per bandwidth the same way.

The paper implemented these baselines inside MoE-Infinity, so its cache stays: a baseline wraps a cache policy
(`cache`, e.g. the activation-aware one with Algorithm 2) and takes from it everything but `wanted`. It admits every
prefetch (Algorithm 2 has no admission test); the store still never evicts an expert the running block holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from amoe.errors import ConfigError
from amoe.offload.policy import Key, Policy


class NextBlockTopK(Policy):
    """TOPK (`traced=False`) or TRACED-TOPK (`traced=True`) prefetching over the eviction of `cache`."""

    def __init__(self, cache: Policy, num_blocks: int, num_experts: int, k: int, *, traced: bool) -> None:
        if not 1 <= k <= num_experts:
            raise ConfigError(f"K must be in [1, {num_experts}]; got {k}")
        self.cache, self.num_blocks, self.num_experts, self.k, self.traced = (
            cache,
            num_blocks,
            num_experts,
            k,
            traced,
        )
        self.name = f"{'traced-topk' if traced else 'topk'}:{k}"
        self.counts = np.zeros((num_blocks, num_experts), dtype=np.int64)  # [L, E] runs of each expert so far
        self._next = -1  # the block after the last one routed; -1 before any router and past the last block

    def routed(self, seq: int, block: int, experts: Sequence[int], counts: Sequence[int]) -> None:
        self._next = block + 1 if block + 1 < self.num_blocks else -1
        self.cache.routed(seq, block, experts, counts)

    def used(self, key: Key) -> None:
        self.counts[key] += 1
        self.cache.used(key)

    def end(self, seq: int) -> None:
        self.cache.end(seq)

    def victim(self, resident: Iterable[Key]) -> Key:
        return self.cache.victim(resident)

    def wanted(self, limit: int) -> list[Key]:
        if self._next < 0:
            return []
        block, k = self._next, min(self.k, limit)
        if self.traced:
            # Most used first; a stable sort keeps the lower id first among equal counts.
            order = np.argsort(-self.counts[block], kind="stable")[:k]
        else:
            order = np.arange(k)
        return [(block, int(e)) for e in order]

    def admits(self, key: Key, victim: Key) -> bool:
        return True

    def stats(self) -> dict:
        return {"k": self.k, "traced": self.traced}
