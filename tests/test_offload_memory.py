"""What a process that hosts experts holds: the budget's accounting (dense part, expert slots, the reader's
buffers), weights that keep no view of the checkpoint, the KV cache sized around the slots, and the bound measured
from the process's start (docs/offload.md, "Resident memory")."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from amoe import device as devices
from amoe.errors import ConfigError
from amoe.model import weights as W
from amoe.model.config import load_model_config
from amoe.model.layers import build_attention_rank, build_expert_layers
from amoe.model.presets import preset
from amoe.offload.io import ALIGN, CheckpointIndex, DiskReader
from amoe.offload.policy import LRU
from amoe.offload.store import ExpertStore, dense_bytes, plan_slots, reader_bytes, routed_expert_bytes


def _mapped_files() -> set[str]:
    """Paths of every file this process has mapped now."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) > 5}


def _decoder_layers(rank) -> list:
    """The attention rank's decoder layers in layer order (each block's dense layers, then its MoE layer)."""
    return [layer for block in rank.layers for layer in (*block.dense_layers, block.moe_layer)]


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2-moe"])
def test_loaded_weights_hold_no_view_of_the_checkpoint(make_checkpoint, name):
    """Every weight is a tensor of its own: once loaded, the checkpoint is not mapped, so none of its pages stay
    resident beside the weights (q, k and v fused into one tensor were held twice). What runs as one matmul (q|k|v
    with their biases, a dense MLP's and an expert's gate|up) was read as one tensor, equal to the parts on disk."""
    ckpt = make_checkpoint(**preset(name))
    cfg = load_model_config(ckpt)
    rank = build_attention_rank(ckpt, cfg, torch.float32)
    experts = build_expert_layers(ckpt, cfg, range(cfg.num_expert_ids), torch.float32)
    assert str(ckpt / "model.safetensors") not in _mapped_files()
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        for layer, decoder in enumerate(_decoder_layers(rank)):
            p = W.layer_prefix(layer)
            parts = [f.get_tensor(f"{p}self_attn.{proj}.weight") for proj in W.QKV]
            assert torch.equal(decoder.attention.qkv_proj, torch.cat(parts))
            if cfg.attention_bias:
                biases = [f.get_tensor(f"{p}self_attn.{proj}.bias") for proj in W.QKV]
                assert torch.equal(decoder.attention.qkv_bias, torch.cat(biases))
            if decoder.mlp is not None:
                gate, up = (f.get_tensor(f"{p}mlp.{proj}.weight") for proj in ("gate_proj", "up_proj"))
                assert torch.equal(decoder.mlp.gate_up, torch.cat([gate, up]))
        assert cfg.dense_layers or name == "tiny"  # the Qwen2-MoE preset has a dense layer to check
        for (block, expert), layer in experts.items():
            gate, up, down = (f.get_tensor(n) for n in W.expert_shapes(cfg, block, expert))
            assert torch.equal(layer.mlp.gate_up, torch.cat([gate, up])) and torch.equal(layer.mlp.down, down)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered_fadvise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["as_stored", "cast"])
def test_reader_buffers_reach_what_the_budget_counts(tiny_checkpoint, direct, dtype):
    """After every expert is read, the reader's buffers hold what buffer_bytes() counted for them beforehand: the
    staging buffer one expert's aligned span needs (O_DIRECT reads) and, for a cast, the largest tensor as stored."""
    cfg = load_model_config(tiny_checkpoint)
    index = CheckpointIndex(tiny_checkpoint)
    keys = [(b, e) for b in range(cfg.num_blocks) for e in range(cfg.num_experts)]
    planned = reader_bytes(index, cfg, keys, dtype)
    # The tiny expert's three float32 tensors (32 KiB each) lie back to back: one span of 96 KiB, read as whole
    # 4 KiB blocks (24 or 25 of them), plus a block of slack to align the buffer. A cast reads tensor by tensor
    # (a span of 32 KiB) through a buffer of one tensor as stored.
    tensor = routed_expert_bytes(cfg, torch.float32) // 3
    cast = tensor if dtype != torch.float32 else 0
    span = tensor if cast else 3 * tensor
    assert span + ALIGN <= planned - cast <= span + 2 * ALIGN
    reader = DiskReader(direct=direct)
    try:
        for key in keys:
            ext = index.expert(cfg, *key)
            (gate, up), down = ext.gate_up, ext.down
            gate_up = torch.empty((gate.shape[0] + up.shape[0], gate.shape[1]), dtype=dtype)
            parts = [(gate, gate_up[: gate.shape[0]]), (up, gate_up[gate.shape[0] :])]
            reader.read_all([*parts, (down, torch.empty(down.shape, dtype=dtype))])
        # (a file system that refuses O_DIRECT is read buffered, without the staging buffer)
        assert reader.allocated_bytes() == (planned if reader.direct else cast)
    finally:
        reader.close()


def test_budget_counts_dense_part_slots_and_reader_buffers(tiny_checkpoint):
    cfg = load_model_config(tiny_checkpoint)
    dense, expert = dense_bytes(cfg, torch.float32, attention=True), routed_expert_bytes(cfg, torch.float32)
    keys = [(b, e) for b in range(cfg.num_blocks) for e in range(cfg.num_experts)]
    buffers = reader_bytes(CheckpointIndex(tiny_checkpoint), cfg, keys, torch.float32)
    for budget in range(dense + buffers + expert, dense + buffers + 4 * expert, expert // 3):
        slots = plan_slots(budget, dense, expert, len(keys), "here", buffers)
        assert dense + buffers + slots * expert <= budget < dense + buffers + (slots + 1) * expert
    with pytest.raises(
        ConfigError, match=rf"minimum for here: {dense + buffers + expert} bytes .*reader's buffers"
    ):
        plan_slots(dense + buffers + expert - 1, dense, expert, len(keys), "here", buffers)
    # Every expert fits: served the usual way, no reader, so nothing is counted for one.
    assert plan_slots(dense + len(keys) * expert, dense, expert, len(keys), "here", buffers) is None


def test_store_reports_what_it_has_set_aside_and_not_filled(tiny_checkpoint):
    cfg = load_model_config(tiny_checkpoint)
    keys = [(b, e) for b in range(cfg.num_blocks) for e in range(cfg.num_experts)]
    store = ExpertStore(
        tiny_checkpoint, cfg, keys, num_slots=3, policy=LRU(), dtype=torch.float32, prefetch=False
    )
    try:
        assert store.unfilled_bytes() == 3 * store.expert_bytes + store.reader_buffer_bytes
        for key in keys[:5]:  # five experts through three slots: all filled
            with store.use(key):
                pass
        assert store.unfilled_bytes() == store.reader_buffer_bytes - store.stats()["reader_buffer_bytes"]
    finally:
        store.close()


def test_kv_cache_from_memory_leaves_room_for_the_unfilled_slots(monkeypatch):
    """Sizing the KV cache from free memory counts the store's slots as held, though their pages are not yet."""
    gib = 2**30
    monkeypatch.setattr(devices, "_rss_bytes", lambda: 1 * gib)
    monkeypatch.setattr(
        devices, "_meminfo", lambda field: {"MemTotal": 10 * gib, "MemAvailable": 8 * gib}[field]
    )

    def blocks(unfilled: int) -> int:
        return devices.kv_budget(
            devices.CPU, block_bytes=2**20, utilization=0.5, share=1, activation_bytes=0, max_blocks=10**9,
            blocks_per_request=1, unfilled_bytes=unfilled,
        ).num_blocks  # fmt: skip

    assert blocks(0) == 4 * 1024  # half of 10 GiB less the 1 GiB held
    assert blocks(3 * gib) == 1024
    with pytest.raises(ConfigError, match="no memory left for the KV cache"):
        blocks(4 * gib)


CHILD = """
import json, sys
from pathlib import Path

import torch

from amoe import LLM, SamplingParams


def rss():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024


start = rss()  # the process's start: Python, torch and amoe imported, nothing built
torch.set_num_threads(1)
llm = LLM(sys.argv[1], num_kv_blocks=8, max_num_seqs=4, **json.loads(sys.argv[2]))
prompts = [[1] + [3 + (7 * i + j) % 500 for j in range(15)] for i in range(4)]
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(json.dumps({"grew": rss() - start, "store": llm.engine.offload_stats()}))
"""


def _grew_from_start(ckpt: Path, options: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(ckpt), json.dumps(options)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_offloaded_process_grows_from_its_start_by_at_most_the_bound(make_checkpoint):
    """docs/offload.md's bound, from the process's start, on the small preset: an offloaded process grows by at
    most its budget + 10 % + the engine's working memory W, W being what the same engine with every expert
    resident grows by beyond its weights (KV cache, activations, GEMM buffers, torch's code run the first time)."""
    ckpt = make_checkpoint(**preset("small"))
    cfg = load_model_config(ckpt)
    dense, expert = dense_bytes(cfg, torch.float32, attention=True), routed_expert_bytes(cfg, torch.float32)
    keys = [(b, e) for b in range(cfg.num_blocks) for e in range(cfg.num_experts)]
    slots = len(keys) // 4
    budget = dense + reader_bytes(CheckpointIndex(ckpt), cfg, keys, torch.float32) + slots * expert
    resident = _grew_from_start(ckpt, {})
    work = resident["grew"] - (dense + len(keys) * expert)
    offloaded = _grew_from_start(ckpt, {"offload_budget": str(budget), "offload_policy": "lru"})
    assert offloaded["store"]["slots"] == offloaded["store"]["resident"] == slots  # the pool filled
    assert offloaded["grew"] <= 1.10 * budget + work, (offloaded["grew"], budget, work)
