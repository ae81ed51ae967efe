"""What an expert store asks of a cache policy: which resident expert to evict, and which absent ones to load early.

The store (the real one over safetensors files, or the trace replayer and the emulated tiers) is the only place that
knows what is resident; a policy only ranks (block, expert) keys. It hears three things: a sequence's routing after
each block's router (`routed`), that the store ran an expert (`used`), and that a sequence ended (`end`). From them it
answers `victim` (the resident key to drop) and `wanted` (absent keys to fetch, most urgent first).

LRU and LFU are the baselines of MoE-Infinity's evaluation (arXiv 2401.14361, §6); the activation-aware policy of its
§4–5 lives in amoe/offload/activation.py; amoe/offload/choose.py makes any of them by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

Key = tuple[int, int]  # (block, expert)


class Policy:
    """The interface; the default hooks do nothing so a policy overrides only what it uses."""

    name = "base"

    def routed(self, seq: int, block: int, experts: Sequence[int], counts: Sequence[int]) -> None:
        """`seq`'s tokens at `block` picked `experts`, `counts[i]` tokens each (called after that block's router)."""

    def used(self, key: Key) -> None:
        """The store ran `key` (a hit, or a miss whose copy arrived)."""

    def end(self, seq: int) -> None:
        """`seq` finished; a policy that keeps per-sequence state drops it here."""

    def victim(self, resident: Iterable[Key]) -> Key:
        """The key among `resident` (never empty; the store has left out experts a running step holds) to evict."""
        raise NotImplementedError

    def wanted(self, limit: int) -> list[Key]:
        """Up to `limit` keys worth loading before they are asked for, most urgent first (resident ones included:
        the store skips them). Policies that do not prefetch return []."""
        return []

    def admits(self, key: Key, victim: Key) -> bool:
        """Whether prefetching `key` (from `wanted`) is worth evicting `victim`; on-demand loads never ask."""
        return True


class LRU(Policy):
    """Evict the expert used longest ago."""

    name = "lru"

    def __init__(self) -> None:
        self._clock = itertools.count()
        self._last: dict[Key, int] = {}

    def used(self, key: Key) -> None:
        self._last[key] = next(self._clock)

    def victim(self, resident: Iterable[Key]) -> Key:
        return min(resident, key=lambda k: self._last.get(k, -1))


class LFU(Policy):
    """Evict the expert used least often since the server started; ties go to the one used longest ago."""

    name = "lfu"

    def __init__(self) -> None:
        self._clock = itertools.count()
        self._count: dict[Key, int] = {}
        self._last: dict[Key, int] = {}

    def used(self, key: Key) -> None:
        self._count[key] = self._count.get(key, 0) + 1
        self._last[key] = next(self._clock)

    def victim(self, resident: Iterable[Key]) -> Key:
        return min(resident, key=lambda k: (self._count.get(k, 0), self._last.get(k, -1)))
