"""The default model's shape and its training run: one frozen record, so a run is named by its settings."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Everything that decides the trained weights (with the corpus and the machine's arithmetic)."""

    seed: int = 0
    # One thread, always: a product split over another thread count sums in another order, and on a shared
    # machine two threads wait on each other (measured here under load: 13 s a step on two, 1.5 s on one).
    threads: int = 1
    vocab_size: int = 4096
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    num_experts: int = 8
    top_k: int = 2
    expert_size: int = 256  # each expert's SwiGLU width
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 1600
    lr: float = 2e-3
    min_lr_ratio: float = 0.1  # the cosine decay ends at lr * this
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # The load-balancing loss (Switch Transformer's, as transformers computes it): keeps every expert in use.
    router_aux_loss_coef: float = 0.01
    log_every: int = 50
    eval_every: int = 400

    def __post_init__(self) -> None:
        if (
            self.top_k > self.num_experts
            or self.num_heads % self.num_kv_heads
            or self.hidden_size % self.num_heads
        ):
            raise ValueError(f"inconsistent model shape: {self}")
        if min(self.steps, self.batch_size, self.seq_len, self.threads) < 1:
            raise ValueError(f"steps, batch_size, seq_len and threads must be positive: {self}")

    def with_overrides(self, **changes: Any) -> TrainSettings:
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def hf_config(self) -> dict[str, Any]:
        """The checkpoint's config.json (transformers' MixtralConfig fields)."""
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.expert_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.hidden_size // self.num_heads,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "hidden_act": "silu",
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_window": None,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "router_jitter_noise": 0.0,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "dtype": "bfloat16",
        }
