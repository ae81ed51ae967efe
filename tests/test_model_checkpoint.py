"""Checkpoint loading: sharded and fused layouts, selective loading, and one-line errors naming the culprit."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from amoe.errors import ModelLoadError
from amoe.model import checkpoint as ckpt
from amoe.model import weights as W
from amoe.model.checkpoint import load_attention_rank_weights, load_expert_weights, write_random_checkpoint
from amoe.model.config import load_model_config


def _all_tensors(model_dir):
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def _load_everything(model_dir):
    cfg = load_model_config(model_dir)
    attn = load_attention_rank_weights(model_dir, cfg)
    experts = load_expert_weights(model_dir, cfg, range(cfg.num_experts))
    return attn, experts


def _expert(block, expert, proj):
    return f"model.layers.{block}.block_sparse_moe.experts.{expert}.{proj}.weight"


def _router(block, moe="block_sparse_moe"):
    return f"model.layers.{block}.{moe}.gate.weight"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_random_checkpoint_is_deterministic_and_canonical(tiny_checkpoint, tmp_path):
    again = write_random_checkpoint(
        json.loads((tiny_checkpoint / "config.json").read_text()), tmp_path, seed=0
    )
    first, second = _all_tensors(tiny_checkpoint), _all_tensors(again)
    cfg = load_model_config(tiny_checkpoint)
    assert list(first) == sorted(W.canonical_shapes(cfg)) or set(first) == set(W.canonical_shapes(cfg))
    assert all(torch.equal(first[n], second[n]) for n in first)
    norm = first["model.layers.0.input_layernorm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))  # norms differ from 1 so a wrong norm shows


def test_sharded_checkpoint_loads_identically(make_checkpoint):
    single, sharded = make_checkpoint(seed=3), make_checkpoint(seed=3, shards=3)
    assert len(list(sharded.glob("model-*-of-00003.safetensors"))) == 3
    assert (sharded / ckpt.INDEX_FILE).exists() and not (sharded / ckpt.SINGLE_FILE).exists()
    (a_attn, a_exp), (b_attn, b_exp) = _load_everything(single), _load_everything(sharded)
    assert torch.equal(a_attn.embed, b_attn.embed) and torch.equal(a_attn.lm_head, b_attn.lm_head)
    assert all(
        torch.equal(x.attention["q_proj.weight"], y.attention["q_proj.weight"])
        for x, y in zip(a_attn.layers, b_attn.layers)
    )
    assert all(torch.equal(a_exp[k].gate_up, b_exp[k].gate_up) for k in a_exp)


def test_transformers_fused_expert_names_load_like_canonical(tiny_checkpoint, tmp_path):
    cfg = load_model_config(tiny_checkpoint)
    tensors = _all_tensors(tiny_checkpoint)
    fused = {}
    for name, tensor in tensors.items():
        if ".experts." not in name and "block_sparse_moe.gate" not in name:
            fused[name] = tensor
    for b in range(cfg.num_blocks):
        experts = range(cfg.num_experts)
        gate_up = [torch.cat([tensors[_expert(b, e, "w1")], tensors[_expert(b, e, "w3")]]) for e in experts]
        gate_up_name, down_name = W.packed_expert_names(cfg, b)
        fused[gate_up_name] = torch.stack(gate_up)
        fused[down_name] = torch.stack([tensors[_expert(b, e, "w2")] for e in experts])
        fused[_router(b, "mlp")] = tensors[_router(b)]
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    save_file(fused, str(tmp_path / ckpt.SINGLE_FILE))
    (a_attn, a_exp), (b_attn, b_exp) = _load_everything(tiny_checkpoint), _load_everything(tmp_path)
    assert all(torch.equal(x.router, y.router) for x, y in zip(a_attn.layers, b_attn.layers))
    assert all(
        torch.equal(a_exp[k].gate_up, b_exp[k].gate_up) and torch.equal(a_exp[k].down, b_exp[k].down)
        for k in a_exp
    )


def _record_reads(monkeypatch):
    names = []
    original = ckpt.CheckpointReader.read

    def read(self, name, *args, **kwargs):
        names.append(name)
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(ckpt.CheckpointReader, "read", read)
    return names


def test_attention_rank_reads_no_expert_tensor(tiny_checkpoint, monkeypatch):
    names = _record_reads(monkeypatch)
    load_attention_rank_weights(tiny_checkpoint, load_model_config(tiny_checkpoint))
    assert names and not any(".experts." in n for n in names)
    assert W.EMBED in names and W.LM_HEAD in names


def test_expert_rank_reads_only_its_experts(tiny_checkpoint, monkeypatch):
    cfg = load_model_config(tiny_checkpoint)
    names = _record_reads(monkeypatch)
    loaded = load_expert_weights(tiny_checkpoint, cfg, {1, 5})
    assert set(loaded) == {(b, e) for b in range(cfg.num_blocks) for e in (1, 5)}
    assert {n.split(".experts.")[1].split(".")[0] for n in names} == {"1", "5"}
    assert all(".experts." in n for n in names)
    with pytest.raises(ModelLoadError, match="expert 8 does not exist"):
        load_expert_weights(tiny_checkpoint, cfg, [8])


def test_missing_tensor_names_tensor_and_dir(tiny_checkpoint, tmp_path):
    tensors = _all_tensors(tiny_checkpoint)
    missing = _expert(2, 3, "w2")
    del tensors[missing]
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / ckpt.SINGLE_FILE))
    cfg = load_model_config(tmp_path)
    with pytest.raises(ModelLoadError, match=f"{tmp_path}: tensor {missing} is missing"):
        load_expert_weights(tmp_path, cfg, [3])
    load_expert_weights(tmp_path, cfg, [0])  # an expert rank without expert 3 does not care


def test_wrong_shape_names_tensor_expected_and_got(tiny_checkpoint, tmp_path):
    tensors = _all_tensors(tiny_checkpoint)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    shutil.copy(tiny_checkpoint / "config.json", tmp_path / "config.json")
    save_file(tensors, str(tmp_path / ckpt.SINGLE_FILE))
    pattern = r"k_proj.weight has shape \[16, 64\], expected \[32, 64\]"
    with pytest.raises(ModelLoadError, match=pattern):
        load_attention_rank_weights(tmp_path, load_model_config(tmp_path))


def test_unreadable_or_absent_weights(tiny_checkpoint, tmp_path):
    model = _copy(tiny_checkpoint, tmp_path / "m")
    (model / ckpt.SINGLE_FILE).write_bytes(b"not a safetensors file")
    cfg = load_model_config(model)
    with pytest.raises(ModelLoadError, match="model.safetensors: unreadable"):
        load_attention_rank_weights(model, cfg)
    (model / ckpt.SINGLE_FILE).unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_attention_rank_weights(model, cfg)


def test_index_naming_a_missing_shard(make_checkpoint, tmp_path):
    model = _copy(make_checkpoint(seed=3, shards=3), tmp_path / "m")
    (model / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00003.safetensors, which does not exist"):
        load_attention_rank_weights(model, load_model_config(model))
