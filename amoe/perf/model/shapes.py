"""Between cost profiles and the runtime's model shapes: the ModelConfig an emulated deployment's runtimes use, and
the cost profile of a checkpoint's config.json, whatever its family. (Kept apart from the profiles (gpus.py, models.py), which the config
validation reads and which must stay free of model code.)"""

from __future__ import annotations

from amoe.model.config import ModelConfig
from amoe.perf.model.models import ModelProfile, gqa_attention


def model_config_of(profile: ModelProfile) -> ModelConfig:
    """A ModelConfig with the profile's runtime-visible shapes (hidden, blocks, experts, top-k, shared expert,
    vocab)."""
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
        shared_intermediate_size=profile.shared_intermediate if profile.num_shared_experts else 0,
        max_position_embeddings=profile.max_position_embeddings,
        bos_token_id=profile.bos_token_id,
        eos_token_id=profile.eos_token_id,
        dtype="bfloat16",
    )


def profile_of(cfg: ModelConfig, name: str = "checkpoint") -> ModelProfile:
    """The cost profile of a checkpoint's shapes (BF16), any family: e.g. to emulate a local test model, or to plan
    a real one from its config.json alone (`amoe plan --model DIR`).

    A profile prices uniform blocks, so a block carries its share of the whole model: every decoder layer's
    attention and KV, the dense layers' MLPs (DeepSeek's first k run inside block 0's attention step), spread evenly
    over the MoE blocks — the totals per token are the model's. The shared expert is an expert layer of every block
    (expert id num_experts, on an expert GPU). MLA is priced as a GPU serving system runs it, absorbed: every head
    scores (kv_lora_rank + rope)-wide latent keys and sums kv_lora_rank-wide values; its KV is the latent."""
    layer_params, kv_bytes, flops = _attention_per_layer(cfg)
    h, layers, blocks = cfg.hidden_size, cfg.num_layers, cfg.num_blocks
    dense = 3 * h * cfg.dense_intermediate_size * len(cfg.dense_layers)
    per_block_extra = h * cfg.num_experts + (h if cfg.shared_gate else 0)  # router, shared-expert gate
    return ModelProfile(
        name=name,
        vocab_size=cfg.vocab_size,
        hidden_size=h,
        num_blocks=blocks,
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        expert_intermediate=cfg.intermediate_size,
        attn_params=round((layers * layer_params + dense) / blocks) + per_block_extra,
        kv_bytes_per_token=round(layers * kv_bytes / blocks),
        attn_flops_per_context_token=round(layers * flops / blocks),
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        num_shared_experts=cfg.num_shared_experts,
        shared_intermediate=cfg.shared_intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        source=f"shapes of a {cfg.architecture} checkpoint",
    )


def _attention_per_layer(cfg: ModelConfig) -> tuple[int, int, int]:
    """(params, KV bytes per token, FLOPs per query row per context token) of one decoder layer's attention."""
    if cfg.mla is None:
        params, kv, flops = gqa_attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 0)
        return params, kv, flops
    m, h, heads = cfg.mla, cfg.hidden_size, cfg.num_heads
    if m.q_lora_rank is None:
        q = h * heads * m.qk_head_dim
    else:
        q = h * m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
    kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim)
    kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    o = heads * m.v_head_dim * h
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    return q + kv_a + kv_b + o, latent * 2, 2 * heads * latent + 2 * heads * m.kv_lora_rank
