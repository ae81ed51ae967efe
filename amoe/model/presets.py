"""Named model shapes (Hugging Face config dicts of every supported family) for random-weight checkpoints."""

from __future__ import annotations

import copy
from typing import Any

from amoe.errors import ConfigError


def _mixtral(**shape: Any) -> dict[str, Any]:
    base = {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": 1024,  # the project's BPE tokenizer has at most 1024 tokens
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_window": None,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "dtype": "float32",
    }
    base.update(shape)
    return base


def _family(architecture: str, model_type: str, **shape: Any) -> dict[str, Any]:
    defaults = {"rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    return _mixtral(architectures=[architecture], model_type=model_type, **{**defaults, **shape})


def _families(size: str, hidden: int, layers: int, heads: int, expert: int) -> dict[str, dict[str, Any]]:
    """One preset of each non-Mixtral family at a size: its distinctive features on, several layers dense."""
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads)
    moe = dict(num_experts=8, moe_intermediate_size=expert, intermediate_size=4 * expert)
    deepseek = dict(
        common, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=expert,
        intermediate_size=4 * expert, first_k_dense_replace=1, kv_lora_rank=hidden // 2,
        qk_nope_head_dim=hidden // heads // 2, qk_rope_head_dim=hidden // heads // 4,
        v_head_dim=hidden // heads // 2, n_group=4, topk_group=2,
    )  # fmt: skip
    return {
        # Qwen1.5-MoE-A2.7B's features: q/k/v biases, a gated shared expert, top-4 not renormalised.
        f"{size}-qwen2-moe": _family(
            "Qwen2MoeForCausalLM", "qwen2_moe", **common, **moe, num_key_value_heads=heads // 2,
            num_experts_per_tok=4, shared_expert_intermediate_size=2 * expert, norm_topk_prob=False,
            qkv_bias=True, mlp_only_layers=[1],
        ),
        # Qwen3-30B-A3B's: QK-norm, head_dim apart from hidden / heads, renormalised top-k.
        f"{size}-qwen3-moe": _family(
            "Qwen3MoeForCausalLM", "qwen3_moe", **common, **moe, num_key_value_heads=heads // 2,
            head_dim=3 * hidden // heads // 2, num_experts_per_tok=2, norm_topk_prob=True,
        ),
        # OLMoE-1B-7B's: QK-norm over the whole projection, top-k not renormalised.
        f"{size}-olmoe": _family(
            "OlmoeForCausalLM", "olmoe", **common, num_key_value_heads=heads // 2, num_experts=8,
            num_experts_per_tok=2, intermediate_size=expert, norm_topk_prob=False, rms_norm_eps=1e-5,
        ),
        # DeepSeek-V2's: MLA without a query LoRA (V2-Lite), group-limited greedy routing (top-3 from the best 2 of
        # 4 groups: fewer groups than picks, so the limit bites), 2 shared experts.
        f"{size}-deepseek-v2": _family(
            "DeepseekV2ForCausalLM", "deepseek_v2", **{**deepseek, "num_experts_per_tok": 3}, q_lora_rank=None,
            n_shared_experts=2, topk_method="group_limited_greedy", routed_scaling_factor=2.0,
        ),
        # DeepSeek-V3's: MLA with a query LoRA, sigmoid + correction-bias grouped routing, YaRN RoPE.
        f"{size}-deepseek-v3": _family(
            "DeepseekV3ForCausalLM", "deepseek_v3", **deepseek, q_lora_rank=3 * hidden // 4, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 512,
                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
            },
        ),
    }  # fmt: skip


PRESETS: dict[str, dict[str, Any]] = {
    # Seconds-fast on CPU: for tests.
    "tiny": _mixtral(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    # Big enough that batching and the decode path matter; a 64-row decode step stays well under a second.
    "small": _mixtral(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
    **_families("tiny", hidden=64, layers=3, heads=4, expert=32),
    **_families("small", hidden=256, layers=8, heads=8, expert=256),
}


def preset(name: str) -> dict[str, Any]:
    """A fresh copy of the named preset's Hugging Face config dict."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r} (choose from {', '.join(PRESETS)})")
    return copy.deepcopy(PRESETS[name])
