"""Which tensors a checkpoint holds (as transformers saves each family), their shapes, and the per-layer weight
bundles built from them. Names inside `self_attn.` are the same in every family; where the MoE tensors live is the
family's (amoe.model.families)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from amoe.model.families import Family, family
from amoe.model.spec import ModelConfig

Shape = tuple[int, ...]

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
ROUTER_BIAS = "e_score_correction_bias"  # DeepSeek-V3's routing correction, beside the router weight
QKV = ("q_proj", "k_proj", "v_proj")  # grouped-query attention's projections, run as one matmul
FUSED_QKV = "qkv_proj"  # under self_attn.: the loader's one tensor of the three (weight, and bias if any)


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def attention_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """The tensors under `self_attn.` of one layer: GQA (optional biases and QK-norm), or MLA."""
    h = cfg.hidden_size
    if cfg.mla is not None:
        return _mla_shapes(cfg)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, Shape] = {
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "o_proj.weight": (h, q),
    }
    if cfg.attention_bias:
        shapes.update({"q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,)})
    if cfg.o_bias:
        shapes["o_proj.bias"] = (h,)
    if cfg.qk_norm == "head":
        shapes.update({"q_norm.weight": (cfg.head_dim,), "k_norm.weight": (cfg.head_dim,)})
    elif cfg.qk_norm == "proj":
        shapes.update({"q_norm.weight": (q,), "k_norm.weight": (kv,)})
    return shapes


def _mla_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    shapes: dict[str, Shape] = {}
    if m.q_lora_rank is None:
        shapes["q_proj.weight"] = (heads * m.qk_head_dim, h)
    else:
        shapes["q_a_proj.weight"] = (m.q_lora_rank, h)
        shapes["q_a_layernorm.weight"] = (m.q_lora_rank,)
        shapes["q_b_proj.weight"] = (heads * m.qk_head_dim, m.q_lora_rank)
    shapes["kv_a_proj_with_mqa.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, h)
    shapes["kv_a_layernorm.weight"] = (m.kv_lora_rank,)
    shapes["kv_b_proj.weight"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    shapes["o_proj.weight"] = (h, heads * m.v_head_dim)
    if cfg.attention_bias:  # transformers puts them on the down projections and o_proj only
        if m.q_lora_rank is not None:
            shapes["q_a_proj.bias"] = (m.q_lora_rank,)
        shapes["kv_a_proj_with_mqa.bias"] = (m.kv_lora_rank + m.qk_rope_head_dim,)
        shapes["o_proj.bias"] = (h,)
    return shapes


def mlp_shapes(hidden: int, intermediate: int, projs: tuple[str, str, str]) -> dict[str, Shape]:
    gate, up, down = projs
    return {
        f"{gate}.weight": (intermediate, hidden),
        f"{up}.weight": (intermediate, hidden),
        f"{down}.weight": (hidden, intermediate),
    }


def layer_shapes(cfg: ModelConfig, layer: int) -> dict[str, Shape]:
    """Everything of decoder layer `layer` an attention rank loads: norms, attention, and the dense MLP or the
    router (with DeepSeek-V3's correction bias and Qwen2-MoE's shared-expert gate)."""
    fam, p, h = family(cfg.architecture), layer_prefix(layer), cfg.hidden_size
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes.update({p + "self_attn." + name: shape for name, shape in attention_shapes(cfg).items()})
    if layer in cfg.dense_layers:
        dense = mlp_shapes(h, cfg.dense_intermediate_size, fam.expert_projs)
        shapes.update({f"{p}mlp.{name}": shape for name, shape in dense.items()})
        return shapes
    shapes[router_name(fam, layer)] = (cfg.num_experts, h)
    if cfg.router.method == "noaux_tc":
        shapes[router_name(fam, layer, ROUTER_BIAS)] = (cfg.num_experts,)
    if cfg.shared_gate:
        shapes[f"{p}{fam.shared_gate}.weight"] = (1, h)
    return shapes


def router_name(fam: Family, layer: int, tensor: str = "weight") -> str:
    return f"{layer_prefix(layer)}{fam.moe}.gate.{tensor}"


def expert_shapes(cfg: ModelConfig, block: int, expert: int) -> dict[str, Shape]:
    """One expert of one block, one tensor per projection (gate, up, down); id num_experts is the shared one."""
    fam, layer = family(cfg.architecture), cfg.moe_layers[block]
    if expert >= cfg.num_experts:
        where, projs = f"{layer_prefix(layer)}{fam.shared}.", ("gate_proj", "up_proj", "down_proj")
    else:
        where, projs = f"{layer_prefix(layer)}{fam.moe}.experts.{expert}.", fam.expert_projs
    shapes = mlp_shapes(cfg.hidden_size, cfg.expert_intermediate(expert), projs)
    return {where + name: shape for name, shape in shapes.items()}


def packed_expert_names(cfg: ModelConfig, block: int) -> tuple[str, str]:
    """transformers' in-memory layout: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]."""
    p = f"{layer_prefix(cfg.moe_layers[block])}mlp.experts."
    return p + "gate_up_proj", p + "down_proj"


def canonical_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor of the model as transformers saves it (one tensor per expert), in layer order."""
    shapes: dict[str, Shape] = {EMBED: (cfg.vocab_size, cfg.hidden_size)}
    moe = {layer: block for block, layer in enumerate(cfg.moe_layers)}
    for layer in range(cfg.num_layers):
        shapes.update(layer_shapes(cfg, layer))
        if layer in moe:
            for e in range(cfg.num_expert_ids):
                shapes.update(expert_shapes(cfg, moe[layer], e))
    shapes[FINAL_NORM] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


@dataclass
class LayerWeights:
    """One decoder layer's attention-side weights, as transformers stores them ([out, in])."""

    input_norm: torch.Tensor  # [H]
    post_norm: torch.Tensor  # [H]
    attention: dict[str, torch.Tensor]  # by name under self_attn. (attention_shapes)
    mlp: ExpertWeights | None = None  # a dense layer's MLP
    router: torch.Tensor | None = None  # [E, H] of an MoE layer
    router_bias: torch.Tensor | None = None  # [E] DeepSeek-V3's e_score_correction_bias
    shared_gate: torch.Tensor | None = None  # [1, H] Qwen2-MoE's shared_expert_gate


@dataclass
class ExpertWeights:
    """One SwiGLU (an expert, the shared expert or a dense MLP); gate and up stacked, gate rows first."""

    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class AttentionRankWeights:
    """What an attention rank needs: embedding, every layer's attention side, final norm and lm_head."""

    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
