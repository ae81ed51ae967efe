"""Between cost profiles and the runtime's model shapes: the ModelConfig an emulated deployment's runtimes use, and
the cost profile of a local checkpoint's shapes. (Kept apart from profiles.py, which the config validation reads
and which must stay free of model code.)"""

from __future__ import annotations

from amoe.emulation.profiles import ModelProfile, gqa_attention
from amoe.model.config import ModelConfig


def model_config_of(profile: ModelProfile) -> ModelConfig:
    """A ModelConfig with the profile's runtime-visible shapes (hidden, blocks, experts, top-k, vocab)."""
    return ModelConfig(
        vocab_size=profile.vocab_size,
        hidden_size=profile.hidden_size,
        intermediate_size=profile.expert_intermediate,
        num_blocks=profile.num_blocks,
        num_heads=profile.num_heads,
        num_kv_heads=profile.num_kv_heads,
        head_dim=profile.head_dim,
        num_experts=profile.num_experts,
        top_k=profile.top_k,
        max_position_embeddings=profile.max_position_embeddings,
        bos_token_id=profile.bos_token_id,
        eos_token_id=profile.eos_token_id,
        dtype="bfloat16",
    )


def profile_of(cfg: ModelConfig, name: str = "checkpoint") -> ModelProfile:
    """The cost profile of a Mixtral-style checkpoint's shapes (BF16), e.g. to emulate a local test model."""
    attn, kv, flops = gqa_attention(
        cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_experts
    )
    return ModelProfile(
        name=name,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_blocks=cfg.num_blocks,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        expert_intermediate=cfg.intermediate_size,
        attn_params=attn,
        kv_bytes_per_token=kv,
        attn_flops_per_context_token=flops,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        source="shapes of a local checkpoint",
    )
