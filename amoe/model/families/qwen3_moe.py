"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): RMSNorm on each query and key head before RoPE (QK-norm), head_dim
apart from hidden / heads, softmax top-k renormalised when norm_topk_prob (true in the released models), no
shared expert."""

from __future__ import annotations

from typing import Any

from amoe.model.families.base import Family, either, qwen_dense_layers
from amoe.model.spec import RouterSpec


class Qwen3Moe(Family):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"

    def fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        dense = qwen_dense_layers(hf, layers)
        bias = bool(hf.get("attention_bias", False))
        return dict(
            intermediate_size=hf["moe_intermediate_size"],
            num_blocks=layers - len(dense),
            dense_layers=dense,
            dense_intermediate_size=hf["intermediate_size"] if dense else 0,
            num_experts=either(hf, "num_experts", "num_local_experts"),
            top_k=hf["num_experts_per_tok"],
            attention_bias=bias,
            o_bias=bias,
            qk_norm="head",
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window") else None,
            router=RouterSpec(
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)), weights_in_model_dtype=True
            ),
        )


QWEN3_MOE = Qwen3Moe()
