"""Mixtral (MixtralForCausalLM): GQA with an optional sliding window, softmax top-k renormalised, no shared
expert. Experts saved as `block_sparse_moe.experts.N.w1/w3/w2`; transformers 5 holds them packed under `mlp`."""

from __future__ import annotations

from typing import Any

from amoe.model.families.base import Family


class Mixtral(Family):
    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    default_rope_theta = 1e6
    default_rms_norm_eps = 1e-5
    default_bos_eos = (1, 2)
    moe = "block_sparse_moe"
    expert_projs = ("w1", "w3", "w2")  # gate, up, down

    def fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return dict(
            intermediate_size=hf["intermediate_size"],
            num_blocks=hf["num_hidden_layers"],
            num_experts=hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            sliding_window=hf.get("sliding_window"),
        )


MIXTRAL = Mixtral()
