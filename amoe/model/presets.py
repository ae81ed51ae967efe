"""Named model shapes (Hugging Face Mixtral config dicts) for random-weight checkpoints."""

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


PRESETS: dict[str, dict[str, Any]] = {
    # Seconds-fast on CPU: for tests and the default demo model.
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
}


def preset(name: str) -> dict[str, Any]:
    """A fresh copy of the named preset's Hugging Face config dict."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r} (choose from {', '.join(PRESETS)})")
    return copy.deepcopy(PRESETS[name])
