"""The expert store on its own: sizes, the safetensors extents and the reads that bypass the page cache, pinning,
eviction by the policy, the counters, the routing record's format, and the start-up errors."""

import json
import logging

import pytest
import torch

from amoe.config import AmoeConfig, OffloadSection, parse_size
from amoe.errors import ConfigError
from amoe.model.checkpoint import load_expert_weights
from amoe.model.config import load_model_config
from amoe.offload.io import ALIGN, CheckpointIndex, DiskReader
from amoe.offload.policy import LRU
from amoe.offload.record import FORMAT, RoutingRecorder, chunk_routing
from amoe.offload.store import ExpertStore, dense_bytes, plan_slots, routed_expert_bytes
from amoe.offload.wiring import check_offload


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint(seed=3)


@pytest.fixture(scope="module")
def cfg(ckpt):
    return load_model_config(ckpt)


def test_sizes_parse_with_units():
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_size("3 KiB") == 3072
    for bad in ("", "abc", "12 parsecs", "5i", "-1MiB"):
        with pytest.raises(ConfigError, match="a size is a number"):
            parse_size(bad)
    with pytest.raises(ConfigError, match="offload.policy must be one of activation, lru, lfu"):
        OffloadSection(budget="1MiB", policy="fifo")
    with pytest.raises(ConfigError, match="--offload-budget serves --parallel local or aep"):
        AmoeConfig().replace(offload={"budget": "1MiB"}, parallel={"mode": "ep"})


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered_fadvise"])
def test_reads_give_the_loaders_floats(ckpt, cfg, direct):
    """Each expert read through the header's offsets (O_DIRECT, or buffered + DONTNEED) equals the loader's."""
    index = CheckpointIndex(ckpt)
    reader = DiskReader(direct=direct)
    ref = load_expert_weights(ckpt, cfg, [1, 6], blocks=[0, 3])
    for (block, expert), w in ref.items():
        ext = index.expert(cfg, block, expert)
        gate_up, down = torch.empty_like(w.gate_up), torch.empty_like(w.down)
        at = 0
        for part in ext.gate_up:
            reader.read(part, gate_up[at : at + part.shape[0]])
            at += part.shape[0]
        reader.read(ext.down, down)
        assert torch.equal(gate_up, w.gate_up) and torch.equal(down, w.down)
        # The same expert in one read of the span its three projections cover
        gate_up2, down2 = torch.empty_like(w.gate_up), torch.empty_like(w.down)
        n = ext.gate_up[0].shape[0]
        parts = [(ext.gate_up[0], gate_up2[:n]), (ext.gate_up[-1], gate_up2[n:]), (ext.down, down2)]
        reader.read_all(parts if len(ext.gate_up) == 2 else [(ext.gate_up[0], gate_up2), (ext.down, down2)])
        assert torch.equal(gate_up2, w.gate_up) and torch.equal(down2, w.down)
        down16 = torch.empty(w.down.shape, dtype=torch.bfloat16)  # served in another dtype: cast on the way
        reader.read(ext.down, down16)
        assert torch.equal(down16, w.down.to(torch.bfloat16))
    # O_DIRECT rounds each read out to whole 4 KiB blocks; a buffered read is the payload itself
    payload = sum(2 * index.expert(cfg, *k).nbytes + index.expert(cfg, *k).down.nbytes for k in ref)
    # (five reads per expert here, each rounded out by less than a block at either end)
    assert (
        payload <= reader.bytes_read < payload + 5 * len(ref) * 2 * ALIGN
        if reader.direct
        else reader.bytes_read == payload
    )
    reader.close()


def test_store_pins_evicts_by_policy_and_counts(ckpt, cfg):
    keys = [(b, e) for b in range(cfg.num_blocks) for e in range(cfg.num_experts)]
    ref = load_expert_weights(ckpt, cfg, range(cfg.num_experts))
    store = ExpertStore(ckpt, cfg, keys, num_slots=2, policy=LRU(), dtype=torch.float32, prefetch=False)
    try:
        for key in [
            (0, 1),
            (0, 2),
            (0, 1),
            (1, 5),
        ]:  # miss, miss, hit, miss evicting (0, 2), used longest ago
            with store.use(key) as layer:
                assert torch.equal(layer.mlp.gate_up, ref[key].gate_up)
                assert (
                    layer.mlp.down.data_ptr() != ref[key].down.data_ptr()
                )  # a slot, not the loader's tensor
        assert store.resident() == [(0, 1), (1, 5)]
        stats = store.stats()
        assert (stats["hits"], stats["misses"], stats["loads"], stats["evictions"]) == (1, 3, 3, 1)
        assert stats["bytes_read"] == stats["loads"] * store.expert_bytes  # float32 on disk and in the slots
        # A pinned expert is never the victim: hold (0, 1) while two others come and go through the other slot.
        layer = store.acquire((0, 1))
        for key in [(2, 0), (3, 7)]:
            with store.use(key):
                assert (0, 1) in store.resident()
        assert torch.equal(layer.mlp.gate_up, ref[(0, 1)].gate_up)
        store.release((0, 1))
    finally:
        store.close()


def test_expected_experts_load_ahead_and_count_as_prefetches(ckpt, cfg):
    keys = [(b, e) for b in range(cfg.num_blocks) for e in range(cfg.num_experts)]
    store = ExpertStore(ckpt, cfg, keys, num_slots=3, policy=LRU(), dtype=torch.float32)
    try:
        with store.use((0, 0)):
            pass
        order = store.expect([(0, 4), (0, 0), (0, 5)])
        assert order == [(0, 0), (0, 4), (0, 5)]  # resident first, while the others' copies come in
        for key in order:
            with store.use(key):
                pass
        store.end_step()
        stats = store.stats()
        assert stats["loads"] == 3 and stats["bytes_read"] == 3 * store.expert_bytes
        # The two absent ones were queued ahead: a copy done before the step asked is a prefetch used
        assert stats["prefetch_used"] == stats["prefetches"] and stats["misses"] + stats["hits"] == 4
    finally:
        store.close()


def test_budget_minimum_and_all_resident(cfg, caplog):
    expert = routed_expert_bytes(cfg, torch.float32)
    dense = dense_bytes(cfg, torch.float32, attention=True)
    with pytest.raises(ConfigError, match=rf"below the minimum for here: {dense + expert} bytes"):
        plan_slots(dense + expert - 1, dense, expert, 32, "here")
    assert plan_slots(dense + expert, dense, expert, 32, "here") == 1
    with caplog.at_level(logging.INFO, logger="amoe.offload.store"):
        assert plan_slots(dense + 32 * expert, dense, expert, 32, "here") is None
    assert "holds all 32 experts" in caplog.text


def test_start_up_check_names_each_process(ckpt):
    config = AmoeConfig().replace(
        model={"path": str(ckpt)}, offload={"budget": "10KiB", "policy": "lru"}, parallel={"expert_ranks": 2}
    )
    # One expert (96 KiB) and the reader's buffers: its staging for the expert's 96 KiB span, read as 25 whole
    # 4 KiB blocks, and a block to align it (tests/test_offload_memory.py checks the reader reaches this).
    with pytest.raises(ConfigError, match=r"expert runtime of experts \[0, 2, 4, 6\]: 204800 bytes"):
        check_offload(config, ckpt)
    local = config.replace(parallel={"mode": "local"}, offload={"budget": "200KiB"})
    with pytest.raises(ConfigError, match="minimum for this process"):
        check_offload(local, ckpt)
    check_offload(config.replace(offload={"budget": "200KiB"}), ckpt)  # one slot per expert runtime: fine


def test_routing_record_format(tmp_path):
    ids = torch.tensor([[0, 3], [3, 1], [2, 0], [8, 3]])  # chunk 0: rows 0-1, chunk 1: rows 2-3 (8: shared)
    routing = chunk_routing(ids, torch.tensor([0, 2, 4]), num_experts=8)
    assert routing == [([0, 1, 3], [1, 1, 2]), ([0, 2, 3], [1, 1, 1])]
    rec = RoutingRecorder(tmp_path / "r.jsonl", num_blocks=2, num_experts=8, model="m")
    for step in range(2):
        for block in range(2):
            rec.add(block, [7, 9], routing if step == 0 else routing[::-1])
    rec.end(9)
    rec.end(123)  # never ran: no line
    rec.close()
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert lines[0] == {"format": FORMAT, "num_blocks": 2, "num_experts": 8, "model": "m"}
    assert lines[1] == {
        "seq": 9,
        "steps": [[[[0, 1], [2, 1], [3, 1]]] * 2, [[[0, 1], [1, 1], [3, 2]]] * 2],
    }
    assert len(lines) == 2


def test_local_backend_store_on_metrics():
    """The local engine's store shows as runtime 0, role local; its counters stay monotonic."""
    from coordinator.metrics import CoordinatorMetrics

    class StoreBackend:  # what the metrics read of a local backend whose engine offloads
        stats = {"hits": 5, "misses": 3, "loads": 4, "evictions": 1, "bytes_read": 4096, "stall_s": 0.5,
                 "prefetches": 1, "prefetch_used": 1, "slots": 2, "resident": 2, "experts": 32}  # fmt: skip

        def offload_stats(self):
            return dict(self.stats)

    text = CoordinatorMetrics(StoreBackend()).render().decode()
    labels = '{role="local",runtime="0"}'
    for line in (
        f"amoe_offload_hits_total{labels} 5.0",
        f"amoe_offload_misses_total{labels} 3.0",
        f"amoe_offload_read_bytes_total{labels} 4096.0",
        f"amoe_offload_stall_seconds_total{labels} 0.5",
        f"amoe_offload_prefetch_used_total{labels} 1.0",
        f"amoe_offload_slots{labels} 2.0",
        f"amoe_offload_experts{labels} 32.0",
    ):
        assert line in text, text


def test_policy_errors_surface_at_start_up(ckpt, tmp_path):
    """An EAMC file built for another model (amoe offload build-eamc's output, npz) is one line at start-up naming
    the file and both shapes, before anything loads."""
    import numpy as np

    from amoe.offload.eam import EAMC

    path = tmp_path / "other-model.npz"
    EAMC.build(np.random.default_rng(0).random((6, 3, 8)), size=2).save(path)
    config = AmoeConfig().replace(
        parallel={"mode": "local"}, offload={"budget": "1GiB", "policy": "activation", "eamc": str(path)}
    )
    with pytest.raises(ConfigError, match=r"--offload-eamc .*other-model.npz: .*\(3, 8\).*\(4, 8\)") as info:
        check_offload(config, ckpt)
    assert "\n" not in str(info.value)


def test_a_failed_read_fails_the_step_not_the_store(ckpt, cfg, tmp_path):
    import shutil

    from amoe.errors import ModelLoadError

    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    store = ExpertStore(copy, cfg, [(0, 0), (3, 7)], num_slots=1, policy=LRU(), dtype=torch.float32)
    try:
        with store.use((0, 0)):  # early in the file: read before the file is cut
            pass
        data = copy / "model.safetensors"
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # (3, 7) lies in the lost half
        with pytest.raises(ModelLoadError, match=r"expert \(3, 7\): .*end of file"):
            store.acquire((3, 7))
        assert store._thread.is_alive()  # the I/O thread goes on
    finally:
        store.close()
    assert not store._thread.is_alive()
