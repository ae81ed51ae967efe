"""The families' configs, names and shapes: what each config.json becomes, one-line refusals, the tensor names
transformers saves (one per expert, or packed), MLA's latent cache, and the cost model's view of a checkpoint
(the shared expert on the expert side, `amoe plan --model DIR`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from factories import transformers_checkpoint
from safetensors import safe_open

from amoe import device as devices
from amoe.config import EmulationSection
from amoe.errors import ModelLoadError
from amoe.model import weights as W
from amoe.model.checkpoint import load_attention_rank_weights, load_expert_weights
from amoe.model.config import load_model_config, model_config_from_hf
from amoe.model.families import SUPPORTED_ARCHITECTURES
from amoe.model.kv_cache import LatentKVCache, kv_cache_for
from amoe.model.presets import preset
from amoe.perf.model import cost_model as cm
from amoe.perf.model.gpus import gpu_profile
from amoe.perf.model.routing import routing_inclusion
from amoe.perf.model.shapes import profile_of
from amoe.perf.plan.report import serve_command
from amoe.perf.plan.request import PlanRequest
from amoe.perf.plan.search import search
from amoe.perf.plan.serving import plan_config
from amoe.runtime.emulated import Emulation
from amoe.sampling_params import SamplingParams
from amoe.testing.inproc import InProcessCluster

FAMILIES = ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-olmoe", "tiny-deepseek-v2", "tiny-deepseek-v3"]


def test_each_family_reads_its_distinctive_fields():
    cfgs = {name: model_config_from_hf(preset(name)) for name in FAMILIES}
    qwen2, qwen3, olmoe, v2, v3 = cfgs.values()
    assert (qwen2.dense_layers, qwen2.num_blocks, qwen2.moe_layers) == ((1,), 2, (0, 2))
    assert (qwen2.shared_gate, qwen2.num_expert_ids, qwen2.experts_per_token, qwen2.attention_bias) == (
        True,
        9,
        5,
        True,
    )
    assert not qwen2.router.norm_topk_prob and qwen3.router.norm_topk_prob and not olmoe.router.norm_topk_prob
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.num_heads * qwen3.head_dim != qwen3.hidden_size) == (
        "head",
        24,
        True,
    )
    assert olmoe.qk_norm == "proj"
    assert (v2.router.method, v2.rope_style, v2.mla.q_lora_rank, v2.shared_intermediate_size) == (
        "group_limited_greedy", "complex", None, 2 * 32,
    )  # fmt: skip
    assert (v3.router.method, v3.rope_style, v3.router.scaling_factor, v3.rope_yarn.factor) == (
        "noaux_tc", "interleave", 2.5, 4.0,
    )  # fmt: skip
    assert v3.dense_layers == (0,) and list(v3.block_layers(0)) == [0, 1] and list(v3.block_layers(1)) == [2]
    assert v3.kv_elements_per_token == 32 + 4  # the latent and the rope key, not heads x (K + V)


def _write(tmp_path, hf) -> str:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        (
            "tiny-qwen2-moe",
            {"architectures": ["LlamaForCausalLM"]},
            "unsupported architecture 'LlamaForCausalLM'",
        ),
        ("tiny-qwen2-moe", {"use_sliding_window": True}, "use_sliding_window is not supported for qwen2_moe"),
        ("tiny-qwen2-moe", {"mlp_only_layers": [2]}, "the last decoder layer is dense"),
        ("tiny-qwen3-moe", {"moe_intermediate_size": 0}, "intermediate_size must be a positive integer"),
        ("tiny-deepseek-v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
        ("tiny-deepseek-v3", {"n_group": 3}, r"n_group \(3\) must divide num_experts \(8\)"),
        ("tiny-deepseek-v3", {"kv_lora_rank": None}, "missing key 'kv_lora_rank'"),
        ("tiny-olmoe", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_bad_family_configs_are_one_line(tmp_path, name, change, message):
    hf = {**preset(name), **change}
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(ModelLoadError, match=message) as info:
        load_model_config(_write(tmp_path, hf))
    assert "\n" not in str(info.value)
    if "unsupported" in message:
        assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family as transformers saves it, and tiny-deepseek-v3 also with its experts packed."""
    root = tmp_path_factory.mktemp("saved")
    dirs = {name: transformers_checkpoint(name, root / name, seed=2) for name in FAMILIES}
    dirs["packed"] = transformers_checkpoint("tiny-deepseek-v3", root / "packed", seed=2, packed=True)
    return dirs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", FAMILIES)
def test_amoe_names_every_tensor_as_transformers_saves_it(saved, name):
    """What amoe reads (and make-model writes) is exactly what transformers' save_pretrained wrote."""
    cfg = load_model_config(saved[name])
    with safe_open(str(saved[name] / "model.safetensors"), framework="pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    assert written == W.canonical_shapes(cfg)


@pytest.mark.timeout(120)
def test_packed_experts_load_like_one_tensor_per_expert(saved):
    cfg = load_model_config(saved["packed"])
    with safe_open(str(saved["packed"] / "model.safetensors"), framework="pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in set(f.keys())
    ids = range(cfg.num_expert_ids)  # the routed experts and the shared one
    one, packed = (
        load_expert_weights(saved["tiny-deepseek-v3"], cfg, ids),
        load_expert_weights(saved["packed"], cfg, ids),
    )
    assert set(one) == set(packed) == {(b, e) for b in range(cfg.num_blocks) for e in ids}
    assert all(
        torch.equal(one[k].gate_up, packed[k].gate_up) and torch.equal(one[k].down, packed[k].down)
        for k in one
    )
    a, b = (
        load_attention_rank_weights(saved["tiny-deepseek-v3"], cfg),
        load_attention_rank_weights(saved["packed"], cfg),
    )
    assert all(torch.equal(x.router_bias, y.router_bias) for x, y in zip(a.layers[1:], b.layers[1:]))


def test_mla_cache_holds_the_latent_and_sizes_the_budget():
    cfg = model_config_from_hf(preset("tiny-deepseek-v3"))
    cache = kv_cache_for(cfg, num_kv_blocks=3, block_size=4, dtype=torch.float32)
    assert isinstance(cache, LatentKVCache) and len(cache.entries) == cfg.num_layers == 3
    assert cache.entries[0].shape == (12, 32 + 4)
    # --gpu-memory-utilization divides the budget by this: every layer's latent + rope key per token.
    assert (
        devices.kv_block_bytes(cfg.num_layers, 16, cfg.kv_elements_per_token, torch.float32)
        == 3 * 16 * 36 * 4
    )


def test_a_checkpoints_cost_profile_runs_the_shared_expert_on_the_expert_side():
    cfg = model_config_from_hf(preset("tiny-deepseek-v3"))
    model = profile_of(cfg)
    assert (model.num_expert_ids, model.experts_per_token, model.shared_intermediate) == (9, 3, 32)
    assert model.kv_bytes_per_token == round(3 * 36 * 2 / 2)  # every layer's latent, spread over the 2 blocks
    q = routing_inclusion(model, "skew-exp:0.2")
    assert q.shape == (2, 9) and (q[:, 8] == 1).all() and q[:, :8].sum(axis=1) == pytest.approx(2)
    assert cm.expert_rank_weight_bytes(model, [8]) == 3 * 64 * 32 * 2 * 2  # the shared expert of both blocks
    gpu = gpu_profile("h100")
    assert cm.expert_layer_time(model, gpu, 64, expert=8) != cm.expert_layer_time(
        model, gpu, 64, expert=0
    ) or (model.shared_intermediate == model.expert_intermediate)
    without = dataclasses.replace(model, num_shared_experts=0, shared_intermediate=0)
    assert cm.attention_rank_weight_bytes(model) == cm.attention_rank_weight_bytes(without)


@pytest.mark.timeout(120)
def test_amoe_plan_takes_a_checkpoint(saved):
    model_dir = str(saved["tiny-qwen2-moe"])
    req = PlanRequest("tiny-qwen2-moe", {"a100-80g": 4}, simulate_top=0, model_dir=model_dir, modes=("aep",))
    plans = search(req)
    assert plans and all(p.deployment.mode == "aep" for p in plans)
    assert f"--model {model_dir}" in serve_command(plans[0], req)
    emulated = plan_config(plans[0], req, emulated=True)  # the checkpoint's shapes on emulated GPUs
    assert (emulated.model.path, emulated.executor.kind, emulated.emulation.profile) == (
        model_dir,
        "emulated",
        None,
    )


@pytest.mark.timeout(60)
def test_an_emulated_checkpoint_routes_every_token_to_the_shared_expert(saved):
    em = Emulation(
        EmulationSection(gpu="h100", routing="skew-exp", time_scale=0.2),
        load_model_config(saved["tiny-deepseek-v3"]),
    )
    cfg = em.model_config
    with InProcessCluster(emulation=em, num_attn_ranks=1, num_expert_ranks=2) as cluster:
        out = cluster.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=3), timeout=30)
        routed = cluster.attention[0].routed
    assert [len(o) for o in out] == [3, 3]
    rows = 2 * (4 + 2)  # prompt rows and the decode rows of two requests, in each block
    assert routed[:, cfg.num_experts].tolist() == [rows] * cfg.num_blocks
    assert int(routed.sum()) == rows * cfg.num_blocks * cfg.experts_per_token
