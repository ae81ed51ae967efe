"""The paged KV cache of an attention rank: slot storage per layer, and the block manager that hands out slots."""

from __future__ import annotations

import logging
import math
from collections import deque

import numpy as np
import torch

from amoe.errors import AmoeError
from amoe.model.spec import ModelConfig

logger = logging.getLogger(__name__)


class KVCacheFullError(AmoeError):
    """The KV cache has too few free blocks for what was asked; callers check can_allocate/can_append first."""


class PagedKVCache:
    """K and V of every attention layer of a rank, addressed by flat slot = block * block_size + offset."""

    def __init__(
        self,
        num_layers: int,
        num_kv_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        shape = (num_kv_blocks * block_size, num_kv_heads, head_dim)
        self.key = [zeros(shape, dtype, device) for _ in range(num_layers)]
        self.value = [zeros(shape, dtype, device) for _ in range(num_layers)]

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store this chunk's K/V ([n, kv_heads, head_dim]) at its slots ([n])."""
        self.key[layer].index_copy_(0, slot_mapping, key)
        self.value[layer].index_copy_(0, slot_mapping, value)

    def copy(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Every layer's K/V at `src_slots` into `dst_slots` (a request's sequences forked after its prefill)."""
        _copy_rows(self.key + self.value, src_slots, dst_slots)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` (any shape S) → two tensors [*S, kv_heads, head_dim]."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, *self.key[layer].shape[1:])
        # index_select: a plain row gather, several times faster on CPU than advanced indexing.
        return self.key[layer].index_select(0, flat).view(shape), self.value[layer].index_select(
            0, flat
        ).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros(shape); on the CPU from pages the kernel zeroes on first touch (numpy's calloc), so a cache costs
    the pages its requests write, not all of it up front: torch.zeros writes every byte at once (the tiny model's
    default cache is 512 MB per rank, ~0.3 s of CPU and all of it resident, however few requests it serves)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _copy_rows(tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    # index_select / index_copy_ want their indices on the cache's device; the local scheduler makes them on the host.
    src, dst = src.to(tensors[0].device), dst.to(tensors[0].device)
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))


class LatentKVCache:
    """MLA's cache (DeepSeek): per layer and slot, the normalised compressed latent and the rotated rope key
    side by side, [slots, kv_lora_rank + qk_rope_head_dim] — what every head's keys and values are decoded from."""

    def __init__(
        self,
        num_layers: int,
        num_kv_blocks: int,
        block_size: int,
        width: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.entries = [zeros((num_kv_blocks * block_size, width), dtype, device) for _ in range(num_layers)]

    def write(self, layer: int, slot_mapping: torch.Tensor, entries: torch.Tensor) -> None:
        """Store this chunk's [n, width] entries at its slots ([n])."""
        self.entries[layer].index_copy_(0, slot_mapping, entries)

    def copy(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Every layer's entries at `src_slots` into `dst_slots` (see PagedKVCache.copy)."""
        _copy_rows(self.entries, src_slots, dst_slots)

    def gather(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The entries at `slots` (any shape S) → [*S, width]."""
        return self.entries[layer].index_select(0, slots.reshape(-1)).view(*slots.shape, -1)


def kv_cache_for(
    cfg: ModelConfig,
    num_kv_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> PagedKVCache | LatentKVCache:
    """The cache of every decoder layer of `cfg`: K/V heads, or MLA's latent (cfg.kv_elements_per_token each)."""
    if cfg.mla is not None:
        width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        return LatentKVCache(cfg.num_layers, num_kv_blocks, block_size, width, dtype, device)
    return PagedKVCache(
        cfg.num_layers, num_kv_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype, device
    )


class BlockManager:
    """Fixed-size KV blocks; one block table per request, shared by every attention layer of the rank.

    Slots are allocated when a chunk enters block 0 (AMoE §3.2), so later layers reuse the same table.
    """

    def __init__(self, num_kv_blocks: int, block_size: int) -> None:
        if num_kv_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_kv_blocks and block_size must be positive, got {num_kv_blocks}, {block_size}"
            )
        self.block_size = block_size
        self._num_total = num_kv_blocks
        self._free: deque[int] = deque(range(num_kv_blocks))
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_total_blocks(self) -> int:
        return self._num_total

    def has(self, request_id: int) -> bool:
        return request_id in self._tables

    def num_tokens(self, request_id: int) -> int:
        return self._lengths[request_id]

    def block_table(self, request_id: int) -> list[int]:
        return self._tables[request_id]

    def blocks_needed(self, current_tokens: int, new_tokens: int) -> int:
        """Blocks to add so a request holding `current_tokens` fits `new_tokens` more."""
        bs = self.block_size
        return -(-(current_tokens + new_tokens) // bs) - -(-current_tokens // bs)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a new request of `num_tokens` fits now."""
        return self.blocks_needed(0, num_tokens) <= len(self._free)

    def can_append(self, request_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(self._lengths[request_id], num_tokens) <= len(self._free)

    def allocate(self, request_id: int, num_tokens: int) -> list[int]:
        """Start a block table for a new request; returns the flat slots of its first `num_tokens` tokens."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already holds KV blocks")
        self._tables[request_id] = []
        self._lengths[request_id] = 0
        try:
            return self.append(request_id, num_tokens)
        except KVCacheFullError:
            del self._tables[request_id], self._lengths[request_id]
            raise

    def append(self, request_id: int, num_tokens: int) -> list[int]:
        """Grow a request by `num_tokens`; returns their flat slots. Never over-commits."""
        if request_id not in self._tables:
            raise KeyError(f"request {request_id} holds no KV blocks")
        start = self._lengths[request_id]
        needed = self.blocks_needed(start, num_tokens)
        if needed > len(self._free):
            raise KVCacheFullError(
                f"KV cache full: request {request_id} needs {needed} more blocks, {len(self._free)} free"
            )
        table = self._tables[request_id]
        table.extend(self._free.popleft() for _ in range(needed))
        self._lengths[request_id] = start + num_tokens
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + num_tokens)]

    def fork(self, src_id: int, dst_id: int) -> tuple[list[int], list[int]]:
        """A new request `dst_id` holding as many tokens as `src_id`, in blocks of its own; returns the slots to
        copy from and to. KVCacheFullError (holding nothing) if they do not fit."""
        num_tokens = self._lengths[src_id]
        dst = self.allocate(dst_id, num_tokens)
        table, bs = self._tables[src_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(num_tokens)], dst

    def free(self, request_id: int) -> None:
        """Return a request's blocks; freeing an unknown request is a no-op (abort may race with finish)."""
        table = self._tables.pop(request_id, None)
        self._lengths.pop(request_id, None)
        if table:
            self._free.extend(table)
