"""Which tensors a Mixtral checkpoint holds, their shapes, and the per-layer weight bundles built from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from amoe.model.config import ModelConfig

Shape = tuple[int, ...]

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def block_prefix(block: int) -> str:
    return f"model.layers.{block}."


def router_name(block: int, fused: bool = False) -> str:
    """The router weight; transformers 5 in-memory modules call the MoE block `mlp` instead of `block_sparse_moe`."""
    return block_prefix(block) + ("mlp.gate.weight" if fused else "block_sparse_moe.gate.weight")


def expert_name(block: int, expert: int, proj: str) -> str:
    """Canonical per-expert tensors: w1 = gate, w3 = up, w2 = down."""
    return f"{block_prefix(block)}block_sparse_moe.experts.{expert}.{proj}.weight"


def fused_expert_name(block: int, proj: str) -> str:
    """transformers-5 fused layout: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]."""
    return f"{block_prefix(block)}mlp.experts.{proj}"


def attention_block_shapes(cfg: ModelConfig, block: int) -> dict[str, Shape]:
    """The attention-side tensors of one block (router included: it runs on the attention rank)."""
    p, h, d = block_prefix(block), cfg.hidden_size, cfg.head_dim
    return {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (cfg.num_heads * d, h),
        p + "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
        p + "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
        p + "self_attn.o_proj.weight": (h, cfg.num_heads * d),
        p + "post_attention_layernorm.weight": (h,),
        router_name(block): (cfg.num_experts, h),
    }


def expert_shapes(cfg: ModelConfig, block: int, expert: int) -> dict[str, Shape]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        expert_name(block, expert, "w1"): (i, h),
        expert_name(block, expert, "w3"): (i, h),
        expert_name(block, expert, "w2"): (h, i),
    }


def canonical_shapes(cfg: ModelConfig) -> dict[str, Shape]:
    """Every tensor of a canonical Mixtral checkpoint, in the order Hugging Face lists them."""
    shapes: dict[str, Shape] = {EMBED: (cfg.vocab_size, cfg.hidden_size)}
    for b in range(cfg.num_blocks):
        shapes.update(attention_block_shapes(cfg, b))
        for e in range(cfg.num_experts):
            shapes.update(expert_shapes(cfg, b, e))
    shapes[FINAL_NORM] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings:
        shapes[LM_HEAD] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


@dataclass
class AttentionWeights:
    """One block's attention-side weights, as Hugging Face stores them ([out, in])."""

    input_norm: torch.Tensor  # [H]
    q_proj: torch.Tensor  # [heads * D, H]
    k_proj: torch.Tensor  # [kv_heads * D, H]
    v_proj: torch.Tensor  # [kv_heads * D, H]
    o_proj: torch.Tensor  # [H, heads * D]
    post_norm: torch.Tensor  # [H]
    router: torch.Tensor  # [E, H]


@dataclass
class ExpertWeights:
    """One expert of one block; gate and up projections fused (gate rows first) as transformers 5 does."""

    gate_up: torch.Tensor  # [2I, H]
    down: torch.Tensor  # [H, I]


@dataclass
class AttentionRankWeights:
    """What an attention rank needs: embedding, every block's attention + router, final norm and lm_head."""

    embed: torch.Tensor  # [V, H]
    blocks: list[AttentionWeights]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H] (the embedding itself when tied)
