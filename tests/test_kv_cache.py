"""BlockManager accounting and PagedKVCache slot storage."""

import pytest
import torch

from amoe.model.kv_cache import BlockManager, KVCacheFullError, PagedKVCache


def test_allocate_maps_tokens_to_slots_of_its_blocks():
    blocks = BlockManager(num_kv_blocks=4, block_size=4)
    slots = blocks.allocate("a", 6)
    table = blocks.block_table("a")
    assert len(table) == 2 and blocks.num_free_blocks == 2
    assert slots == [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert blocks.num_tokens("a") == 6


def test_append_fills_the_last_block_before_taking_another():
    blocks = BlockManager(num_kv_blocks=4, block_size=4)
    blocks.allocate("a", 3)
    assert blocks.append("a", 1) == [blocks.block_table("a")[0] * 4 + 3]
    assert blocks.num_free_blocks == 3
    blocks.append("a", 1)
    assert blocks.num_free_blocks == 2 and len(blocks.block_table("a")) == 2


def test_free_returns_every_block_and_is_idempotent():
    blocks = BlockManager(num_kv_blocks=3, block_size=2)
    blocks.allocate("a", 5)
    assert blocks.num_free_blocks == 0
    blocks.free("a")
    blocks.free("a")
    assert blocks.num_free_blocks == blocks.num_total_blocks == 3
    assert not blocks.has("a")


def test_refuses_to_over_commit():
    blocks = BlockManager(num_kv_blocks=2, block_size=4)
    assert blocks.can_allocate(8) and not blocks.can_allocate(9)
    with pytest.raises(KVCacheFullError, match="needs 3 more blocks, 2 free"):
        blocks.allocate("big", 9)
    assert not blocks.has("big") and blocks.num_free_blocks == 2  # a refused allocation holds nothing
    blocks.allocate("a", 8)
    assert not blocks.can_append("a", 1)
    with pytest.raises(KVCacheFullError):
        blocks.append("a", 1)
    assert blocks.num_tokens("a") == 8


def test_misuse_is_reported():
    blocks = BlockManager(num_kv_blocks=2, block_size=4)
    blocks.allocate("a", 1)
    with pytest.raises(ValueError, match="already holds"):
        blocks.allocate("a", 1)
    with pytest.raises(KeyError, match="holds no KV blocks"):
        blocks.append("nobody", 1)
    with pytest.raises(ValueError):
        BlockManager(num_kv_blocks=0, block_size=4)


def test_paged_cache_writes_and_gathers_per_layer():
    cache = PagedKVCache(num_layers=2, num_kv_blocks=3, block_size=2, num_kv_heads=1, head_dim=4)
    key, value = torch.randn(2, 1, 4), torch.randn(2, 1, 4)
    slots = torch.tensor([5, 0])
    cache.write(1, slots, key, value)
    k, v = cache.gather(1, torch.tensor([[0, 5]]))
    assert torch.equal(k[0], key.flip(0)) and torch.equal(v[0], value.flip(0))
    assert not cache.key[0].any()  # layers are separate
